"""The part of consuming that is the same for every destination: one event, its own
pooled connection and transaction, the inbox's verdict and the handler's effect together.

Why a connection per message: a broker client runs deliveries concurrently (aio-pika runs
each as a task, up to the channel's prefetch), and deliveries that share a connection
share its transaction: a receipt then commits with another message's effect, or rolls
back with it after its message was acknowledged (issue 38: an example that shared one
stalled, and a variant of it acknowledged 302 events and applied 2). The pool bounds how
many transactions run at once; a message that finds no free connection waits for one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from relay.claimcheck import PayloadFetcher
from relay.consumers.verdict import Verdict
from relay.consumers.webhook import WEBHOOK_TOLERANCE
from relay.durations import parse_duration
from relay.inbox import Inbox, OutOfOrder, Received

if TYPE_CHECKING:
    import psycopg
    from aio_pika.abc import AbstractQueue
    from aiohttp import web
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger("relay.consumers")

# The effect of one new event, run in the transaction that records it; it must not commit
# or roll back itself. What it raises rolls the receipt back with the effect.
Handler = Callable[["psycopg.AsyncConnection[Any]", Received], Awaitable[None]]

# How long an event that came before an earlier one of its aggregate (or whose handler
# failed) is held before it is offered again: the missing event is usually in flight
# beside it, a transaction away, and half a second keeps a consumer of a busy aggregate
# from spinning on the broker while it waits.
RETRY_DELAY = timedelta(seconds=0.5)


class Consumer:
    """Applies each delivered event's effect exactly once, in its aggregate's order.

    Every message gets a connection of its own from ``pool`` and a transaction of its own,
    in which ``inbox`` records it and, if it is new, ``handler`` applies it; the runners
    acknowledge the message only after that transaction has committed, and a duplicate at
    once. So messages may be handled concurrently (a prefetch of 50 is fine): the inbox
    takes each aggregate's lock, so an aggregate's events apply one after another, in
    order, whatever order the broker hands them over in.

    :param pool: a ``psycopg_pool.AsyncConnectionPool`` of the consumer's own database
        (opened by the caller). Its size bounds the transactions in flight; more messages
        than that wait for a connection.
    :param inbox: the :class:`relay.Inbox` (migrated: ``Inbox.migrate`` at start).
    :param handler: ``async def handler(conn, event)``: the effect of a new event, on
        ``conn`` (an ``AsyncConnection``) inside the transaction; it must not commit. An
        exception rolls the receipt back with the effect; the message is offered again
        after ``retry_delay`` (bound retries with the broker's own limit: a quorum queue's
        delivery-limit, SQS's maxReceiveCount, JetStream's max_deliver).
    :param retry_delay: how long an event that came too early (or whose handler failed) is
        held before it is offered again (a ``timedelta``, seconds, or ``"500ms"``).
    :param claim_check: a :class:`relay.claimcheck.PayloadFetcher`: a claim-checked event's
        payload (relay start --claim-check-bucket) is fetched before its transaction,
        checked against its digest, and handed to the handler as ``event.payload()`` and
        ``event.open_payload()`` (a file, read in bounded memory); removed afterwards. A
        payload that cannot be fetched or does not match is offered again later.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        inbox: Inbox,
        handler: Handler,
        *,
        retry_delay: timedelta | float | str = RETRY_DELAY,
        claim_check: PayloadFetcher | None = None,
    ) -> None:
        self.pool = pool
        self.claim_check = claim_check
        self.inbox = inbox
        self.handler = handler
        # At most SQS's longest visibility timeout (12 h), which run_sqs holds a message with.
        self.retry_delay = parse_duration(retry_delay, name="retry_delay", maximum=timedelta(hours=12))

    async def apply(self, event: Received) -> Verdict:
        """Record ``event`` and, if it is new, apply it, in one transaction on a connection of
        its own; what the runners call per message, and what a receiver of another kind
        calls (acknowledge on APPLIED and DUPLICATE, after this returns). What the handler
        or the database raises propagates, nothing recorded."""
        if self.claim_check is not None and event.claim_checked and event.payload_path is None:
            # Fetched before the transaction: a large download holds no connection or lock.
            path = await self.claim_check.fetch(event.headers["dataref"], event.headers.get("datadigest", ""))
            try:
                return await self.apply(dataclasses.replace(event, payload_path=path))
            finally:
                path.unlink(missing_ok=True)
        async with self.pool.connection() as conn:
            try:
                async with conn.transaction():
                    if not await self.inbox.receive_async(conn, event):
                        log.debug("event %s: a duplicate", event.event_id)
                        return Verdict.DUPLICATE
                    await self.handler(conn, event)
            except OutOfOrder as exc:
                log.debug("%s", exc)
                return Verdict.OUT_OF_ORDER
        return Verdict.APPLIED

    async def run_rabbitmq(self, queue: AbstractQueue) -> None:
        """Consume an aio-pika queue (declared and bound by the caller, on a channel whose
        ``set_qos(prefetch_count=...)`` bounds the messages in flight) until cancelled.
        Applied and duplicate messages are acknowledged after the commit; one too early,
        or whose handler failed, is rejected with requeue after ``retry_delay``; one the
        relay did not send (no event id) is rejected without requeue, to the queue's
        dead-letter exchange if it has one. Cancelled, it stops consuming and lets what is
        in flight finish."""
        from relay.consumers.rabbitmq import consume

        await consume(self, queue)

    async def run_sqs(
        self, client: Any, queue_url: str, *, sns: bool = False, batch: int = 10, wait_seconds: int = 5
    ) -> None:
        """Consume an SQS queue with a boto3 client until cancelled: ``receive_message``
        (``batch`` at most 10, long polls of ``wait_seconds``; boto3's calls run in threads),
        the batch's messages handled concurrently, each deleted after its commit. One too
        early, or whose handler failed, is made visible again after ``retry_delay`` (whole
        seconds); one the relay did not send is left to the queue's redrive policy.
        ``sns=True`` for a queue subscribed to an SNS topic (raw delivery or not). Run
        several for more than ``batch`` messages at once. Cancelled, it stops at once, but
        the long poll in flight goes on in its thread for up to ``wait_seconds`` (boto3
        cannot be interrupted; 5 s rather than SQS's longest, 20, keeps a shutdown short,
        for about one empty receive per 5 s while idle)."""
        from relay.consumers.sqs import consume

        await consume(self, client, queue_url, sns=sns, batch=batch, wait_seconds=wait_seconds)

    async def run_kafka(self, kafka: Any) -> None:
        """Consume with an aiokafka ``AIOKafkaConsumer`` (started, subscribed or assigned,
        ``enable_auto_commit=False``) until cancelled. The relay keys records by aggregate,
        so each partition's records are handled in offset order per key, keys and
        partitions concurrently; a partition's offset is committed once everything fetched
        from it has committed (with a ``group_id``). Kafka cannot hold one record back: one
        too early, or whose handler failed, is retried in place after ``retry_delay``,
        holding its key (and its partition's commit) until it applies. One the relay did not
        send is logged and skipped."""
        from relay.consumers.kafka import consume

        await consume(self, kafka)

    async def run_nats(self, subscription: Any, *, batch: int = 50, wait_seconds: float = 5.0) -> None:
        """Consume a nats-py JetStream pull subscription (``js.pull_subscribe(...)``) until
        cancelled: ``fetch`` up to ``batch``, handled concurrently, each acknowledged after
        its commit; one too early, or whose handler failed, ``nak``-ed with ``retry_delay``;
        one the relay did not send terminated (``term``). The consumer's ``ack_wait`` must
        exceed a handler's time."""
        from relay.consumers.nats import consume

        await consume(self, subscription, batch=batch, wait_seconds=wait_seconds)

    def webhook_handler(
        self, *, secrets: str | None, tolerance: timedelta = WEBHOOK_TOLERANCE
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """An aiohttp request handler for the relay's HTTP destination
        (``app.router.add_post("/events", consumer.webhook_handler(secrets=...))``).
        ``secrets``: the relay's ``--webhook-secret-file`` contents (``whsec_...``,
        whitespace-separated; None to accept unsigned requests). A signature that does not
        verify is answered 401 (the relay holds the destination); a request the relay did
        not send, 400; applied or duplicate, 200 after the commit; one too early, 409 with
        ``Retry-After`` (the relay defers it, no attempt spent); a handler that failed, 500
        (the relay retries)."""
        from relay.consumers.webhook import aiohttp_handler

        return aiohttp_handler(self, secrets=secrets, tolerance=tolerance)
