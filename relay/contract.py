"""The publisher contract: what the core asks of every destination's adapter, what it
tells one when it builds it, and how a destination declares itself (:class:`DestinationSpec`).

The core owns this contract; adapters (``relay/adapters/``, and installed packages) import
it, never the reverse. The core reaches a concrete adapter only through
:mod:`adapters.registry`, which finds each destination's spec by its name.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeAlias, TypeVar, runtime_checkable

from relay.cloudevents import CloudEvents
from relay.errors import BatchRaised, ConfigError, RetryableError, is_classified
from relay.message import OutboxMessage

if TYPE_CHECKING:
    from relay.options import Option

Outcome: TypeAlias = BaseException | None
"""One message's outcome, as :meth:`Publisher.publish` returns it: None when the destination
confirmed the message, otherwise the failure-class exception saying why
(:class:`relay.RetryableError`, :class:`relay.PermanentError`, :class:`relay.Defer`,
:class:`relay.NotSent` or :class:`relay.BrokerUnavailable`)."""


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

    async def start(self) -> None:
        """Connect; raise a one-line :class:`relay.ConfigError` for what no retry can fix."""

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        """One outcome per message of ``batch``, in its order (see the class's contract)."""
        ...

    async def close(self) -> None:
        """Wait for what is in flight, then release the connection; closing twice is allowed."""


@runtime_checkable
class WatchesDestinations(Protocol):
    """An optional ability (detected when needed): a publisher over several destinations
    that reports each one's health, ``on_change(destination, is_open)``, for the metrics."""

    def watch_destinations(self, on_change: Callable[[str, bool], None]) -> None:
        """Call ``on_change(destination, is_open)`` whenever a destination's health changes."""


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

    async def check_destinations(self) -> Sequence[DestinationCheck]:
        """One :class:`DestinationCheck` per destination this publisher will use (see above)."""
        ...


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

    def unroutable(self) -> Sequence[str]:
        """One line per routing key that holds messages now because nothing routes it."""
        ...


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
    :param cloudevents: write each message as a CloudEvent (``--envelope``), in this
        binding's way (relay.cloudevents); None: the relay's own envelope.
    """

    publish_timeout: timedelta
    workers: int
    batch_size: int
    cloudevents: CloudEvents | None = None


class DestinationSettings(Protocol):
    """What a destination's settings type offers: it is built, checked, from the resolved
    values of the destination's options (``{"queue_url": ..., "region": ...}``, keyed by
    each option's ``dest``) and the core's limits, raising one :class:`relay.ConfigError`
    line for a bad value. A frozen dataclass with this classmethod is the usual shape."""

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> Self:
        """The settings from resolved option values; :class:`relay.ConfigError` on a bad one."""
        ...


S = TypeVar("S", bound=DestinationSettings)

# What `--broker` accepts as a destination's name (and the TOML table its options may use).
_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class DestinationSpec(Generic[S]):
    """One destination, as the relay finds it by name: what ``--broker NAME`` builds.

    The built-in destinations each declare one in their package (``relay.adapters.sqs.SPEC``);
    an installed package declares one and names it in the entry-point group
    ``outbox_relay.destinations`` (see "Writing a destination" in the manual). The module
    that holds it is imported whenever the relay lists every destination's options (each
    ``relay`` command does), so it must not import the destination's SDK: name the
    publisher as ``"module:Class"`` and it is imported only when the destination is used.

    :param name: what ``--broker`` takes: lowercase letters, digits and single dashes.
    :param settings: the settings type (:class:`DestinationSettings`): built once from the
        option values, then handed to the publisher.
    :param publisher: what builds the publisher from the settings: a callable, or
        ``"module:attribute"`` naming one, imported when the first publisher is built.
    :param options: the destination's own options (``relay.Option``), each with the
        destination's TOML table as its ``section``; none for a destination without any.
    :param sdk_modules: the top-level modules of the SDK the publisher imports, so that one
        missing is told as what to install, in one line, instead of a traceback.
    :param extra: what ``pip install`` installs them as (``outbox-relay[rabbitmq]``);
        required with ``sdk_modules``.
    :param max_envelope_fields: how many fields of :meth:`OutboxMessage.envelope` (the
        relay's and the producer's headers) one message can carry on this wire; None for no
        limit of that kind (SQS and SNS carry 10 message attributes). The relay leaves a
        trace context out rather than exceed it.
    """

    name: str
    settings: type[S]
    publisher: str | Callable[[S], Publisher]
    options: tuple[Option, ...] = ()
    sdk_modules: tuple[str, ...] = ()
    extra: str = ""
    max_envelope_fields: int | None = None

    def __post_init__(self) -> None:
        # Checked when the spec is made (at import), so that a wrong spec fails where it is
        # written, not at the first publish of a relay that chose it.
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"destination name {self.name!r}: use lowercase letters, digits and single dashes")
        if isinstance(self.publisher, str) and not re.fullmatch(r"[\w.]+:[\w.]+", self.publisher):
            raise ValueError(f"destination {self.name}: publisher {self.publisher!r} is not 'module:attribute'")
        if self.sdk_modules and not self.extra:
            raise ValueError(
                f"destination {self.name}: sdk_modules {self.sdk_modules} need the extra that installs them"
            )
        if self.max_envelope_fields is not None and self.max_envelope_fields < 1:
            raise ValueError(f"destination {self.name}: max_envelope_fields must be at least 1")

    def create(self, settings: S | Mapping[str, Any], limits: PublishLimits) -> Publisher:
        """A new publisher (not started) for ``settings``, or for the resolved option values
        they are built from, and the core's ``limits``. A bad setting raises its one-line
        :class:`relay.ConfigError`, and so does a missing SDK, naming what to install."""
        built = self.settings.from_values(settings, limits) if isinstance(settings, Mapping) else settings
        try:
            factory = _imported(self.publisher) if isinstance(self.publisher, str) else self.publisher
            return factory(built)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").partition(".")[0]
            if missing not in self.sdk_modules:
                raise
            raise ConfigError(
                f"--broker {self.name} needs {missing}, which is not installed: pip install '{self.extra}'"
            ) from None


def _imported(path: str) -> Any:
    """The object ``"module:attribute"`` names (an entry point's form), imported now."""
    module_name, _, attribute = path.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


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
    batch: Sequence[OutboxMessage],
    send: Callable[[OutboxMessage], Awaitable[Outcome]],
    *,
    at_once: int | None = None,
) -> list[Outcome]:
    """``send`` run for every message of ``batch``, at most ``at_once`` at a time (None:
    all at once); one outcome per message, in order. What one send raises is that
    message's outcome alone (an exception that is no failure class is an adapter bug: that
    message goes to dead and the worker logs the traceback), never its neighbours': a
    message the destination accepted stays delivered whatever another's request raised.
    Cancelling the call cancels every send.

    With ``at_once``, that many lanes take the messages in turn: a destination that takes
    only so many requests at a time (HTTP's connection pool) then costs a task per lane,
    not one per message waiting for its turn."""
    if at_once is None or at_once >= len(batch):
        results = await asyncio.gather(*(send(m) for m in batch), return_exceptions=True)
        return [_own_outcome(result) for result in results]
    outcomes: list[Outcome] = [None] * len(batch)
    turns = iter(enumerate(batch))

    async def lane() -> None:
        for i, m in turns:
            try:
                outcomes[i] = await send(m)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the whole publish is cancelled
                outcomes[i] = _own_outcome(exc)
            except Exception as exc:
                outcomes[i] = exc

    await asyncio.gather(*(lane() for _ in range(max(at_once, 1))))
    return outcomes


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
