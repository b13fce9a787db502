"""The publisher contract: what the core asks of every broker adapter, and what it tells
one when it builds it.

The core owns this contract; adapters (``relay/adapters/``) import it, never the reverse. The
core reaches a concrete adapter only through :mod:`adapters.registry`, which the CLI calls.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, runtime_checkable

from relay.errors import BatchRaised, RetryableError, is_classified
from relay.message import OutboxMessage

# One outcome per message: None when the broker confirmed it, otherwise the failure-class
# exception (relay.RetryableError, PermanentError, Defer or BrokerUnavailable) saying why.
Outcome = BaseException | None


class Publisher(Protocol):
    """Delivers batches of outbox messages to a broker.

    Contract:

    - ``publish`` takes a batch and returns exactly one outcome per message, in the same
      order. It returns, rather than raises, per-message failures, so that brokers that
      batch (SQS) and brokers that confirm one by one (RabbitMQ) fit the same loop.
      Nothing one message brings (its headers, its payload, the destination's answer to
      it) may decide another message's outcome: build and send each message where what it
      raises becomes its own outcome (:func:`each_message` does that for adapters that
      send messages one by one). If ``publish`` raises all the same, a failure class is
      taken as the outcome of every message in the batch; anything else as
      :class:`relay.errors.BatchRaised`, and the relay publishes the messages again apart.
    - A message counts as delivered (None) only once the broker has confirmed it.
    - SDK exceptions never leave the adapter: they are translated into the failure classes.
      Anything else reaching the relay is treated as an adapter bug (dead, not retried).
    - Within a batch there is at most one ordered message per aggregate (the ordered claim
      leases only heads), so an adapter may publish a whole batch concurrently.
    - The relay cancels ``publish`` when the publish timeout passes; everything still
      unconfirmed then counts as retryable, since the broker may or may not have it.
    - ``publish`` may be called from several workers of one process concurrently.
    - ``start`` connects (and fails fast, with a one-line ``relay.ConfigError``, on settings
      no retry can fix, such as wrong credentials); ``close`` waits for nothing in flight
      to be lost and releases the connection.
    """

    name: str

    async def start(self) -> None: ...

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]: ...

    async def close(self) -> None: ...


# The brokers `--broker` accepts. Each is the adapter module of that name under relay/adapters/
# (adapters.registry imports it when it is chosen); adding a broker adds its name here.
BROKERS = ("sqs", "sns", "rabbitmq", "http", "kafka", "nats", "log")


@runtime_checkable
class WatchesDestinations(Protocol):
    """An optional ability (detected when needed): a publisher over several destinations
    that reports each one's health, ``on_change(destination, is_open)``, for the metrics."""

    def watch_destinations(self, on_change: Callable[[str, bool], None]) -> None: ...


class DestinationState(enum.Enum):
    """What a destination check found (:class:`DestinationCheck`)."""

    EXISTS = "exists"  # there (or, for what no look can tell, assumed there: see the reason)
    MISSING = "missing"  # the broker says it does not exist: its messages would wait
    DENIED = "access denied"  # the broker would not let us look; publishing may still work
    UNREACHABLE = "unreachable"  # no answer within CHECK_TIMEOUT_S, or the connection is down


@dataclass(frozen=True)
class DestinationCheck:
    """One destination as :meth:`ChecksDestinations.check_destinations` found it.

    :param destination: how people name it, as the adapter's log lines do ("exchange
        'orders' at amqp://relay@mq:5672/prod", "SQS queue https://..."); never a password.
    :param state: what the check found.
    :param reason: one line: the broker's own words for a problem, or what was (and was
        not) looked at.
    """

    destination: str
    state: DestinationState
    reason: str = ""

    @property
    def known_absent(self) -> bool:
        """Missing or unreachable: its messages cannot go now, and the relay is not ready.
        A destination we may not look at (DENIED) is not known absent: sending may be
        allowed where looking is not (send-only credentials)."""
        return self.state in (DestinationState.MISSING, DestinationState.UNREACHABLE)

    def describe(self) -> str:
        """``<destination> <state>: <reason>``, one line for logs, /readyz and the CLI."""
        return f"{self.destination} {self.state.value}" + (f": {self.reason}" if self.reason else "")


# How long one destination's check may take: a broker that answers nothing in this long
# counts as unreachable for now (a later check asks again).
CHECK_TIMEOUT_S = 5.0


@runtime_checkable
class ChecksDestinations(Protocol):
    """An optional ability (detected when needed, see :func:`check_destinations`): a
    publisher that can look at every destination it will publish to before it publishes.

    Contract of ``check_destinations``:

    - Call it after ``start`` and before ``close``; it may run beside ``publish``, and as
      often as the caller likes (`relay start` checks again every few seconds while a
      destination is missing). It changes nothing on the broker (passive looks only).
    - It returns one :class:`DestinationCheck` per destination the publisher will use, in a
      stable order: for RabbitMQ the exchange (a passive declare), for SQS the queue
      (GetQueueAttributes), for SNS the topic (GetTopicAttributes); a publisher over routes
      (:class:`relay.routing.RoutedPublisher`) every route's destination and the default one.
    - It never raises for what it finds: a missing destination, a refusal or a broker that
      does not answer within :data:`CHECK_TIMEOUT_S` are results (MISSING, DENIED,
      UNREACHABLE, each with the broker's reason); only cancellation ends it early.
    - What a look cannot tell is said in the result's reason, not guessed. RabbitMQ's
      default exchange (no ``--exchange``) always exists: whether a routing key reaches a
      queue only a publish tells (``mandatory`` and ``basic.return``), so it is EXISTS
      with that said, unless the routing key is a constant, when the queue of that name
      (where the default exchange routes it) is looked at instead. A passive declare needs
      no permission, so EXISTS does not promise that the user may publish; SQS and SNS
      answer DENIED to credentials that may send but not read attributes.
    - ``start`` itself does not report a missing destination: the caller says what this
      found (one line per destination that is not EXISTS).
    """

    async def check_destinations(self) -> Sequence[DestinationCheck]: ...


async def check_destinations(publisher: Publisher) -> list[DestinationCheck] | None:
    """What ``publisher`` found of its destinations (:class:`ChecksDestinations`), or None
    when it cannot look (the log broker, a test double): the one call `relay start` and
    `relay replay` make."""
    if not isinstance(publisher, ChecksDestinations):
        return None
    return list(await publisher.check_destinations())


@runtime_checkable
class ReportsUnroutable(Protocol):
    """An optional ability: a publisher whose destination can exist and still route some
    messages nowhere (RabbitMQ: an exchange with no queue bound for a routing key, 312
    NO_ROUTE on a mandatory publish) holds those messages, attempt refunded, and says here
    which such keys hold messages now, one line each (at most a bounded number of them),
    for /readyz and the ``outbox_relay_unroutable_routing_keys`` gauge."""

    def unroutable(self) -> Sequence[str]: ...


# The core's default for --publish-timeout, for adapters' own defaults derived from it.
DEFAULT_PUBLISH_TIMEOUT = timedelta(seconds=20)


@dataclass(frozen=True)
class PublishLimits:
    """The core settings an adapter sizes itself by, passed to it when it is built: an
    adapter never reads the core's options itself.

    :param publish_timeout: the relay cancels a batch's publish after this long, so the
        adapter's own timeouts (confirms, SDK calls) should end inside it.
    :param workers: dispatch loops that may call ``publish`` at once.
    :param batch_size: messages one ``publish`` receives at most.
    """

    publish_timeout: timedelta
    workers: int
    batch_size: int


# The RetryableError of a publish that ran out of time starts with this.
TIMEOUT_PREFIX = "publish timed out"


# The event loop's time by which the publish in progress must end, for an adapter that
# paces its own sends (relay.errors.NotSent); set by publish_within.
_DEADLINE: ContextVar[float | None] = ContextVar("relay_publish_deadline", default=None)


def publish_deadline() -> float | None:
    """When the publish in progress is cut short, in the running loop's time
    (``asyncio.get_running_loop().time()``); None outside :func:`publish_within`. An adapter
    that makes messages wait for a limit of its own returns :class:`relay.errors.NotSent`
    for those that could no longer be sent and answered in time, instead of letting the
    deadline cut them (which spends an attempt on a message that was never sent)."""
    return _DEADLINE.get()


async def each_message(
    batch: Sequence[OutboxMessage], send: Callable[[OutboxMessage], Awaitable[Outcome]]
) -> list[Outcome]:
    """``send`` run for every message of ``batch`` at once; one outcome per message, in
    order. What one send raises is that message's outcome alone (an exception that is no
    failure class is an adapter bug: that message goes to dead and the worker logs the
    traceback), never its neighbours': a message the destination accepted stays delivered
    whatever another's request raised. Cancelling the call cancels every send."""
    results = await asyncio.gather(*(send(m) for m in batch), return_exceptions=True)
    return [_own_outcome(result) for result in results]


def _own_outcome(result: Outcome | BaseException) -> Outcome:
    if isinstance(result, asyncio.CancelledError):
        # One send cancelled on its own (not the whole publish, which raises instead): the
        # destination may or may not have the message.
        return RetryableError("the send was cancelled before the destination answered")
    return result


async def publish_within(publisher: Publisher, messages: Sequence[OutboxMessage], deadline_s: float) -> list[Outcome]:
    """``publisher.publish(messages)`` held to the contract, for every caller (the
    workers, relay replay): one outcome per message whatever happens. Past ``deadline_s``
    the publish is cancelled and every message counts as retryable (the broker may or may
    not have it; consumers de-duplicate by id); an exception is every message's outcome;
    a wrong number of outcomes is an adapter bug, the outcome of them all. An exception
    raised for the whole batch is every message's outcome when it is a failure class;
    anything else, for more than one message, is :class:`relay.errors.BatchRaised`: the
    worker then publishes them apart, so that only a message that raises alone pays."""
    token = _DEADLINE.set(asyncio.get_running_loop().time() + deadline_s)
    try:
        async with asyncio.timeout(deadline_s):
            outcomes = list(await publisher.publish(messages))
    except TimeoutError:
        return [RetryableError(f"{TIMEOUT_PREFIX} after {deadline_s:g}s")] * len(messages)
    except Exception as exc:  # the adapter raised for the whole batch
        if len(messages) > 1 and not is_classified(exc):
            shared = BatchRaised(f"the publisher raised for the whole batch: {type(exc).__name__}: {exc}")
            shared.__cause__ = exc
            return [shared] * len(messages)
        return [exc] * len(messages)
    finally:
        _DEADLINE.reset(token)
    if len(outcomes) != len(messages):
        bug = RuntimeError(
            f"publisher {publisher.name!r} returned {len(outcomes)} outcomes for {len(messages)} messages"
        )
        return [bug] * len(messages)
    return outcomes
