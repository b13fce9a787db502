"""The RabbitMQ adapter's options and their validated form. No aio-pika import here:
the CLI reads every broker's options at start-up, RabbitMQ chosen or not."""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from relay.cloudevents import CloudEvents
from relay.contract import DEFAULT_PUBLISH_TIMEOUT, PublishLimits
from relay.dsn import describe_url, url_problem
from relay.errors import ConfigError
from relay.message import OutboxMessage
from relay.options import Option

SECTION = "rabbitmq"

# RabbitMQ's own default for max_message_size (128 MiB, since 3.8). A deployment that
# lowers it on the broker should lower this too, so oversized messages go to dead
# before they are sent instead of costing the batch its channel.
RABBITMQ_MAX_MESSAGE_SIZE = 128 * 1024 * 1024

# Without --publish-confirm-timeout the adapter waits for confirms for this share of
# --publish-timeout: it then still has time to hand back the confirms it did get, where
# the relay's own deadline would count the whole batch as unconfirmed.
CONFIRM_SHARE_OF_PUBLISH_TIMEOUT = 0.8

ROUTING_FIELDS = ("aggregate_type", "aggregate_id", "event_type")

OPTIONS: tuple[Option, ...] = (
    Option(
        "amqp_url",
        "str",
        None,
        "RabbitMQ URL, amqp://user:password@host:5672/vhost (amqps:// for TLS).",
        section=SECTION,
        key="url",
        secret=True,
    ),
    Option(
        "exchange",
        "str",
        "",
        "Exchange to publish to; empty (the default) is the default exchange, which routes by queue name.",
        section=SECTION,
    ),
    Option(
        "routing_key",
        "str",
        "{event_type}",
        "Routing-key template over {aggregate_type}, {aggregate_id} and {event_type}.",
        section=SECTION,
    ),
    Option(
        "declare",
        "bool",
        False,
        "Declare the exchange (durable, of --exchange-type) at start. By default the relay"
        " changes no broker topology and waits for the exchange to exist.",
        section=SECTION,
    ),
    Option(
        "exchange_type",
        "str",
        "topic",
        "Type of the exchange --declare creates: direct, topic, fanout, headers or a plugin's.",
        section=SECTION,
    ),
    Option(
        "unroutable",
        "choice",
        "wait",
        "A message no queue is bound for (312 NO_ROUTE): 'wait' holds it, no attempt spent, until"
        " a queue is bound for its routing key (a configuration fault, like a missing exchange);"
        " 'permanent' sends it to dead; 'retryable' retries it, spending attempts.",
        section=SECTION,
        choices=("wait", "permanent", "retryable"),
    ),
    Option(
        "publish_confirm_timeout",
        "duration",
        None,
        "How long one batch waits for broker confirms; unconfirmed messages are retried."
        " Default: 80% of --publish-timeout.",
        section=SECTION,
        key="confirm_timeout",
        minimum=0.01,  # seconds: 10 ms to a day, like --publish-timeout
        maximum=86400,
    ),
    Option(
        "amqp_max_message_size",
        "int",
        RABBITMQ_MAX_MESSAGE_SIZE,
        "Largest message body in bytes the broker accepts (its max_message_size); larger"
        " messages go to dead without being sent.",
        section=SECTION,
        key="max_message_size",
        minimum=1,
    ),
)


class RoutingKeyTemplate:
    """A ``str.format``-style template whose only fields are the message's aggregate type,
    aggregate id and event type; checked once, rendered per message without ``format``."""

    def __init__(self, text: str) -> None:
        self.text = text
        parts: list[Callable[[OutboxMessage], str]] = []
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise ConfigError(f"invalid --routing-key {text!r}: {exc}") from None
        for literal, name, spec, conversion in parsed:
            if literal:
                parts.append(_constant(literal))
            if name is None:
                continue
            if name not in ROUTING_FIELDS or spec or conversion:
                shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                raise ConfigError(
                    f"invalid --routing-key {text!r}: unknown field {shown}"
                    " (use {aggregate_type}, {aggregate_id} or {event_type})"
                )
            parts.append(_field(name))
        self._parts = tuple(parts)
        # The one key every message gets when the template names no field ("{{" read as "{"),
        # else None.
        fixed = not any(name is not None for _, name, _, _ in parsed)
        self.constant: str | None = "".join(literal for literal, _, _, _ in parsed) if fixed else None
        # The common templates skip the join: this runs once per message.
        self._single = parts[0] if len(parts) == 1 else None

    def render(self, message: OutboxMessage) -> str:
        if self._single is not None:
            return self._single(message)
        return "".join(part(message) for part in self._parts)

    def __repr__(self) -> str:
        return f"RoutingKeyTemplate({self.text!r})"


def _constant(text: str) -> Callable[[OutboxMessage], str]:
    return lambda _message: text


def _field(name: str) -> Callable[[OutboxMessage], str]:
    if name == "aggregate_type":
        return lambda m: m.aggregate_type
    if name == "aggregate_id":
        return lambda m: m.aggregate_id
    return lambda m: m.event_type


@dataclass(frozen=True)
class RabbitSettings:
    """Everything the RabbitMQ publisher needs, validated together."""

    url: str
    exchange: str = ""
    routing_key: RoutingKeyTemplate = field(default_factory=lambda: RoutingKeyTemplate("{event_type}"))
    declare: bool = False
    exchange_type: str = "topic"
    unroutable: Literal["wait", "permanent", "retryable"] = "wait"
    confirm_timeout: timedelta = DEFAULT_PUBLISH_TIMEOUT * CONFIRM_SHARE_OF_PUBLISH_TIMEOUT
    max_message_size: int = RABBITMQ_MAX_MESSAGE_SIZE
    # --envelope cloudevents[-json]: the RabbitMQ binding's ce- headers, or a structured body.
    cloudevents: CloudEvents | None = None

    def __post_init__(self) -> None:
        # Never quoted, not even masked: a malformed URL is parsed in ways that put pieces
        # of the password where a mask does not look (the host, the port, the vhost).
        problem = url_problem(self.url, ("amqp", "amqps"))
        if problem is not None:
            raise ConfigError(f"invalid --amqp-url: {problem} (expected amqp://user:password@host:port/vhost)")
        if self.declare and not self.exchange:
            raise ConfigError("--declare needs --exchange: the default exchange cannot be declared")
        if self.confirm_timeout <= timedelta(0):
            raise ConfigError("invalid --publish-confirm-timeout: must be longer than zero")

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> RabbitSettings:
        """Build from resolved option values (``relay.options.resolve``) and the core's
        ``limits`` (the confirm timeout defaults to a share of the publish timeout)."""
        url = values.get("amqp_url")
        if not url:
            raise ConfigError(
                "no RabbitMQ URL: pass --amqp-url, set RELAY_AMQP_URL, or put url in [rabbitmq] of the config file"
            )
        confirm = values.get("publish_confirm_timeout")
        if confirm is None:
            confirm = limits.publish_timeout * CONFIRM_SHARE_OF_PUBLISH_TIMEOUT
        return cls(
            url=str(url),
            exchange=values.get("exchange") or "",
            routing_key=RoutingKeyTemplate(values.get("routing_key") or "{event_type}"),
            declare=bool(values.get("declare")),
            exchange_type=values.get("exchange_type") or "topic",
            unroutable=values.get("unroutable") or "wait",
            confirm_timeout=confirm,
            max_message_size=int(values.get("amqp_max_message_size") or RABBITMQ_MAX_MESSAGE_SIZE),
            cloudevents=limits.cloudevents,
        )

    @property
    def where(self) -> str:
        """The broker's address for messages: user kept, password dropped."""
        return describe_url(self.url)

    @property
    def vhost(self) -> str:
        """The virtual host the URL names, as the broker sees it ("/" when the path is empty)."""
        return unquote(urlsplit(self.url).path[1:]) or "/"

    @property
    def user(self) -> str:
        return unquote(urlsplit(self.url).username or "guest")

    @property
    def exchange_label(self) -> str:
        """How log lines name the exchange (the default one has an empty name)."""
        return f"'{self.exchange}'" if self.exchange else "'' (the default exchange)"
