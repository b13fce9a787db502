"""What the SQS and SNS publishers share: a boto3 client on a thread pool of its own, and
one ``publish`` that checks, packs, sends and reads back batches of at most ten entries.

boto3 is synchronous, so its calls run on a thread pool of the publisher's own, sized so
that every worker's whole batch can be in flight at once; one boto3 client is shared by
those threads (botocore clients are thread-safe).

A subclass says how to build its client, look at its destination once at start, turn a
message into its service's entry, and make one batch call
(``SendMessageBatch``, ``PublishBatch``); everything else is here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from relay.adapters.aws.classify import (
    ACCESS_DENIED,
    CREDENTIALS,
    QUEUE_MISSING,
    TOPIC_MISSING,
    Fault,
    classify_client_error,
    classify_entry,
    classify_transport_error,
)
from relay.adapters.aws.entries import Entry, pack
from relay.adapters.aws.settings import AwsSettings
from relay.adapters.outage import OutageLog
from relay.contract import CHECK_TIMEOUT_S, DestinationCheck, DestinationState, Outcome
from relay.dsn import mask
from relay.errors import BrokerUnavailable, ConfigError, Defer, PermanentError, RetryableError, first_line
from relay.message import OutboxMessage

if TYPE_CHECKING:
    from mypy_boto3_sns.type_defs import BatchResultErrorEntryTypeDef as SnsEntryError
    from mypy_boto3_sqs.type_defs import BatchResultErrorEntryTypeDef as SqsEntryError

    EntryError = SqsEntryError | SnsEntryError

T = TypeVar("T")
C = TypeVar("C")  # the boto3 client
R = TypeVar("R")  # one request entry, in the service's shape

# An ordered message held back because an earlier one of its aggregate in the same batch
# was not delivered: not its failure, so deferred (no attempt spent) rather than retried.
_ORDER_DEFER = timedelta(seconds=1)


@dataclass
class AwsStats:
    """Counters for tests, the benchmark and debugging."""

    requests: int = 0  # batch calls made (an SDK retry inside one is not counted)
    delivered: int = 0  # entries the service accepted
    splits: int = 0  # refused requests resent as two smaller ones


@dataclass(frozen=True)
class BatchAnswer:
    """What a batch call answered: the ``Id`` of every accepted entry, and the refused ones."""

    successful: list[str]
    failed: Sequence[EntryError]


class AwsPublisher(Generic[C, R]):
    """Publishes outbox messages to one SQS queue or SNS topic.

    Each ``publish`` prepares every message (too large or unsendable characters: permanent,
    without a request), packs the rest into requests of at most ten entries within the
    request size, sends those concurrently, and reads every entry's fate from the answer.
    A request refused for its shape, or for the content of one of several entries, is
    split in two and resent, so one bad message never takes others down with it.

    Ordering: the relay's ordered claim puts at most one ordered message per aggregate in a
    batch. Should a batch hold more, the later ones go in later rounds of requests, each
    only once the one before it is confirmed; a later one whose predecessor failed is
    deferred, unsent.
    """

    name: str  # the broker: "sqs"
    service: str  # how messages name the service: "SQS"
    log: logging.Logger

    def __init__(
        self,
        settings: AwsSettings,
        *,
        destination: str,
        session: boto3.session.Session | None = None,
    ) -> None:
        """:param destination: how messages name it ("SQS queue https://...").
        :param session: the boto3 session to build the client from (tests register
            botocore event hooks on it); by default a new one on the usual AWS chain."""
        self.settings = settings
        self.session = session or boto3.session.Session()
        self.destination = destination
        self.region = self._region()
        self.fifo = False
        self.max_message_bytes = settings.max_message_bytes
        self.stats = AwsStats()
        self.health = OutageLog(self.log, destination)
        self._client: C | None = None
        self._executor: ThreadPoolExecutor | None = None

    # -- what a subclass says -----------------------------------------------------------

    def region_hint(self) -> str | None:
        """The region its destination's address names, if any."""
        return None

    no_region_hint = ""  # the end of the "no AWS region" error: where else a region may come from

    def new_client(self, config: Config) -> C:
        raise NotImplementedError

    async def probe(self) -> None:
        """Look at the destination once at start (never fatal but for rejected credentials)."""

    def prepare(self, message: OutboxMessage) -> Entry[R] | PermanentError:
        raise NotImplementedError

    def send_batch(self, client: C, entries: list[R]) -> BatchAnswer:
        """One batch call, on a pool thread; SDK exceptions are classified by the caller."""
        raise NotImplementedError

    def look(self, client: C) -> None:
        """Read the destination's attributes once, on a pool thread (GetQueueAttributes,
        GetTopicAttributes): it raises the service's error when the destination is not there."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------

    def _region(self) -> str:
        region = self.settings.region or self.region_hint() or self.session.region_name
        if not region:
            raise ConfigError(
                f"no AWS region for {self.service}: pass --region, set RELAY_REGION or AWS_REGION{self.no_region_hint}"
            )
        return region

    @property
    def client(self) -> C:
        """The boto3 client (after :meth:`start`)."""
        if self._client is None:
            raise RuntimeError(f"{type(self).__name__}.start() has not been called")
        return self._client

    def client_config(self) -> Config:
        """The botocore configuration: small SDK retries, explicit timeouts, a pool per thread."""
        s = self.settings
        return Config(
            # total_max_attempts counts the first call; botocore's max_attempts counts only
            # retries, so {"max_attempts": 2} would make three calls.
            retries={"total_max_attempts": s.sdk_attempts, "mode": "standard"},
            connect_timeout=s.connect_timeout_s,
            read_timeout=s.read_timeout_s,
            max_pool_connections=s.concurrency,
            # Entries are valid by construction (see adapters.aws.entries.check: fixed types,
            # sizes and characters checked) and AWS validates again; botocore's client-side
            # walk over every entry and attribute is half of the SDK's CPU per call.
            parameter_validation=False,
            tcp_keepalive=True,
            user_agent_extra="outbox-relay",
        )

    async def start(self) -> None:
        """Build the client and look at the destination once.

        Fails (``relay.ConfigError``) only for what no retry can fix: no credentials at all,
        or credentials AWS rejects. A missing destination or an unreachable endpoint is
        logged and left to the publish loop, which treats it as an outage and retries until
        it is fixed.
        """
        self._executor = ThreadPoolExecutor(max_workers=self.settings.concurrency, thread_name_prefix=self.name)
        self._client = await self.run(self._make_client)
        await self.probe()

    async def check_destinations(self) -> list[DestinationCheck]:
        """The queue or topic, by one read of its attributes
        (:class:`relay.contract.ChecksDestinations`)."""
        client = self.client
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                await self.run(lambda: self.look(client))
        except TimeoutError:
            return [self._checked(DestinationState.UNREACHABLE, f"no answer within {CHECK_TIMEOUT_S:g}s")]
        except ClientError as exc:
            fault = classify_client_error(exc)
            if fault.code in QUEUE_MISSING | TOPIC_MISSING:
                return [self._checked(DestinationState.MISSING, fault.text())]
            if fault.code in ACCESS_DENIED | CREDENTIALS:
                return [self._checked(DestinationState.DENIED, fault.text())]
            return [self._checked(DestinationState.UNREACHABLE, fault.text())]
        except BotoCoreError as exc:
            return [self._checked(DestinationState.UNREACHABLE, classify_transport_error(exc).text())]
        return [self._checked(DestinationState.EXISTS)]

    def _checked(self, state: DestinationState, reason: str = "") -> DestinationCheck:
        return DestinationCheck(self.destination, state, " ".join(reason.split()))

    def _make_client(self) -> C:
        if self.session.get_credentials() is None:
            raise ConfigError(
                f"no AWS credentials for {self.service}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or"
                " AWS_PROFILE, or run with an IAM role"
            )
        return self.new_client(self.client_config())

    async def close(self) -> None:
        """Wait for calls still in flight (their outcome is already decided or abandoned),
        then release the connections."""
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, wait=True)
            self._executor = None
        if self._client is not None:
            client: Any = self._client
            client.close()
            self._client = None

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        """One outcome per message, in order; SDK exceptions never escape."""
        if not batch:
            return []
        send = _BatchSend(self, batch)
        outcomes = await send.run()
        if any(o is None for o in outcomes):
            self.health.delivered()
        return outcomes

    async def run(self, call: Callable[[], T]) -> T:
        """``call`` on the publisher's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, call)

    def outcome(self, fault: Fault) -> BaseException:
        """The relay's failure class for ``fault``; outages are also reported to :attr:`health`."""
        if fault.kind == "outage":
            self.health.refused(fault.text(), key=fault.code)
            return BrokerUnavailable(f"{self.destination} unavailable: {fault.text()}")
        if fault.kind == "permanent":
            return PermanentError(f"{self.service} refused the message: {fault.text()}")
        return RetryableError(f"{self.service}: {fault.text()}")


class _BatchSend(Generic[C, R]):
    """The state of one ``publish`` call (several run at once, one per worker)."""

    def __init__(self, publisher: AwsPublisher[C, R], batch: Sequence[OutboxMessage]) -> None:
        self.p = publisher
        self.batch = batch
        self.results: dict[int, Outcome] = {}
        self.entries: dict[int, Entry[R]] = {}
        for i, message in enumerate(batch):
            try:
                prepared = publisher.prepare(message)
            except Exception as exc:  # what this message's own fields make: its outcome alone
                prepared = PermanentError(
                    f"cannot make a {publisher.service} request entry of this message: {type(exc).__name__}:"
                    f" {mask(first_line(exc))}"
                )
            if isinstance(prepared, Entry):
                self.entries[i] = prepared
            else:
                self.results[i] = prepared

    async def run(self) -> list[Outcome]:
        previous: dict[int, int] = {}  # index -> index of the aggregate's previous ordered message
        rounds: list[list[int]] = []
        last_ordered: dict[str, int] = {}
        depth: dict[str, int] = {}
        for i, message in enumerate(self.batch):
            level = 0
            if message.ordered:
                level = depth.get(message.aggregate_id, 0)
                depth[message.aggregate_id] = level + 1
                if message.aggregate_id in last_ordered:
                    previous[i] = last_ordered[message.aggregate_id]
                last_ordered[message.aggregate_id] = i
            while len(rounds) <= level:
                rounds.append([])
            rounds[level].append(i)
        for indices in rounds:
            ready = []
            for i in indices:
                if i in self.results:
                    continue
                before = previous.get(i)
                if before is not None and not (before in self.results and self.results[before] is None):
                    held = self.batch[before]
                    self.results[i] = Defer(
                        _ORDER_DEFER,
                        f"held back: the previous ordered message of aggregate {held.aggregate_id}"
                        f" (outbox id {held.id}) was not delivered",
                    )
                    continue
                ready.append(i)
            if ready:
                await self._send(ready)
        missing = RetryableError("not sent (adapter bug: no outcome recorded)")
        return [self.results.get(i, missing) for i in range(len(self.batch))]

    async def _send(self, indices: list[int]) -> None:
        requests = pack(
            indices,
            {i: self.entries[i].size for i in indices},
            max_entries=self.p.settings.max_entries,
            max_bytes=self.p.settings.max_request_bytes,
        )
        await asyncio.gather(*(self._request(r) for r in requests))

    async def _request(self, indices: list[int]) -> None:
        p = self.p
        client = p.client
        entries = [self.entries[i].request for i in indices]
        p.stats.requests += 1
        try:
            answer = await p.run(lambda: p.send_batch(client, entries))
        except ClientError as exc:
            await self._refused(indices, classify_client_error(exc))
            return
        except BotoCoreError as exc:
            await self._refused(indices, classify_transport_error(exc))
            return
        except Exception as exc:  # the SDK let something else through: still not the messages' fault
            p.log.warning("unexpected error from the AWS SDK; the messages will be retried", exc_info=True)
            await self._refused(indices, Fault("retry", type(exc).__name__, str(exc)))
            return
        by_id: dict[str, list[int]] = {}
        for i in indices:
            by_id.setdefault(self.entries[i].id, []).append(i)
        for ok in answer.successful:
            for i in by_id.pop(ok, []):
                self.results[i] = None
                p.stats.delivered += 1
        for failed in answer.failed:
            outcome = p.outcome(classify_entry(failed))
            for i in by_id.pop(failed["Id"], []):
                self.results[i] = outcome
        for rest in by_id.values():
            for i in rest:
                self.results[i] = RetryableError(f"{p.service}'s answer did not mention this message")

    async def _refused(self, indices: list[int], fault: Fault) -> None:
        """A whole request was refused: split it when the fault may lie in some entries only."""
        if fault.kind == "split" or (fault.content and len(indices) > 1):
            if len(indices) == 1:
                # A request of one entry refused for its shape: the message does not fit
                # into any request (it can only be its size).
                too_big = fault.code == "BatchRequestTooLong"
                self.results[indices[0]] = (
                    PermanentError(f"{self.p.service} refused the message alone: {fault.text()}")
                    if too_big
                    else RetryableError(f"{self.p.service}: {fault.text()}")
                )
                return
            self.p.stats.splits += 1
            self.p.log.log(
                logging.WARNING if fault.kind == "split" else logging.INFO,
                "%s refused a request of %d messages (%s); resending them in two halves",
                self.p.service,
                len(indices),
                fault.code,
            )
            half = len(indices) // 2
            await asyncio.gather(self._request(indices[:half]), self._request(indices[half:]))
            return
        outcome = self.p.outcome(fault)
        for i in indices:
            self.results[i] = outcome
