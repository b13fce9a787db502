"""Sorting what aio-pika and aiormq report for one publish into the relay's failure classes.

A batch is classified as a whole, because one broker decision can fail every message of
a channel: a missing exchange (404) or a refused permission (403) closes the channel, and
so does a message over the broker's size limit (406), which fails its innocent neighbours
too. The first two concern every message (BrokerUnavailable: nothing goes to dead, no
attempt is spent); the size limit concerns one message only (PermanentError for it,
RetryableError for the neighbours, which were never routed).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass

import aiormq.exceptions as amqp_errors
from pamqp import commands

from relay.adapters.rabbitmq.envelope import Envelope
from relay.adapters.rabbitmq.settings import RabbitSettings
from relay.contract import Outcome
from relay.errors import BrokerUnavailable, PermanentError, RetryableError, SharedFailure

NO_ROUTE = 312

# RabbitMQ's reply text when a body exceeds max_message_size ("configured" only when the
# limit is not the built-in maximum); the channel closes with 406 PRECONDITION_FAILED.
_OVERSIZE = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")

# Failures that mean "the channel or connection went away before the confirm came":
# the broker may or may not have routed the message.
_LOST = (
    amqp_errors.AMQPConnectionError,
    amqp_errors.ChannelClosed,
    amqp_errors.ChannelInvalidStateError,
    amqp_errors.AMQPError,
    ConnectionError,
    OSError,
    asyncio.CancelledError,  # a confirm future cancelled under us by a closing channel
)


class _Unconfirmed(Exception):
    """Placeholder outcome: the confirm deadline passed before this message's confirm."""


class _NotSent(Exception):
    """Placeholder outcome: not published, because the channel failed (or the probe on a
    fresh channel did not come back) before its turn."""


class _Held(Exception):
    """Placeholder outcome: not sent, because an earlier ordered message of its aggregate
    in the same batch was not confirmed."""


class Unroutable(BrokerUnavailable):
    """312 NO_ROUTE under ``--unroutable wait``: a configuration fault, not the message's.
    The publisher replaces it with its routing key's held outcome
    (:mod:`adapters.rabbitmq.unroutable`); should one slip through, it still spends no
    attempt and sends nothing to 'dead'."""


UNCONFIRMED = _Unconfirmed()
NOT_SENT = _NotSent()
HELD = _Held()


@dataclass(frozen=True)
class BatchFault:
    """What one failure tells about the whole batch's channel."""

    unavailable: BrokerUnavailable | None = None  # every message: 404, 403
    size_limit: int | None = None  # the broker's max_message_size, learned from a 406

    @classmethod
    def of(cls, raws: Sequence[BaseException | None], settings: RabbitSettings) -> BatchFault:
        unavailable = None
        size_limit = None
        for raw in raws:
            if unavailable is None and isinstance(raw, amqp_errors.ChannelNotFoundEntity):
                unavailable = exchange_missing(settings, reply_text(raw))
            elif unavailable is None and isinstance(raw, amqp_errors.ChannelAccessRefused):
                unavailable = access_refused(settings, reply_text(raw))
            elif size_limit is None and isinstance(raw, amqp_errors.ChannelPreconditionFailed):
                match = _OVERSIZE.search(reply_text(raw))
                if match:
                    size_limit = int(match.group(2))
        return cls(unavailable, size_limit)


def classify(
    raw: BaseException | None,
    envelope: Envelope,
    settings: RabbitSettings,
    fault: BatchFault,
    confirm_timeout_s: float,
) -> Outcome:
    """The outcome of one message given what its publish raised (``raw``) and the batch's fault."""
    if raw is None:
        return None
    if isinstance(raw, amqp_errors.DeliveryError):  # PublishError (a return) is a subclass
        return _delivery_error(raw, envelope, settings)
    if raw is UNCONFIRMED:
        return RetryableError(
            f"no confirm from RabbitMQ within {confirm_timeout_s:g}s; the broker may still have"
            " the message (consumers de-duplicate by message_id)"
        )
    if raw is HELD:
        return RetryableError(
            f"not sent: an earlier ordered message of aggregate {envelope.source.aggregate_id!r}"
            " in the same batch was not confirmed"
        )
    size = len(envelope.body)
    if fault.size_limit is not None and size > fault.size_limit:
        return PermanentError(
            f"message body of {size} bytes exceeds the broker's max_message_size of"
            f" {fault.size_limit} bytes (406 PRECONDITION_FAILED)"
        )
    if fault.unavailable is not None:
        return fault.unavailable
    if raw is NOT_SENT:
        return SharedFailure("not sent: the channel failed, or the message before it timed out, before its turn")
    if fault.size_limit is not None:
        return RetryableError(
            "not confirmed: the broker closed the channel because another message of the batch"
            f" exceeded its max_message_size of {fault.size_limit} bytes"
        )
    if isinstance(raw, TypeError | ValueError):
        # The client refused to encode the message (the envelope checks should have caught
        # it first): nothing was sent, and the same message would be refused again.
        return PermanentError(f"the AMQP client cannot send this message: {raw}")
    if isinstance(raw, amqp_errors.ChannelClosed | amqp_errors.ChannelInvalidStateError):
        return SharedFailure(f"channel closed before the broker confirmed: {describe(raw)}")
    if isinstance(raw, _LOST):
        return SharedFailure(
            f"connection to RabbitMQ lost before the broker confirmed (it may or may not have the"
            f" message): {describe(raw)}"
        )
    return raw  # unclassified: the relay reports it as an adapter bug


def _delivery_error(raw: amqp_errors.DeliveryError, envelope: Envelope, settings: RabbitSettings) -> Outcome:
    frame = raw.frame
    if isinstance(frame, commands.Basic.Return):
        text = (
            f"unroutable: exchange {settings.exchange_label} returned the message for routing key"
            f" {envelope.routing_key!r} ({frame.reply_code} {frame.reply_text}): no queue is bound for it"
        )
        if frame.reply_code == NO_ROUTE and settings.unroutable == "wait":
            return Unroutable(text)
        if frame.reply_code == NO_ROUTE and settings.unroutable == "permanent":
            return PermanentError(text)
        return RetryableError(text)
    # Basic.Nack: a queue refused the message (x-overflow reject-publish, a full or
    # unavailable quorum queue) or the broker failed internally; both can pass.
    return RetryableError(f"the broker nacked the message ({frame.name}); a queue refused it or is unavailable")


def exchange_missing(settings: RabbitSettings, reply: str) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"exchange {settings.exchange_label} not found in vhost '{settings.vhost}' at {settings.where}"
        f" ({reply or '404 NOT_FOUND'}); messages wait, no attempt spent, until it exists"
    )


def access_refused(settings: RabbitSettings, reply: str) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"user '{settings.user}' may not publish to exchange {settings.exchange_label} in vhost"
        f" '{settings.vhost}' at {settings.where} ({reply or '403 ACCESS_REFUSED'}); messages wait,"
        " no attempt spent, until the permission is granted"
    )


def reply_text(exc: BaseException) -> str:
    """The broker's reply text of a channel close ("NOT_FOUND - no exchange ..."), if any."""
    texts = [a for a in exc.args if isinstance(a, str)]
    return texts[-1] if texts else ""


def describe(exc: BaseException) -> str:
    text = reply_text(exc) or str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
