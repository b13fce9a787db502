"""What operator commands may do to history: a dead ordered head is never pruned away
silently, and an aggregate whose counter prune forgets starts again at 1, visibly.

Every row reaches its state through real relay processes (`relay start --broker log`,
whose JSON lines on stdout are what the "broker" got: the oracle) and real producers,
written both ways: transactions that lock the aggregate before they insert, and
transactions that do not lock and commit in the reverse of their id order (so the dead
head is the row with the higher id, and commit order, not id order, decides the numbers).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from typing import Any, Literal

import psycopg
import pytest
from psycopg import sql

from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until_async

Producers = Literal["locked", "unlocked"]
# A header the relay refuses when it claims the row (one of its own names): that message
# alone goes to dead, with the reason in last_error.
REFUSED_HEADERS = json.dumps({"outbox_id": "forged"})
INSERT = (
    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers)"
    " VALUES ('order', %s, %s, %s, %s) RETURNING id"
)


def produce(db: Db, producer_dsn: str, producers: Producers, aggregate: str, events: list[dict[str, Any]]) -> list[int]:
    """Commit ``events`` of ``aggregate`` one transaction each, in list order (the order
    the producers observed: their oracle), and return their ids in that order.

    ``locked``: each transaction takes the aggregate's advisory lock before its insert.
    ``unlocked``: every transaction inserts first, on connections of its own, and the
    commits then run in list order, so the first event committed has the highest id."""
    table = db.table
    if producers == "locked":
        ids = []
        with psycopg.connect(producer_dsn) as conn:
            for e in events:
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (aggregate,))
                    row = conn.execute(
                        sql.SQL(INSERT).format(table),
                        (aggregate, e["type"], json.dumps(e["payload"]), e.get("headers")),
                    ).fetchone()
                    assert row is not None
                    ids.append(row[0])
        return ids
    conns = [psycopg.connect(producer_dsn) for _ in events]
    try:
        ids_by_position: dict[int, int] = {}
        for position in reversed(range(len(events))):  # the last to commit inserts first
            e = events[position]
            row = (
                conns[position]
                .execute(
                    sql.SQL(INSERT).format(table), (aggregate, e["type"], json.dumps(e["payload"]), e.get("headers"))
                )
                .fetchone()
            )
            assert row is not None
            ids_by_position[position] = row[0]
        for conn in conns:
            conn.commit()
        return [ids_by_position[p] for p in range(len(events))]
    finally:
        for conn in conns:
            conn.close()


def relay(relay_dsn: str, names: OutboxNames, *extra: str) -> RelayProcess:
    return RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "log", "--poll-interval", "50ms", *extra
    )


async def deliver(
    relay_dsn: str, names: OutboxNames, db: Db, done: Any, relays: list[RelayProcess]
) -> list[dict[str, Any]]:
    """Run a relay until ``done(db)``, stop it cleanly, and return what it published."""
    proc = relay(relay_dsn, names)
    relays.append(proc)
    await proc.wait_for_log("relay started")
    assert await wait_until_async(lambda: done(db), timeout=30), (db.statuses(), proc.tail())
    assert proc.stop() == 0, proc.tail()
    return [json.loads(line) for line in proc.stdout().splitlines()]


def prune(relay_dsn: str, names: OutboxNames, *args: str) -> str:
    proc = run_relay("prune", "--dsn", relay_dsn, "--schema", names.schema, "--older-than", "0s", *args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


@pytest.mark.parametrize("producers", ["locked", "unlocked"])
async def test_prune_keeps_a_dead_ordered_head_and_skips_it_only_when_told(
    producers: Producers,
    relay_dsn: str,
    producer_dsn: str,
    names: OutboxNames,
    db: Db,
    relays: list[RelayProcess],
) -> None:
    """The issue's finding 1: aggregate K's first event goes dead (a refused producer
    header) and its second waits behind it. On the old code `prune --older-than 0s
    --include-dead` deleted the dead head, said only "1 dead row", and the next relay
    delivered aggregate_seq 2 to consumers that never saw 1."""
    first, second = produce(
        db,
        producer_dsn,
        producers,
        "K",
        [
            {"type": "OrderPlaced", "payload": {"n": 1}, "headers": REFUSED_HEADERS},
            {"type": "OrderPaid", "payload": {"n": 2}},
        ],
    )
    [other] = db.insert([("U", "OrderPlaced", {"n": 0})])  # an aggregate that flows
    got = await deliver(
        relay_dsn, names, db, lambda d: d.row(first)["status"] == "dead" and d.row(other)["status"] == "done", relays
    )
    assert [m["outbox_id"] for m in got] == [other]
    assert db.row(second)["status"] == "pending" and db.row(second)["aggregate_seq"] == 2
    assert db.row(first)["aggregate_seq"] == 1

    for args in (("--dry-run",), ()):
        out = prune(relay_dsn, names, "--include-dead", *args)
        assert "kept 1 dead ordered message created before it" in out, out
        assert "(1 aggregate: K)" in out, out
        assert "--skip-blocking --reason" in out, out
        assert db.row(first)["status"] == "dead"  # not deleted, not changed

    # The aggregate stays blocked: a relay delivers a newer event of another aggregate, and
    # nothing of K, whose second event was ready long before.
    [marker] = db.insert([("V", "OrderPlaced", {"n": 0})])
    got = await deliver(relay_dsn, names, db, lambda d: d.row(marker)["status"] == "done", relays)
    assert [m["outbox_id"] for m in got] == [marker]
    assert db.row(second)["status"] == "pending"

    out = prune(relay_dsn, names, "--include-dead", "--skip-blocking", "--reason", "refunded by hand", "--dry-run")
    assert "would skip 1 dead ordered message" in out and "would unblock 1 aggregate: K" in out, out
    assert db.row(first)["status"] == "dead"

    out = prune(relay_dsn, names, "--include-dead", "--skip-blocking", "--reason", "refunded by hand", "--by", "ops")
    assert "skipped 1 dead ordered message" in out and "unblocked 1 aggregate: K" in out, out
    row = db.row(first)
    assert (row["status"], row["resolution"], row["resolved_by"], row["resolved_note"]) == (
        "done",
        "skipped",
        "ops",
        "refunded by hand",
    )

    # Now, and only now, the aggregate goes on: its second event, with its own number.
    got = await deliver(relay_dsn, names, db, lambda d: d.row(second)["status"] == "done", relays)
    assert [(m["outbox_id"], m["aggregate_seq"]) for m in got] == [(second, 2)]


def test_prune_refuses_skip_blocking_without_what_it_needs(relay_dsn: str, names: OutboxNames) -> None:
    base = ("prune", "--dsn", relay_dsn, "--schema", names.schema, "--older-than", "1d")
    assert_one_line_error(run_relay(*base, "--skip-blocking", "--reason", "r"), "give --include-dead with it")
    assert_one_line_error(run_relay(*base, "--include-dead", "--skip-blocking"), "needs a reason")
    assert_one_line_error(run_relay(*base, "--reason", "r"), "--reason is recorded by --skip-blocking")
    assert_one_line_error(run_relay(*base, "--heads-idle-for", "5m"), "invalid --heads-idle-for '5m'", "at least 1h")


def heads(db: Db) -> dict[str, tuple[int | None, int]]:
    table = sql.Identifier(db.names.schema, f"{db.names.table}_heads")
    rows = db.conn.execute(sql.SQL("SELECT aggregate_id, head_id, last_seq FROM {}").format(table)).fetchall()
    return {a: (h, n) for a, h, n in rows}


def age_heads(db: Db, *aggregates: str) -> None:
    """As if these aggregates had numbered nothing for ten days."""
    table = sql.Identifier(db.names.schema, f"{db.names.table}_heads")
    db.conn.execute(
        sql.SQL("UPDATE {} SET numbered_at = now() - interval '10 days' WHERE aggregate_id = ANY (%s)").format(table),
        (list(aggregates),),
    )


@pytest.mark.parametrize("producers", ["locked", "unlocked"])
async def test_prune_forgets_only_idle_aggregates_which_then_start_again_at_1(
    producers: Producers,
    relay_dsn: str,
    producer_dsn: str,
    names: OutboxNames,
    db: Db,
    relays: list[RelayProcess],
) -> None:
    """Heads retention: K delivered everything and numbered nothing for ten days (forgotten);
    B is blocked by a dead head (kept); W has a committed event no ingest has numbered yet
    (kept: it is not idle); R numbered recently (kept)."""
    two = [{"type": "OrderPlaced", "payload": {"n": 1}}, {"type": "OrderPaid", "payload": {"n": 2}}]
    k = produce(db, producer_dsn, producers, "K", two)
    b = produce(db, producer_dsn, producers, "B", [{"type": "OrderPlaced", "payload": {}, "headers": REFUSED_HEADERS}])
    w = produce(db, producer_dsn, producers, "W", two[:1])
    r = produce(db, producer_dsn, producers, "R", two[:1])
    await deliver(relay_dsn, names, db, lambda d: d.statuses() == {"done": 4, "dead": 1}, relays)
    w += produce(db, producer_dsn, producers, "W", two[1:])  # committed; no relay runs to number it
    age_heads(db, "K", "B", "W")
    assert set(heads(db)) == {"K", "B", "W", "R"}

    out = prune(relay_dsn, names, "--heads-idle-for", "2d", "--dry-run")
    assert "heads: would forget the aggregate_seq counters of 1 ordered aggregate idle for 2d" in out, out
    assert set(heads(db)) == {"K", "B", "W", "R"}
    out = prune(relay_dsn, names, "--heads-idle-for", "2d")
    assert "heads: forgot the aggregate_seq counters of 1 ordered aggregate idle for 2d" in out, out
    assert set(heads(db)) == {"B", "W", "R"}

    k += produce(db, producer_dsn, producers, "K", two[:1])
    got = await deliver(
        relay_dsn, names, db, lambda d: d.row(k[2])["status"] == "done" and d.row(w[1])["status"] == "done", relays
    )
    seqs = {m["outbox_id"]: m["aggregate_seq"] for m in got}
    assert seqs == {k[2]: 1, w[1]: 2}, got  # K starts again; W keeps its counter
    assert db.row(b[0])["status"] == "dead" and r


def replay(relay_dsn: str, names: OutboxNames, amqp_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = run_relay(
        "replay", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "rabbitmq", "--aggregate", "B", *args,
        env=relay_env(RELAY_AMQP_URL=amqp_url),
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def resume_commands(out: str) -> tuple[list[str], list[str] | None]:
    """The two commands a replay that failed prints: the rest, and the rest without the
    messages that failed (None when it printed only the first)."""
    lines = out.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if " is replayed by" in line)
    rest = shlex.split(lines[first + 1])
    without = None
    if first + 3 < len(lines) + 1 and "leave the messages that failed out" in "".join(lines[first + 2 : first + 3]):
        without = shlex.split(lines[first + 3])
    return rest, without


# The locked producers' variant in make test-all: the unlocked one, the harder order, keeps
# make test within its time.
@pytest.mark.parametrize("producers", [pytest.param("locked", marks=pytest.mark.extended), "unlocked"])
async def test_replay_leaves_skipped_messages_out_and_can_always_finish_an_aggregate(
    producers: Producers,
    relay_dsn: str,
    producer_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    relays: list[RelayProcess],
) -> None:
    """The issue's finding 2: F2 of aggregate B went dead (over --amqp-max-message-size) and an
    operator skipped it; the old replay published it anyway (a message never delivered live,
    that a human decided must not be), and when it failed again, printed a resume command
    starting at F2 that failed the same way for ever."""
    big = "x" * 3000
    f1, f2, f3 = produce(
        db,
        producer_dsn,
        producers,
        "B",
        [
            {"type": "OrderPlaced", "payload": {"n": 1}},
            {"type": "OrderPaid", "payload": {"n": 2, "big": big}},
            {"type": "OrderShipped", "payload": {"n": 3}},
        ],
    )
    env = relay_env(RELAY_AMQP_URL=rabbit.amqp.url)
    live_queue = await rabbit.queue()
    live = RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "rabbitmq", "--routing-key", live_queue,
        "--amqp-max-message-size", "1000", "--poll-interval", "50ms", env=env,
    )  # fmt: skip
    relays.append(live)
    assert await wait_until_async(lambda: db.row(f2)["status"] == "dead", timeout=30), live.tail()
    skipped = run_relay(
        "dead", "skip", str(f2), "--dsn", relay_dsn, "--schema", names.schema, "--reason", "refunded by hand"
    )
    assert skipped.returncode == 0, skipped.stderr
    assert await wait_until_async(lambda: db.row(f3)["status"] == "done", timeout=30), live.tail()
    assert live.stop() == 0, live.tail()
    live_got = await rabbit.drain(live_queue, 2, timeout=10)
    assert [int(m.headers["outbox_id"]) for m in live_got] == [f1, f3]
    before = db.rows()

    # By default the skipped message is left out, and the output says so.
    q1 = await rabbit.queue()
    proc = replay(relay_dsn, names, rabbit.amqp.url, "--to", "", "--routing-key", q1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 of 2 messages published" in proc.stdout, proc.stdout
    assert "left out: 1 message an operator skipped (--include-skipped replays them)" in proc.stdout, proc.stdout
    got = await rabbit.drain(q1, 2, timeout=10)
    assert [(int(m.headers["outbox_id"]), m.headers["aggregate_seq"]) for m in got] == [(f1, 1), (f3, 3)]
    dry = replay(relay_dsn, names, rabbit.amqp.url, "--to", "", "--routing-key", q1, "--dry-run")
    assert dry.returncode == 0 and "left out: 1 message an operator skipped" in dry.stdout, dry.stdout

    # Asked for, it is replayed too, in its place.
    q2 = await rabbit.queue()
    proc = replay(relay_dsn, names, rabbit.amqp.url, "--include-skipped", "--to", "", "--routing-key", q2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = await rabbit.drain(q2, 3, timeout=10)
    assert [(int(m.headers["outbox_id"]), m.headers["aggregate_seq"]) for m in got] == [(f1, 1), (f2, 2), (f3, 3)]

    # It fails again where the broker still refuses it: F3 is held back, and the second
    # printed command finishes the aggregate without F2.
    q3 = await rabbit.queue()
    small = ("--include-skipped", "--to", "", "--routing-key", q3, "--amqp-max-message-size", "1000")
    proc = replay(relay_dsn, names, rabbit.amqp.url, *small)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"not replayed: {f2}" in proc.stdout and "1 message after them in their aggregates was held back" in (
        proc.stdout
    )
    rest, without = resume_commands(proc.stdout)
    assert rest[:4] == ["relay", "replay", "--from-id", str(min(f2, f3))] and "--exclude" not in rest, proc.stdout
    assert without is not None and without[without.index("--exclude") + 1] == str(f2), proc.stdout
    finish = run_relay(*without[1:], env=env)
    assert finish.returncode == 0, finish.stdout + finish.stderr[-3000:]
    assert "left out: 1 message named by --exclude" in finish.stdout, finish.stdout
    got = await rabbit.drain(q3, 3, timeout=5)
    # Where the producers did not lock, F1's id is above F3's, and the resume, which starts
    # from the lowest id not confirmed, sends F1 again: a duplicate consumers drop by id.
    arrived = [int(m.headers["outbox_id"]) for m in got]
    assert list(dict.fromkeys(arrived)) == [f1, f3] and set(arrived) == {f1, f3}, arrived

    # --skip-failed does the same in one run, and says what it left out.
    q4 = await rabbit.queue()
    proc = replay(relay_dsn, names, rabbit.amqp.url, *small[:4], q4, *small[5:], "--skip-failed")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"1 message could not be replayed and were left out (--skip-failed) (first: id {f2}" in proc.stdout, (
        proc.stdout
    )
    got = await rabbit.drain(q4, 3, timeout=5)
    assert [int(m.headers["outbox_id"]) for m in got] == [f1, f3]
    assert db.rows() == before  # a replay changes nothing
