"""The byte budget of a claim (relay start --batch-bytes): what one claim leases, what a
relay process holds in memory draining large payloads, and bad values of the option."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from relay.adapters.sqs import SqsSettings
from relay.adapters.sqs.publisher import SqsPublisher
from relay.config import START_OPTIONS, RelaySettings
from relay.contract import Outcome, Publisher
from relay.db.dispatch import DEFAULT_BATCH_BYTES, OutboxStore
from relay.errors import ConfigError
from relay.message import OutboxMessage
from relay.options import resolve
from relay.ordering import OrderingMap
from relay.oversize import OversizeTurn
from relay.sizes import format_size, parse_size
from relay.worker import Shared, Worker, WorkerConfig
from tests.conftest import Db
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import RelayProcess, relay_env, run_relay
from tests.sqs_server import receive_all

LEASE = timedelta(seconds=30)
KB = 1000
MB = 1000 * 1000
# What the issue measured: 20 payloads of 10 MB took a 4-worker relay to 900 MB.
PEAK_RSS_LIMIT = 150 * 1024 * 1024

Store = Callable[..., Awaitable[OutboxStore]]


def blob(size: int, *, compressible: bool = True) -> dict[str, str]:
    """A payload of about ``size`` bytes: one string, repetitive (PostgreSQL compresses it
    to about 1% when it stores it) or random (incompressible)."""
    if compressible:
        return {"blob": "x" * size}
    return {"blob": base64.b64encode(os.urandom(size * 3 // 4)).decode()}


async def claim_messages(
    store: OutboxStore, batch_bytes: int, batch: int = 100, oversize: bool = True
) -> list[OutboxMessage]:
    got = await store.claim(
        owner="w",
        batch=batch,
        batch_bytes=batch_bytes,
        oversize=oversize,
        lease=LEASE,
        max_attempts=3,
    )
    return got.messages


async def claim(store: OutboxStore, batch_bytes: int, batch: int = 100) -> list[int]:
    return [m.id for m in await claim_messages(store, batch_bytes, batch)]


# -- the claim ---------------------------------------------------------------------------


async def test_a_claim_takes_rows_in_order_while_their_payloads_fit_the_budget(make_store: Store, db: Db) -> None:
    store = await make_store(OrderingMap(default_ordered=False))
    ids = db.insert((f"a-{i}", "Viewed", blob(100 * KB)) for i in range(8))
    # Measured before compression: stored, each of these takes about 1 kB.
    [(stored, measured)] = db.conn.execute(
        sql.SQL("SELECT max(pg_column_size(payload)), min(payload_bytes) FROM {}").format(db.table)
    ).fetchall()
    assert stored < 10 * KB and measured >= 100 * KB

    assert await claim(store, batch_bytes=350 * KB) == ids[:3]
    assert await claim(store, batch_bytes=350 * KB) == ids[3:6]
    assert await claim(store, batch_bytes=350 * KB, batch=1) == ids[6:7]
    assert await claim(store, batch_bytes=350 * KB) == ids[7:]


async def test_a_payload_larger_than_the_budget_is_claimed_alone_and_blocks_nothing(make_store: Store, db: Db) -> None:
    store = await make_store(OrderingMap(default_ordered=False))
    small_1, small_2, big, small_3 = db.insert(
        [("a-1", "Viewed", {"n": 1}), ("a-2", "Viewed", {"n": 2}), ("a-3", "Viewed", blob(MB)), ("a-4", "Viewed", {})]
    )
    budget = 64 * 1024
    assert await claim(store, budget) == [small_1, small_2]  # the next one would pass the budget
    [alone] = await claim_messages(store, budget)  # first in line: taken, alone
    assert alone.id == big and json.loads(alone.body) == blob(MB)
    assert await claim(store, budget) == [small_3]


async def test_a_payload_over_the_budget_and_the_claim_checks_threshold_is_spooled_to_a_file_not_memory(
    make_store: Store, pool: AsyncConnectionPool[Any], db: Db
) -> None:
    """With the claim-check on (``spools``: whether it stores a payload of that type and
    size), such a payload is read a slice at a time into a temporary file: the message's body
    is empty, the file holds exactly the text PostgreSQL renders (the oracle: PostgreSQL's
    own sha256 of it). One under the threshold, or of a type the claim-check leaves alone
    (a route's claim_check = false), though over the budget, is read whole as before."""
    await make_store(OrderingMap(default_ordered=False))
    store = OutboxStore(pool, db.names, spools=lambda event_type, size: event_type == "Viewed" and size > 2 * MB)
    over, under, other = db.insert(
        [("s-1", "Viewed", blob(9 * MB)), ("s-2", "Viewed", blob(MB)), ("s-3", "Audited", blob(3 * MB))]
    )
    [spooled] = await claim_messages(store, 64 * 1024)
    assert spooled.id == over and spooled.body == b"" and spooled.spooled is not None
    text = spooled.spooled.file.read()
    [(size, sha)] = db.conn.execute(
        sql.SQL("SELECT octet_length(payload::text), sha256(convert_to(payload::text, 'UTF8')) FROM {} WHERE id = %s")
        .format(db.table), (over,),
    ).fetchall()  # fmt: skip
    assert (len(text), spooled.spooled.size, spooled.spooled.sha256) == (size, size, bytes(sha))
    assert json.loads(text) == blob(9 * MB)
    [whole] = await claim_messages(store, 64 * 1024)
    assert whole.id == under and whole.spooled is None and json.loads(whole.body) == blob(MB)
    [left_alone] = await claim_messages(store, 64 * 1024)
    assert left_alone.id == other and left_alone.spooled is None and json.loads(left_alone.body) == blob(3 * MB)


async def test_a_claim_without_the_oversize_turn_passes_over_large_payloads(make_store: Store, db: Db) -> None:
    store = await make_store(OrderingMap(default_ordered=False, ordered=("Order*",)))
    big, small_1, small_2 = db.insert([("a-1", "Viewed", blob(MB)), ("a-2", "Viewed", {}), ("a-3", "Viewed", {})])
    [big_head] = db.insert([("order-1", "OrderPlaced", blob(MB, compressible=False))])
    [small_head] = db.insert([("order-2", "OrderPlaced", {})])
    budget = 64 * 1024
    passed_over = await claim_messages(store, budget, oversize=False)
    assert sorted(m.id for m in passed_over) == [small_1, small_2, small_head]
    # The large ones wait for a claim that may take one, each alone, the oldest first.
    first = await claim_messages(store, budget)
    second = await claim_messages(store, budget)
    assert [m.id for m in first] == [big] and [m.id for m in second] == [big_head]
    assert len(second[0].body) >= MB


class InFlight:
    """An in-memory broker that takes its time, and records the largest number of messages
    over the budget that were being published at once."""

    def __init__(self, budget: int) -> None:
        self.name = "memory"
        self.budget = budget
        self.now = 0
        self.most = 0
        self.delivered: list[int] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        large = sum(len(m.body) > self.budget for m in batch)
        self.now += large
        self.most = max(self.most, self.now)
        await asyncio.sleep(0.05)
        self.now -= large
        self.delivered += [m.id for m in batch]
        return [None] * len(batch)


async def test_the_workers_of_a_process_hold_one_message_over_the_budget_at_a_time(make_store: Store, db: Db) -> None:
    store = await make_store(OrderingMap(default_ordered=False, ordered=("Order*",)))
    ids = db.insert(
        (f"a-{i}", "OrderPlaced" if i % 2 else "Viewed", blob(200 * KB) if i % 3 == 0 else {}) for i in range(30)
    )
    budget = 64 * 1024
    broker, turn, stop = InFlight(budget), OversizeTurn(), asyncio.Event()
    config = WorkerConfig(batch_size=5, batch_bytes=budget, poll_interval=timedelta(milliseconds=20))
    shared = Shared(oversize=turn)
    workers = [Worker(store=store, publisher=broker, owner=f"w{i}", config=config, shared=shared) for i in range(4)]
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        async with asyncio.timeout(30):
            while len(broker.delivered) < len(ids):
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert sorted(broker.delivered) == ids
    assert broker.most == 1 and turn.holder is None


async def test_the_ordered_claim_keeps_to_the_budget_and_leaves_the_other_heads_ready(
    make_store: Store, db: Db
) -> None:
    store = await make_store()  # everything ordered
    ids = db.insert((f"order-{i}", "OrderPlaced", blob(100 * KB)) for i in range(5))
    first = await claim(store, batch_bytes=250 * KB)
    assert len(first) == 2
    # The heads it did not take are not held: the next claims find them at once.
    second = await claim(store, batch_bytes=250 * KB)
    third = await claim(store, batch_bytes=250 * KB)
    assert len(second) == 2 and len(third) == 1
    assert sorted(first + second + third) == ids


async def test_both_kinds_share_one_budget_oldest_first_and_one_claim_takes_at_least_one_row(
    make_store: Store, db: Db
) -> None:
    store = await make_store(OrderingMap(default_ordered=False, ordered=("Order*",)))
    o1, o2 = db.insert([("order-1", "OrderPlaced", blob(100 * KB)), ("order-2", "OrderPlaced", blob(100 * KB))])
    u1, u2 = db.insert([("u-1", "Viewed", blob(100 * KB)), ("u-2", "Viewed", blob(100 * KB))])
    # The oldest two (ordered) take 200 kB of 250 kB; the next unordered one does not fit.
    assert sorted(await claim(store, 250 * KB)) == [o1, o2]
    # A claim takes the first ready row over the budget alone.
    assert await claim(store, 64 * 1024) == [u1]
    assert await claim(store, 64 * 1024) == [u2]


async def test_small_rows_still_fill_batches_of_100_under_the_default_budget(make_store: Store, db: Db) -> None:
    store = await make_store(OrderingMap(default_ordered=False, ordered=("Order*",)))
    db.insert((f"u-{i}", "Viewed", {"i": i, "pad": "p" * 500}) for i in range(150))
    db.insert((f"order-{i}", "OrderPlaced", {"i": i, "pad": "p" * 500}) for i in range(150))
    assert len(await claim(store, DEFAULT_BATCH_BYTES)) == 100
    assert len(await claim(store, DEFAULT_BATCH_BYTES)) == 100


async def test_rows_without_a_measured_size_are_counted_by_their_stored_size_and_an_edited_payload_is_remeasured(
    make_store: Store, db: Db
) -> None:
    store = await make_store(OrderingMap(default_ordered=False))
    # As if written before migration 0006 (or with triggers off): no size recorded.
    ids = db.insert((f"a-{i}", "Viewed", blob(100 * KB, compressible=False)) for i in range(3))
    db.conn.execute(sql.SQL("UPDATE {} SET payload_bytes = NULL").format(db.table))
    assert await claim(store, batch_bytes=250 * KB) == ids[:2]
    # An operator replaces a payload by hand: its new size counts.
    db.conn.execute(
        sql.SQL("UPDATE {} SET payload = %s WHERE id = %s").format(db.table), (json.dumps(blob(MB)), ids[2])
    )
    assert db.row(ids[2])["payload_bytes"] >= MB


# -- a message the broker refuses as too large goes dead alone -----------------------------


class Recording:
    """A publisher that remembers the batches it was handed."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.name = inner.name
        self.batches: list[list[int]] = []

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        self.batches.append([m.id for m in batch])
        return await self.inner.publish(batch)


async def drain_with(store: OutboxStore, publisher: Publisher, batch_bytes: int) -> None:
    worker = Worker(
        store=store, publisher=publisher, owner="w", config=WorkerConfig(batch_size=100, batch_bytes=batch_bytes)
    )
    while await worker.run_once():
        pass


def assert_dead_alone(db: Db, recording: Recording, big: int, others: list[int], reason: str) -> None:
    assert [big] in recording.batches, recording.batches
    row = db.row(big)
    assert row["status"] == "dead" and row["attempts"] == 1 and reason in row["last_error"], row
    for oid in others:
        assert (db.row(oid)["status"], db.row(oid)["attempts"]) == ("done", 1)


async def test_a_message_over_rabbitmqs_size_limit_is_claimed_alone_and_goes_dead_alone(
    make_store: Store, db: Db, rabbit: Rabbit
) -> None:
    store = await make_store(OrderingMap(default_ordered=False))
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))
    before = db.insert((f"a-{i}", "Viewed", {"i": i}) for i in range(5))
    [big] = db.insert([("a-big", "Viewed", blob(3 * MB))])
    after = db.insert((f"b-{i}", "Viewed", {"i": i}) for i in range(5))
    publisher = await rabbit.publisher(exchange=exchange, max_message_size=2 * MB)
    recording = Recording(publisher)
    await drain_with(store, recording, batch_bytes=MB)
    assert_dead_alone(db, recording, big, before + after, "exceeds the broker's max message size")
    assert len(await rabbit.drain(queue, expected=10)) == 10


async def test_a_message_over_the_sqs_size_limit_is_claimed_alone_and_goes_dead_alone(
    make_store: Store,
    db: Db,
    make_queue: Any,
    moto_endpoint: str,
    sqs_client: Any,
) -> None:
    store = await make_store(OrderingMap(default_ordered=False))
    url = make_queue(fifo=False)
    before = db.insert((f"a-{i}", "Viewed", {"i": i}) for i in range(5))
    [big] = db.insert([("a-big", "Viewed", blob(300 * KB, compressible=False))])
    after = db.insert((f"b-{i}", "Viewed", {"i": i}) for i in range(5))
    publisher = SqsPublisher(
        SqsSettings(queue_url=url, region="us-east-1", endpoint_url=moto_endpoint, max_message_bytes=256 * 1024)
    )
    await publisher.start()
    try:
        recording = Recording(publisher)
        await drain_with(store, recording, batch_bytes=200 * KB)
    finally:
        await publisher.close()
    assert_dead_alone(db, recording, big, before + after, "the SQS queue takes at most 262144")
    assert len(await asyncio.to_thread(receive_all, sqs_client, url)) == 10


# -- memory of a whole relay process -------------------------------------------------------


def peak_rss(pid: int) -> int:
    """The process's peak resident set so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def insert_large_backlog(db: Db) -> list[int]:
    """20 payloads of 10 MB (half of them compressible) on their own aggregates, half
    ordered and half not, among 200 small events."""
    settings = sql.Identifier(db.names.schema, "outbox_settings")
    db.conn.execute(sql.SQL("UPDATE {} SET unord_names = ARRAY['Bulk']").format(settings))
    ids = db.insert((f"order-{i % 20}", "OrderPlaced" if i % 2 else "Bulk", {"i": i}) for i in range(100))
    for i in range(20):
        ids += db.insert([(f"big-{i}", "OrderPlaced" if i % 2 else "Bulk", blob(10 * MB, compressible=i % 4 < 2))])
    ids += db.insert((f"order-{i % 20}", "OrderPlaced" if i % 2 else "Bulk", {"i": i}) for i in range(100))
    return ids


def start_relay(db: Db, relay_dsn: str, *args: str) -> RelayProcess:
    command = ["start", "--dsn", relay_dsn, "--schema", db.names.schema, "--unordered", "Bulk", "--workers", "4"]
    return RelayProcess(*command, *args, discard_stdout=True)  # the log broker's 200 MB of messages


async def drain_and_measure(db: Db, process: RelayProcess, total: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    try:
        while (await asyncio.to_thread(db.statuses)).get("done", 0) < total:
            assert process.running(), "relay exited early"
            assert time.monotonic() < deadline, f"not drained within {timeout}s: {db.statuses()}"
            await asyncio.sleep(0.2)
        peak = peak_rss(process.pid)
    finally:
        code = await asyncio.to_thread(process.stop)
    assert code == 0
    assert db.statuses() == {"done": total}
    return peak


async def test_a_4_worker_relay_drains_twenty_10_mb_payloads_to_rabbitmq_in_under_150_mb(
    relay_dsn: str, db: Db, rabbit: Rabbit, tmp_path: Path
) -> None:
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))
    ids = await asyncio.to_thread(insert_large_backlog, db)
    received: dict[int, int] = {}

    async def consume() -> None:
        channel = await rabbit.connection.channel()
        await channel.set_qos(prefetch_count=4)
        async with (await channel.get_queue(queue, ensure=False)).iterator() as messages:
            async for message in messages:
                received[int(message.headers["outbox_id"])] = len(message.body)
                await message.ack()

    consumer = asyncio.create_task(consume())
    with start_relay(
        db, relay_dsn, "--broker", "rabbitmq", "--amqp-url", rabbit.amqp.url, "--exchange", exchange
    ) as process:
        peak = await drain_and_measure(db, process, len(ids), timeout=120)
        deadline = time.monotonic() + 30
        while len(received) < len(ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        print(f"\nrabbitmq: peak RSS {peak / 2**20:.0f} MiB")
        assert sorted(received) == sorted(ids), process.stderr()
    assert sum(size >= 10 * MB for size in received.values()) == 20
    assert peak < PEAK_RSS_LIMIT, f"peak RSS {peak / 2**20:.0f} MiB"


# The same bound as the RabbitMQ run above, without a broker's buffers: make test-all runs
# it, make test keeps the RabbitMQ one.
@pytest.mark.extended
async def test_a_4_worker_relay_drains_twenty_10_mb_payloads_to_the_log_broker_in_under_150_mb(
    relay_dsn: str, db: Db, tmp_path: Path
) -> None:
    ids = await asyncio.to_thread(insert_large_backlog, db)
    with start_relay(db, relay_dsn, "--broker", "log") as process:
        peak = await drain_and_measure(db, process, len(ids), timeout=120)
    print(f"\nlog: peak RSS {peak / 2**20:.0f} MiB")
    assert peak < PEAK_RSS_LIMIT, f"peak RSS {peak / 2**20:.0f} MiB"


# -- the option ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8MiB", 8 * 1024 * 1024),
        ("512KiB", 512 * 1024),
        ("10MB", 10 * MB),
        ("1.5 MiB", 1536 * 1024),
        ("256kb", 256 * KB),
        ("65536", 65536),
        (" 1GiB ", 1024**3),
        (1048576, 1048576),
        (2e6, 2 * MB),
    ],
)
def test_sizes_are_read_in_iec_and_si_units_or_as_bytes(text: object, size: int) -> None:
    assert parse_size(text) == size
    assert parse_size(format_size(size)) == size


@pytest.mark.parametrize(
    "value",
    [
        "",
        "8XB",
        "MB",
        "-1",
        "+1MiB",
        "inf",
        "nan",
        "1e300",
        "0x10",
        "1_000",
        "1.5",
        "١٢٣",
        "8 M iB",
        "9" * 400,
        float("inf"),
        float("nan"),
        True,
        [1],
        None,
    ],
)
def test_a_malformed_size_is_refused_with_one_line(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^invalid --batch-bytes: ") as refused:
        parse_size(value, name="--batch-bytes")
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 200


def test_the_default_and_the_bounds_of_batch_bytes() -> None:
    values = resolve(START_OPTIONS, {}, {}, {})
    values.update(dsn="postgresql://localhost/x", broker="log")
    assert RelaySettings.from_values(values).worker.batch_bytes == DEFAULT_BATCH_BYTES
    values = resolve(START_OPTIONS, {"batch_bytes": "512KiB"}, {"batch_bytes": "2MiB"}, {})
    assert values["batch_bytes"] == 512 * 1024
    assert resolve(START_OPTIONS, {}, {"batch_bytes": 2097152}, {})["batch_bytes"] == 2 * 1024 * 1024


@pytest.mark.parametrize(
    ("args", "env", "toml", "needles"),
    [
        (["--batch-bytes", "8XB"], {}, None, ["invalid --batch-bytes: '8XB'", "512KiB"]),
        (["--batch-bytes", "8"], {}, None, ["invalid --batch-bytes: '8'", "at least 64KiB"]),
        (["--batch-bytes", "2GiB"], {}, None, ["at most 1GiB"]),
        (["--batch-bytes", "inf"], {}, None, ["invalid --batch-bytes: 'inf'"]),
        ([], {"RELAY_BATCH_BYTES": "nan"}, None, ["invalid --batch-bytes (from RELAY_BATCH_BYTES): 'nan'"]),
        ([], {}, "batch_bytes = true", ["invalid --batch-bytes (from config batch_bytes)"]),
        ([], {}, "batch_bytes = 1e400", ["invalid --batch-bytes (from config batch_bytes): inf"]),
    ],
)
def test_relay_start_refuses_a_bad_batch_bytes_with_one_line_and_exit_2(
    relay_dsn: str,
    tmp_path: Path,
    args: list[str],
    env: dict[str, str],
    toml: str | None,
    needles: list[str],
) -> None:
    extra = []
    if toml is not None:
        config = tmp_path / "relay.toml"
        config.write_text(toml + "\n")
        extra = ["--config", str(config)]
    proc = run_relay("start", "--dsn", relay_dsn, "--broker", "log", *extra, *args, env=relay_env(**env))
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("relay: "), err
    for needle in needles:
        assert needle in err, err
