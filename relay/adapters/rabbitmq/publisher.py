"""The RabbitMQ publisher: persistent, mandatory messages on confirm channels of one
robust aio-pika connection, a batch's confirms awaited together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import aio_pika
import aio_pika.abc
import aio_pika.exceptions
import aiormq
import aiormq.exceptions as amqp_errors

from relay.adapters.outage import OutageLog
from relay.adapters.quiet_logs import QuietLines
from relay.adapters.rabbitmq.blocked import Blocking
from relay.adapters.rabbitmq.classify import (
    HELD,
    NOT_SENT,
    UNCONFIRMED,
    BatchFault,
    Unroutable,
    classify,
    describe,
    reply_text,
)
from relay.adapters.rabbitmq.envelope import MIN_FRAME_MAX, Envelope, build
from relay.adapters.rabbitmq.settings import RabbitSettings
from relay.adapters.rabbitmq.unroutable import UnroutableKeys
from relay.contract import CHECK_TIMEOUT_S, DestinationCheck, DestinationState, Outcome
from relay.dsn import mask
from relay.errors import (
    BrokerUnavailable,
    ConfigError,
    DestinationUnavailable,
    PermanentError,
    SharedFailure,
    first_line,
)
from relay.message import OutboxMessage
from relay.textsafe import clip, escape

log = logging.getLogger("relay.adapters.rabbitmq")

# `relay start` tries this often before it gives up with exit code 2, waiting the delays
# below in between: about 2 s in all, enough for a broker that is just coming up, short
# enough that a typo in the URL is reported at once.
CONNECT_ATTEMPTS = 3
CONNECT_RETRY_DELAYS_S = (0.5, 1.5)
CONNECT_TIMEOUT_S = 5.0
# After the start, a lost connection is re-dialled this often in the background (aio-pika's
# default is 5 s; delivery should resume within a second or two of the broker's return).
RECONNECT_INTERVAL_S = 1.0
CHANNEL_OPEN_TIMEOUT_S = 5.0
CHANNEL_CLOSE_TIMEOUT_S = 2.0

_CONNECT_ERRORS = (*aio_pika.exceptions.CONNECTION_EXCEPTIONS, TimeoutError)
_CHANNEL_ERRORS = (amqp_errors.AMQPError, ConnectionError, OSError, RuntimeError, TimeoutError)


@dataclass
class _Lane:
    """A confirm channel, its aiormq channel underneath, and whether the exchange has been
    seen to take a message on it. One batch uses a lane at a time, so a channel the broker
    closes fails only that batch, and returns (matched to their publish by message_id)
    never meet a second in-flight copy of the same id."""

    channel: aio_pika.abc.AbstractChannel
    underlay: aiormq.Channel
    proven: bool = False


class RabbitPublisher:
    """Publishes outbox messages to one exchange; see :class:`relay.contract.Publisher`.

    A message counts as delivered only when the broker acked it on a confirm channel.
    Every failure aio-pika or the broker reports is sorted into the relay's failure
    classes by :mod:`adapters.rabbitmq.classify`.
    """

    name = "rabbitmq"

    def __init__(self, settings: RabbitSettings, *, connection_name: str | None = None) -> None:
        """:param settings: validated options (see :class:`RabbitSettings`).
        :param connection_name: how the broker lists the connection (``rabbitmqctl
            list_connections client_properties``); default ``outbox-relay <host>:<pid>``."""
        self.settings = settings
        self.connection_name = connection_name or f"outbox-relay {socket.gethostname()}:{os.getpid()}"
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._idle: list[_Lane] = []
        self._frame_max = MIN_FRAME_MAX
        self._learned_max_size: int | None = None
        self._outage = OutageLog(log, "RabbitMQ")
        self._unroutable = UnroutableKeys(log, f"exchange {settings.exchange_label} at {settings.where}")
        self._quiet = QuietReconnects()
        self._blocking = Blocking(log, settings.where)
        self._closing = False
        self._background: set[asyncio.Task[None]] = set()
        # Confirm waits in progress, cut short when the connection is lost (the broker can
        # no longer answer them), and how many times it was lost (a batch that saw it
        # failed as a whole: relay.isolation).
        self._confirm_waits: set[asyncio.Timeout] = set()
        self._losses = 0

    # -- life cycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (a short retry, then ``ConfigError``), and with ``--declare`` declare the
        exchange.

        A missing exchange is not an error here, nor said here: topology is often created
        after the relay starts, and messages simply wait for it; :meth:`check_destinations`
        tells whether it is there. Only with ``--declare`` does a failure to create it stop
        the start.
        """
        self._quiet.install()
        try:
            self._connection = await self._connect()
            self._connection.close_callbacks.add(self._on_connection_lost)
            self._connection.reconnect_callbacks.add(self._on_reconnected)
            self._frame_max = self._negotiated_frame_max(self._connection)
            log.info(
                "connected to RabbitMQ at %s: exchange %s, routing key %r",
                self.settings.where,
                self.settings.exchange_label,
                self.settings.routing_key.text,
            )
            if self.settings.declare:
                await self._declare_exchange()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close the channels and the connection. The relay calls this once its workers are
        done, so no publish is in flight."""
        self._closing = True
        lanes, self._idle = self._idle, []
        # A blocked broker reads no Channel.Close (each would wait out its timeout): closing
        # the connection ends its channels anyway.
        if self._blocking.reason is None:
            for lane in lanes:
                await _close_channel(lane.channel)
        else:
            for task in self._background:
                task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._connection is not None:
            with contextlib.suppress(*_CHANNEL_ERRORS):
                await self._connection.close()
            self._connection = None
        self._quiet.remove()

    # -- publishing ------------------------------------------------------------------

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        """One outcome per message, in order: None once the broker confirmed it. A message
        whose routing key is held as unroutable waits unsent (one probe per key at a time,
        :mod:`adapters.rabbitmq.unroutable`)."""
        outcomes: list[Outcome] = [None] * len(batch)
        ready: list[tuple[int, Envelope]] = []
        now = datetime.now(UTC)
        keys = self._unroutable
        probes: list[str] = []
        for i, m in enumerate(batch):
            try:
                built = build(m, self.settings, self._frame_max, self._learned_max_size, now)
            except Exception as exc:  # what this message's own fields make: its outcome alone
                built = PermanentError(
                    f"cannot make an AMQP message of this message: {type(exc).__name__}: {mask(first_line(exc))}"
                )
            if not isinstance(built, Envelope):
                outcomes[i] = built
            elif keys.is_held(built.routing_key) and not keys.take_probe(built.routing_key):
                outcomes[i] = keys.waiting(built.routing_key)
            else:
                if keys.is_held(built.routing_key):
                    probes.append(built.routing_key)
                ready.append((i, built))
        if ready:
            try:
                sent = await self._send([envelope for _, envelope in ready])
            except BaseException:  # cancelled (the publish timeout): the probes end without a verdict
                for key in probes:
                    keys.no_verdict(key)
                raise
            for (i, envelope), outcome in zip(ready, sent, strict=True):
                outcomes[i] = self._routed(envelope.routing_key, outcome)
        self._note(outcomes)
        return outcomes

    def _routed(self, key: str, outcome: Outcome) -> Outcome:
        """What a sent message's outcome says of its routing key, and its outcome then."""
        if isinstance(outcome, Unroutable):
            return self._unroutable.returned(key, str(outcome))
        if outcome is None:
            self._unroutable.delivered(key)
        else:
            self._unroutable.no_verdict(key)
        return outcome

    def unroutable(self) -> tuple[str, ...]:
        """The routing keys held now because no queue is bound for them
        (:class:`relay.contract.ReportsUnroutable`)."""
        return self._unroutable.held()

    async def check_destinations(self) -> list[DestinationCheck]:
        """The exchange, by a passive declare on a channel of its own; on the default
        exchange, the queue a constant routing key names (see
        :class:`relay.contract.ChecksDestinations`)."""
        return [await self._check()]

    async def _check(self) -> DestinationCheck:
        s = self.settings
        queue = None if s.exchange else s.routing_key.constant
        if s.exchange:
            what = f"exchange '{s.exchange}' in vhost '{s.vhost}' at {s.where}"
        elif queue is not None:
            what = f"queue {queue!r} (where the default exchange routes routing key {queue!r}) at {s.where}"
        else:
            return DestinationCheck(
                f"the default exchange at {s.where}",
                DestinationState.EXISTS,
                f"it always exists; whether routing key {s.routing_key.text!r} reaches a queue only a publish"
                " tells (a mandatory publish comes back NO_ROUTE), and messages of a key no queue is bound for wait",
            )
        connection = self._connection
        blocked = self._blocking.refusal()
        if blocked is not None:
            return DestinationCheck(what, DestinationState.UNREACHABLE, str(blocked))
        if connection is None or self._closing or not connection.connected.is_set():
            return DestinationCheck(what, DestinationState.UNREACHABLE, "the connection to RabbitMQ is down")
        channel: aio_pika.abc.AbstractChannel | None = None
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                channel = await self._open_channel()
                if queue is None:
                    await channel.get_exchange(s.exchange, ensure=True)  # a passive declare
                else:
                    await channel.get_queue(queue, ensure=True)
        except amqp_errors.ChannelNotFoundEntity as exc:
            return DestinationCheck(what, DestinationState.MISSING, mask(reply_text(exc) or "404 NOT_FOUND"))
        except amqp_errors.ChannelAccessRefused as exc:
            return DestinationCheck(what, DestinationState.DENIED, mask(reply_text(exc) or "403 ACCESS_REFUSED"))
        except amqp_errors.ChannelLockedResource:
            # An exclusive queue of another connection: it exists, and the exchange routes to it.
            return DestinationCheck(what, DestinationState.EXISTS, "exclusive to another connection")
        except TimeoutError:
            return DestinationCheck(what, DestinationState.UNREACHABLE, f"no answer within {CHECK_TIMEOUT_S:g}s")
        except _CHANNEL_ERRORS as exc:
            return DestinationCheck(what, DestinationState.UNREACHABLE, mask(describe(exc)))
        finally:
            if channel is not None:
                await _close_channel(channel)
        return DestinationCheck(what, DestinationState.EXISTS)

    async def _send(self, envelopes: Sequence[Envelope]) -> list[Outcome]:
        if self._connection is not None and self._connection.transport is not None:
            self._blocking.watch(self._connection.transport.connection)
        blocked = self._blocking.refusal()
        if blocked is not None:
            # Nothing is sent: a blocked broker would not read it before the unblock.
            return [blocked] * len(envelopes)
        lane = await self._acquire()
        if isinstance(lane, BrokerUnavailable):
            return [lane] * len(envelopes)
        raws: list[BaseException | None] = [NOT_SENT] * len(envelopes)
        timeout = self.settings.confirm_timeout.total_seconds()
        reusable = False
        losses = self._losses
        deadline: asyncio.Timeout | None = None
        try:
            try:
                async with asyncio.timeout(timeout) as deadline:
                    self._confirm_waits.add(deadline)
                    with self._blocking.cut_short(deadline):
                        chains = _chains(envelopes)
                        if not lane.proven:
                            # A fresh channel first carries one message alone: a missing exchange
                            # or a refused permission then closes the channel with nothing else
                            # in flight (see _publish_one for why that matters).
                            probe, chains = chains[0], chains[1:]
                            await self._send_chain(lane, probe, raws)
                            lane.proven = _proves_exchange(raws[probe[0][0]])
                        if lane.proven and chains:
                            # The rest is written at once and the confirms are awaited together:
                            # one round trip per batch, not one per message.
                            async with asyncio.TaskGroup() as tasks:
                                for chain in chains:
                                    tasks.create_task(self._send_chain(lane, chain, raws))
                reusable = lane.proven and not any(_channel_failed(raw) for raw in raws)
            except TimeoutError:
                pass  # the unconfirmed keep UNCONFIRMED; a stalled channel is not reused
        finally:
            if deadline is not None:
                self._confirm_waits.discard(deadline)
            self._release(lane, reusable)
        lost = self._losses != losses
        fault = BatchFault.of(raws, self.settings)
        current_limit = self._learned_max_size or self.settings.max_message_size
        if fault.size_limit is not None and fault.size_limit < current_limit:
            # Checked before sending from now on: a broker-side refusal closes the channel
            # under the rest of the batch.
            self._learned_max_size = fault.size_limit
            log.warning(
                "RabbitMQ's max_message_size is %d bytes, lower than --amqp-max-message-size (%d):"
                " larger messages now go to dead without being sent",
                fault.size_limit,
                self.settings.max_message_size,
            )
        # Blocked with confirms outstanding: what was not confirmed waits for the unblock
        # without spending an attempt, like a batch that came after the block.
        blocked = self._blocking.refusal()
        return [
            blocked
            if blocked is not None and _unanswered(raw)
            else SharedFailure(
                "the connection to RabbitMQ was lost before the broker confirmed (it may or may not have the message)"
            )
            if lost and _unanswered(raw)
            else classify(raw, envelope, self.settings, fault, timeout)
            for raw, envelope in zip(raws, envelopes, strict=True)
        ]

    async def _send_chain(
        self, lane: _Lane, chain: Sequence[tuple[int, Envelope]], raws: list[BaseException | None]
    ) -> None:
        """Publish ``chain`` in order, each message only after the one before it was confirmed;
        after a failure the rest stay unsent."""
        for i, _ in chain[1:]:
            raws[i] = HELD
        for i, envelope in chain:
            raws[i] = UNCONFIRMED
            raws[i] = raw = await _publish_one(lane, envelope, self.settings.exchange)
            if raw is not None:
                return

    async def _acquire(self) -> _Lane | BrokerUnavailable:
        connection = self._connection
        if connection is None or self._closing or not connection.connected.is_set():
            return self._unreachable("the connection is down")
        while self._idle:
            lane = self._idle.pop()
            if not _closing(lane.underlay):
                return lane
        try:
            channel = aio_pika.Channel(connection, publisher_confirms=True, on_return_raises=True)
            async with asyncio.timeout(CHANNEL_OPEN_TIMEOUT_S) as opening:
                # Another batch's publish can get the connection blocked meanwhile; the
                # broker would not answer the open before the unblock.
                with self._blocking.cut_short(opening):
                    await channel.initialize()
            # aio-pika builds on aiormq's Channel, whose basic_publish takes `wait`.
            underlay = cast(aiormq.Channel, await channel.get_underlay_channel())
        except _CHANNEL_ERRORS as exc:
            return self._blocking.refusal() or self._unreachable(f"cannot open a channel: {describe(exc)}")
        return _Lane(channel, underlay)

    def _release(self, lane: _Lane, reusable: bool) -> None:
        if reusable and not self._closing and not lane.channel.is_closed:
            self._idle.append(lane)
        elif not lane.channel.is_closed:
            # Closing waits for the broker's answer, which a stalled broker may never send.
            task = asyncio.create_task(_close_channel(lane.channel))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _unreachable(self, why: str) -> BrokerUnavailable:
        # The same text for the whole outage, so that it is logged once (adapters.outage).
        log.debug("RabbitMQ at %s is unreachable: %s", self.settings.where, why)
        return BrokerUnavailable(
            f"RabbitMQ at {self.settings.where} is unreachable (reconnecting every"
            f" {RECONNECT_INTERVAL_S:g}s); messages wait, no attempt spent"
        )

    def _note(self, outcomes: Sequence[Outcome]) -> None:
        # A held routing key is its own line (adapters.rabbitmq.unroutable), not an outage.
        refused = next(
            (o for o in outcomes if isinstance(o, BrokerUnavailable) and not isinstance(o, DestinationUnavailable)),
            None,
        )
        if refused is not None:
            self._outage.refused(str(refused))
        elif any(o is None for o in outcomes):
            self._outage.delivered()

    # -- connecting ------------------------------------------------------------------

    async def _connect(self) -> aio_pika.abc.AbstractRobustConnection:
        url = self.settings.url
        extra: dict[str, Any] = {}
        if "reconnect_interval" not in parse_qs(urlsplit(url).query):
            extra["reconnect_interval"] = RECONNECT_INTERVAL_S
        last: BaseException | None = None
        made: list[aio_pika.RobustConnection] = []

        def tracked(*args: Any, **kwargs: Any) -> aio_pika.RobustConnection:
            made.append(aio_pika.RobustConnection(*args, **kwargs))
            return made[-1]

        for attempt in range(CONNECT_ATTEMPTS):
            if attempt:
                await asyncio.sleep(CONNECT_RETRY_DELAYS_S[attempt - 1])
            try:
                connection: aio_pika.abc.AbstractRobustConnection = await aio_pika.connect_robust(
                    url,
                    timeout=CONNECT_TIMEOUT_S,
                    client_properties={"connection_name": self.connection_name},
                    connection_class=cast(Any, tracked),
                    **extra,
                )
                return connection
            except asyncio.CancelledError:
                # A stop during start-up. The robust connection's own task would take the
                # cancel for a failed attempt and dial again, forever: close it.
                for made_connection in made:
                    with contextlib.suppress(*_CHANNEL_ERRORS):
                        await made_connection.close()
                raise
            except ValueError as exc:  # yarl or aiormq refusing the URL itself
                reason = escape(clip(mask(str(exc)), 200))
                where = self.settings.where
                raise ConfigError(f"invalid --amqp-url {where}: refused by the client ({reason})") from None
            except _CONNECT_ERRORS as exc:
                last = exc
                log.debug("connecting to RabbitMQ at %s failed: %s", self.settings.where, describe(exc))
        raise ConfigError(f"cannot connect to RabbitMQ at {self.settings.where}: {mask(self._connect_failure(last))}")

    def _connect_failure(self, exc: BaseException | None) -> str:
        s = self.settings
        if isinstance(exc, amqp_errors.ProbableAuthenticationError) or (
            isinstance(exc, amqp_errors.ConnectionClosed) and exc.args[:1] == (403,)
        ):
            return f"login refused for user '{s.user}' (ACCESS_REFUSED): check the user name and password"
        if (isinstance(exc, amqp_errors.InvalidFrameError) and "Connection.Close" in str(exc)) or (
            isinstance(exc, amqp_errors.ConnectionClosed) and exc.args[:1] == (530,)
        ):
            # The broker answers Connection.Open with Connection.Close (530 NOT_ALLOWED);
            # aiormq reports it as an unexpected frame without the reply text.
            return (
                f"the broker refused to open virtual host '{s.vhost}':"
                f" it does not exist, or user '{s.user}' has no access to it"
            )
        if isinstance(exc, TimeoutError):
            return f"no answer within {CONNECT_TIMEOUT_S:g}s"
        return f"unreachable ({describe(exc) if exc else 'unknown error'})"

    @staticmethod
    def _negotiated_frame_max(connection: aio_pika.abc.AbstractRobustConnection) -> int:
        transport = connection.transport
        if transport is None:
            return MIN_FRAME_MAX
        return int(transport.connection.connection_tune.frame_max or MIN_FRAME_MAX)

    async def _declare_exchange(self) -> None:
        s = self.settings
        channel: aio_pika.abc.AbstractChannel | None = None
        try:
            channel = await self._open_channel()
            await channel.declare_exchange(s.exchange, s.exchange_type, durable=True)
        except _CHANNEL_ERRORS as exc:
            raise ConfigError(
                f"cannot declare exchange '{s.exchange}' (type {s.exchange_type}) at {s.where}: {mask(describe(exc))}"
            ) from None
        finally:
            if channel is not None:
                await _close_channel(channel)

    async def _open_channel(self) -> aio_pika.abc.AbstractChannel:
        assert self._connection is not None
        channel = aio_pika.Channel(self._connection, publisher_confirms=True, on_return_raises=True)
        await asyncio.wait_for(channel.initialize(), CHANNEL_OPEN_TIMEOUT_S)
        return channel

    def _on_connection_lost(self, _sender: object, exc: BaseException | None) -> None:
        self._losses += 1
        now = asyncio.get_running_loop().time()
        for wait in self._confirm_waits:
            wait.reschedule(now)
        if not self._closing:
            log.warning(
                "connection to RabbitMQ at %s lost (%s); reconnecting every %gs",
                self.settings.where,
                describe(exc) if exc else "closed",
                RECONNECT_INTERVAL_S,
            )

    def _on_reconnected(self, _sender: object) -> None:
        log.info("reconnected to RabbitMQ at %s", self.settings.where)


async def _publish_one(lane: _Lane, envelope: Envelope, exchange: str) -> BaseException | None:
    """Publish and wait for the confirm; what went wrong is returned, for the batch's classifier.

    aiormq checks that a channel is open before it writes a publish, but it counts a channel
    as closed only a few steps after the broker's Channel.Close arrived, and by then it has
    already answered Close-Ok. A publish written in between follows the Close-Ok onto a
    channel the broker has forgotten, and the broker closes the whole connection (504
    CHANNEL_ERROR "expected 'channel.open'"), failing every batch in flight. So: nothing is
    written once the Close has arrived (``_closing``), and publishes go out with
    ``wait=False``: not waiting for the socket while holding aiormq's channel lock keeps a
    whole batch's writes in one step, ahead of any Close the broker sends back; aio-pika's
    ``Exchange.publish`` always waits. The probe on a fresh lane (``RabbitPublisher._send``)
    covers the channel closes a message can cause in the normal course: a missing exchange,
    a refused permission.
    """
    if _closing(lane.underlay):
        return NOT_SENT
    try:
        await lane.underlay.basic_publish(
            envelope.body,
            exchange=exchange,
            routing_key=envelope.routing_key,
            properties=envelope.properties,
            mandatory=True,
            wait=False,
        )
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # our own deadline, or the relay's: not a publish outcome
        return exc  # a confirm future cancelled by the channel closing under us
    except Exception as exc:
        return exc
    return None


def _closing(underlay: aiormq.Channel) -> bool:
    """True once the broker's Channel.Close has arrived, not only once aiormq finished
    closing: aiormq records the close reason (a private attribute) the moment it answers."""
    return underlay.is_closed or getattr(underlay, "_close_exception", None) is not None


def _proves_exchange(raw: BaseException | None) -> bool:
    """The broker took the message, or routed and returned it, or a queue refused it: in
    each case the exchange exists and we may write to it."""
    return raw is None or isinstance(raw, amqp_errors.DeliveryError)


def _unanswered(raw: BaseException | None) -> bool:
    """Sent and not confirmed, or not sent because of that."""
    return raw is UNCONFIRMED or raw is HELD or raw is NOT_SENT


def _channel_failed(raw: BaseException | None) -> bool:
    return raw is not None and not isinstance(raw, amqp_errors.DeliveryError) and raw is not HELD


def _chains(envelopes: Sequence[Envelope]) -> list[list[tuple[int, Envelope]]]:
    """Split a batch into chains published side by side: each ordered aggregate's messages
    form one chain (the ordered claim never puts two in a batch, but if it ever did, the
    second must wait for the first's confirm); every other message is a chain of its own."""
    chains: list[list[tuple[int, Envelope]]] = []
    ordered: dict[str, list[tuple[int, Envelope]]] = {}
    for i, envelope in enumerate(envelopes):
        m = envelope.source
        if not m.ordered:
            chains.append([(i, envelope)])
        elif m.aggregate_id in ordered:
            ordered[m.aggregate_id].append((i, envelope))
        else:
            chain = ordered[m.aggregate_id] = [(i, envelope)]
            chains.append(chain)
    return chains


async def _close_channel(channel: aio_pika.abc.AbstractChannel) -> None:
    if channel.is_closed:
        return
    with contextlib.suppress(*_CHANNEL_ERRORS, asyncio.CancelledError):
        await asyncio.wait_for(channel.close(), CHANNEL_CLOSE_TIMEOUT_S)


class QuietReconnects(QuietLines):
    """Drops the client library's lines for each failed reconnect attempt, each lost
    connection (one with a traceback) and each blocked connection: the adapter reports a
    lost connection once, with the broker's reason, a block with its alarm, and an outage
    once."""

    LOGGERS = ("aiormq.connection", "aio_pika.robust_connection")
    PREFIXES = (
        "error when creating transport",
        "Connection attempt to",
        "Reconnect attempt failed",
        "Cancelling cause reader exited abnormally",
        "Unexpected connection close from remote",
        # adapters.rabbitmq.blocked says these with the alarm's kind, and the outage once.
        "Connection %r was blocked",
        "Connection %r was unblocked",
    )
