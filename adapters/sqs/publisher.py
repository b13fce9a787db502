"""The SQS publisher: batches of outbox messages to one queue with ``SendMessageBatch``.

boto3 is synchronous, so its calls run on a thread pool of the publisher's own, sized so
that every worker's whole batch can be in flight at once; one boto3 client is shared by
those threads (botocore clients are thread-safe).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from adapters.outage import OutageLog
from adapters.sqs.classify import (
    ACCESS_DENIED,
    CREDENTIALS,
    Fault,
    classify_client_error,
    classify_entry,
    classify_transport_error,
)
from adapters.sqs.entries import Entry, pack, prepare
from adapters.sqs.settings import SqsSettings
from relay.contract import Outcome
from relay.dsn import describe_url
from relay.errors import BrokerUnavailable, ConfigError, Defer, PermanentError, RetryableError
from relay.message import OutboxMessage

if TYPE_CHECKING:
    from mypy_boto3_sqs.client import SQSClient
    from mypy_boto3_sqs.type_defs import SendMessageBatchResultTypeDef

log = logging.getLogger("adapters.sqs")

T = TypeVar("T")

# An ordered message held back because an earlier one of its aggregate in the same batch
# was not delivered: not its failure, so deferred (no attempt spent) rather than retried.
_ORDER_DEFER = timedelta(seconds=1)


@dataclass
class SqsStats:
    """Counters for tests, the benchmark and debugging."""

    requests: int = 0  # SendMessageBatch calls made (an SDK retry inside one is not counted)
    delivered: int = 0  # entries SQS accepted
    splits: int = 0  # refused requests resent as two smaller ones


class SqsPublisher:
    """Publishes outbox messages to one SQS queue, standard or FIFO.

    Each ``publish`` prepares every message (too large or unsendable characters: permanent,
    without a request), packs the rest into requests of at most ten entries within SQS's
    request size, sends those concurrently, and reads every entry's fate from SQS's answer.
    A request refused for its shape, or for the content of one of several entries, is
    split in two and resent, so one bad message never takes others down with it.

    Ordering: the relay's ordered claim puts at most one ordered message per aggregate in a
    batch. Should a batch hold more, the later ones go in later rounds of requests, each
    only once the one before it is confirmed; a later one whose predecessor failed is
    deferred, unsent.
    """

    name = "sqs"

    def __init__(self, settings: SqsSettings, *, session: boto3.session.Session | None = None) -> None:
        """:param settings: checked settings (see :meth:`SqsSettings.from_values`).
        :param session: the boto3 session to build the client from (tests register
            botocore event hooks on it); by default a new one on the usual AWS chain."""
        self.settings = settings
        self.session = session or boto3.session.Session()
        self.region = self._region()
        self.fifo = settings.fifo
        self.max_message_bytes = settings.max_message_bytes
        self.queue = describe_url(settings.queue_url)
        self.stats = SqsStats()
        self.health = OutageLog(log, f"SQS queue {self.queue}")
        self._client: SQSClient | None = None
        self._executor: ThreadPoolExecutor | None = None

    def _region(self) -> str:
        region = self.settings.region or self.settings.region_from_url() or self.session.region_name
        if not region:
            raise ConfigError(
                "no AWS region for SQS: pass --region, set RELAY_REGION or AWS_REGION, or use a queue"
                " URL of the form https://sqs.<region>.amazonaws.com/..."
            )
        return region

    @property
    def client(self) -> SQSClient:
        """The boto3 SQS client (after :meth:`start`)."""
        if self._client is None:
            raise RuntimeError("SqsPublisher.start() has not been called")
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
            # Entries are valid by construction (see entries.prepare: fixed types, sizes and
            # characters checked) and SQS validates again; botocore's client-side walk over
            # every entry and attribute is half of the SDK's CPU per call.
            parameter_validation=False,
            tcp_keepalive=True,
            user_agent_extra="outbox-relay",
        )

    async def start(self) -> None:
        """Build the client and look at the queue once.

        Fails (``relay.ConfigError``) only for what no retry can fix: no credentials at all,
        or credentials AWS rejects. A missing queue or an unreachable endpoint is logged and
        left to the publish loop, which treats it as an outage and retries until it is fixed.
        """
        self._executor = ThreadPoolExecutor(max_workers=self.settings.concurrency, thread_name_prefix="sqs")
        self._client = await self._run(self._make_client)
        await self._probe()

    def _make_client(self) -> SQSClient:
        if self.session.get_credentials() is None:
            raise ConfigError(
                "no AWS credentials for SQS: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or"
                " AWS_PROFILE, or run with an IAM role"
            )
        return self.session.client(
            "sqs", region_name=self.region, endpoint_url=self.settings.endpoint_url, config=self.client_config()
        )

    async def _probe(self) -> None:
        """Read FifoQueue and MaximumMessageSize when allowed; a failure here is never fatal
        except for rejected credentials."""
        client = self.client
        url = self.settings.queue_url
        try:
            answer = await self._run(
                lambda: client.get_queue_attributes(QueueUrl=url, AttributeNames=["FifoQueue", "MaximumMessageSize"])
            )
        except ClientError as exc:
            fault = classify_client_error(exc)
            if fault.code in CREDENTIALS:
                raise ConfigError(f"AWS refused the credentials for SQS queue {self.queue}: {fault.code}") from None
            if fault.code in ACCESS_DENIED:
                # Send-only roles commonly lack sqs:GetQueueAttributes; sending may still work.
                log.info("cannot read the attributes of SQS queue %s (%s); using defaults", self.queue, fault.code)
            elif fault.kind == "outage":
                self.health.refused(fault.text(), key=fault.code)
            else:
                log.warning("cannot read the attributes of SQS queue %s yet: %s", self.queue, fault.text())
            return
        except BotoCoreError as exc:
            log.warning(
                "cannot reach SQS for queue %s yet (%s); delivery starts once it answers",
                self.queue,
                classify_transport_error(exc).text(),
            )
            return
        attrs = answer.get("Attributes", {})
        if attrs.get("FifoQueue") == "true":
            self.fifo = True
        size = attrs.get("MaximumMessageSize", "")
        if size.isdigit():
            self.max_message_bytes = min(self.max_message_bytes, int(size))
        log.info(
            "SQS queue %s: %s, messages up to %d bytes",
            self.queue,
            "FIFO" if self.fifo else "standard",
            self.max_message_bytes,
        )

    async def close(self) -> None:
        """Wait for calls still in flight (their outcome is already decided or abandoned),
        then release the connections."""
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, wait=True)
            self._executor = None
        if self._client is not None:
            self._client.close()
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

    async def _run(self, call: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, call)

    def outcome(self, fault: Fault) -> BaseException:
        """The relay's failure class for ``fault``; outages are also reported to :attr:`health`."""
        if fault.kind == "outage":
            self.health.refused(fault.text(), key=fault.code)
            return BrokerUnavailable(f"SQS queue {self.queue} unavailable: {fault.text()}")
        if fault.kind == "permanent":
            return PermanentError(f"SQS refused the message: {fault.text()}")
        return RetryableError(f"SQS: {fault.text()}")


class _BatchSend:
    """The state of one ``publish`` call (several run at once, one per worker)."""

    def __init__(self, publisher: SqsPublisher, batch: Sequence[OutboxMessage]) -> None:
        self.p = publisher
        self.batch = batch
        self.results: dict[int, Outcome] = {}
        self.entries: dict[int, Entry] = {}
        for i, message in enumerate(batch):
            prepared = prepare(message, fifo=publisher.fifo, max_bytes=publisher.max_message_bytes)
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
        url = p.settings.queue_url
        entries = [self.entries[i].request for i in indices]
        p.stats.requests += 1
        try:
            answer: SendMessageBatchResultTypeDef = await p._run(
                lambda: client.send_message_batch(QueueUrl=url, Entries=entries)
            )
        except ClientError as exc:
            await self._refused(indices, classify_client_error(exc))
            return
        except BotoCoreError as exc:
            await self._refused(indices, classify_transport_error(exc))
            return
        except Exception as exc:  # the SDK let something else through: still not the messages' fault
            log.warning("unexpected error from the AWS SDK; the messages will be retried", exc_info=True)
            await self._refused(indices, Fault("retry", type(exc).__name__, str(exc)))
            return
        by_id: dict[str, list[int]] = {}
        for i in indices:
            by_id.setdefault(self.entries[i].request["Id"], []).append(i)
        for ok in answer.get("Successful", []):
            for i in by_id.pop(ok["Id"], []):
                self.results[i] = None
                p.stats.delivered += 1
        for failed in answer.get("Failed", []):
            outcome = p.outcome(classify_entry(failed))
            for i in by_id.pop(failed["Id"], []):
                self.results[i] = outcome
        for rest in by_id.values():
            for i in rest:
                self.results[i] = RetryableError("SQS's answer did not mention this message")

    async def _refused(self, indices: list[int], fault: Fault) -> None:
        """A whole request was refused: split it when the fault may lie in some entries only."""
        if fault.kind == "split" or (fault.content and len(indices) > 1):
            if len(indices) == 1:
                # A request of one entry refused for its shape: the message does not fit
                # into any request (it can only be its size).
                too_big = fault.code == "BatchRequestTooLong"
                self.results[indices[0]] = (
                    PermanentError(f"SQS refused the message alone: {fault.text()}")
                    if too_big
                    else RetryableError(f"SQS: {fault.text()}")
                )
                return
            self.p.stats.splits += 1
            log.log(
                logging.WARNING if fault.kind == "split" else logging.INFO,
                "SQS refused a request of %d messages (%s); resending them in two halves",
                len(indices),
                fault.code,
            )
            half = len(indices) // 2
            await asyncio.gather(self._request(indices[:half]), self._request(indices[half:]))
            return
        outcome = self.p.outcome(fault)
        for i in indices:
            self.results[i] = outcome
