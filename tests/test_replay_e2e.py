"""`relay replay` as a real process, between a real PostgreSQL outbox and real RabbitMQ and
SQS (moto): exactly the selected messages, per aggregate in commit order, each marked
with the run id, while a live relay keeps delivering new rows; every outbox column the
same afterwards; the dry run; Ctrl-C and the printed resume command; bad input.

The order oracles come from outside the relay: the producers' commit logs (producers that
lock their aggregates, then producers that do not), and what the live consumer received."""

from __future__ import annotations

import asyncio
import re
import shlex
import signal
import threading
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict

from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.producers import Arrival, CommitLog, order_violations, producers_both_ways
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until_async
from tests.sqs_server import receive_all

ORDERING = ("--ordered", "Order*", "--unordered", "Email*")
RUN_ID = re.compile(r"^replay (\S+): ", re.MULTILINE)


def restricted(log: CommitLog, selected: set[int]) -> dict[str, list[int]]:
    """A commit log's per-aggregate order, of the selected ids only."""
    return {a: [i for i in ids if i in selected] for a, ids in log.expected().items() if set(ids) & selected}


def per_aggregate_ordered(arrivals: Iterable[tuple[int, str, str]]) -> dict[str, list[int]]:
    """(id, aggregate, event type) in arrival order, as each ordered aggregate's id list."""
    got: dict[str, list[int]] = defaultdict(list)
    for outbox_id, aggregate_id, event_type in arrivals:
        if event_type.startswith("Order"):
            got[aggregate_id].append(outbox_id)
    return dict(got)


def start_producers(
    pg_dsn: str, producer_dsn: str, names: OutboxNames, prefix: str, seeds: tuple[int, int], transactions: int = 25
) -> tuple[CommitLog, CommitLog, threading.Thread]:
    """Producers that lock their aggregates and producers that do not, on aggregates of
    their own (named ``prefix``-L and -U), writing in the background."""
    return producers_both_ways(
        pg_dsn,
        names,
        locked_aggregates=[f"{prefix}-L{i}" for i in range(6)],
        unlocked_aggregates=[f"{prefix}-U{i}" for i in range(4)],
        locked_tx=transactions,
        unlocked_rounds=transactions,
        seeds=seeds,
        locked_options={"unordered_type": "EmailQueued"},
        producer_dsn=producer_dsn,
    )


async def history_through_a_live_relay(
    pg_dsn: str, producer_dsn: str, names: OutboxNames, db: Db, live: RelayProcess, prefix: str, seeds: tuple[int, int]
) -> tuple[CommitLog, CommitLog]:
    """Both kinds of producers write; the live relay delivers it all."""
    locked, unlocked, producing = start_producers(pg_dsn, producer_dsn, names, prefix, seeds)
    await asyncio.to_thread(producing.join)
    await wait_for_done(db, live)
    return locked, unlocked


async def wait_for_done(db: Db, live: RelayProcess, timeout: float = 90) -> None:
    def done() -> bool:
        assert live.running(), live.tail()
        statuses = db.statuses()
        assert "dead" not in statuses, statuses
        return set(statuses) == {"done"}

    assert await wait_until_async(done, timeout, interval=0.2), db.statuses()


def store_ordering(pg_dsn: str, names: OutboxNames) -> None:
    stored = run_relay("settings", "set", "--dsn", pg_dsn, "--schema", names.schema, *ORDERING)
    assert stored.returncode == 0, stored.stderr


# In make test-all: make test keeps the other replays (here, tests/test_replay_api.py,
# tests/test_history_rule.py, the claim-check's) within its time.
@pytest.mark.extended
async def test_replay_of_an_id_range_into_a_fresh_rabbitmq_queue_while_the_live_relay_delivers_new_rows(
    pg_dsn: str,
    producer_dsn: str,
    relay_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    relays: list[RelayProcess],
) -> None:
    store_ordering(pg_dsn, names)
    exchange = await rabbit.exchange("topic")
    live_queue = await rabbit.queue(bind=(exchange, "#"))
    env = relay_env(RELAY_AMQP_URL=rabbit.amqp.url)
    live = RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "rabbitmq", "--exchange", exchange,
        "--workers", "2", "--poll-interval", "100ms", env=env,
    )  # fmt: skip
    relays.append(live)
    await live.wait_for_log("relay started")
    locked, unlocked = await history_through_a_live_relay(pg_dsn, producer_dsn, names, db, live, "h", (1, 2))
    before = db.rows()
    live_got = await rabbit.drain(live_queue, len(before), timeout=30)
    assert len(live_got) == len(before)
    live_by_id = {int(m.headers["outbox_id"]): m for m in live_got}

    ids = [r["id"] for r in before]
    low, high = ids[len(ids) // 4], ids[3 * len(ids) // 4]
    selected = {i for i in ids if low <= i <= high}
    fresh = await rabbit.queue()  # a new consumer's own queue, reached through the default exchange

    # New rows keep coming while the replay runs, and the live relay delivers them.
    more_locked, more_unlocked, producing = start_producers(pg_dsn, producer_dsn, names, "n", (3, 4), transactions=30)
    proc = await asyncio.to_thread(
        run_relay,
        "replay", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "rabbitmq",
        "--from-id", str(low), "--to-id", str(high), "--to", "", "--routing-key", fresh,
        "--workers", "3", "--batch-size", "20",
        env=env,
    )  # fmt: skip
    await asyncio.to_thread(producing.join)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    match = RUN_ID.search(proc.stdout)
    assert match, proc.stdout
    run_id = match.group(1)
    assert f"{len(selected):,} of {len(selected):,} messages published" in proc.stdout

    replayed = await rabbit.drain(fresh, len(selected), timeout=30)
    got = [int(m.headers["outbox_id"]) for m in replayed]
    assert sorted(got) == sorted(selected), "exactly the selected messages, each once"
    for m in replayed:
        original = live_by_id[int(m.headers["outbox_id"])]
        assert m.headers["replay"] == run_id
        assert {k: v for k, v in m.headers.items() if k != "replay"} == original.headers
        assert m.body == original.body and m.type == original.type and m.routing_key == fresh
    arrivals = [Arrival(int(m.headers["outbox_id"]), str(m.headers["aggregate_id"])) for m in replayed]
    assert order_violations(restricted(locked, selected), arrivals) == []
    assert order_violations(restricted(unlocked, selected), arrivals) == []
    # And in the order the live consumer received them.
    as_received = [(int(m.headers["outbox_id"]), str(m.headers["aggregate_id"]), str(m.type)) for m in live_got]
    live_order = {a: [i for i in seq if i in selected] for a, seq in per_aggregate_ordered(as_received).items()}
    replay_order = per_aggregate_ordered(
        (i, str(m.headers["aggregate_id"]), str(m.type)) for i, m in zip(got, replayed, strict=True)
    )
    assert replay_order == {a: seq for a, seq in live_order.items() if seq}

    # The live relay went on: everything written meanwhile is delivered, in commit order.
    await wait_for_done(db, live)
    new = len(db.rows()) - len(before)
    assert new > 0
    live_new = await rabbit.drain(live_queue, new, timeout=30)
    assert len(live_new) == new
    new_arrivals = [Arrival(int(m.headers["outbox_id"]), str(m.headers["aggregate_id"])) for m in live_new]
    assert order_violations(more_locked.expected(), new_arrivals) == []
    assert order_violations(more_unlocked.expected(), new_arrivals) == []
    # The replay changed nothing: every column of every row it could have touched.
    assert db.rows(f"id <= {ids[-1]}") == before
    assert live.stop() == 0, live.tail()


# Long (about 18 s): make test-all runs it; make test keeps the id-range replay beside a live relay.
@pytest.mark.extended
def test_replay_into_a_fresh_sqs_fifo_queue_and_again_into_the_live_one(
    pg_dsn: str, producer_dsn: str, relay_dsn: str, names: OutboxNames, db: Db, make_queue: Any,
    moto_endpoint: str, sqs_client: Any, relays: list[RelayProcess],
) -> None:  # fmt: skip
    store_ordering(pg_dsn, names)
    live_url, fresh_url = make_queue(fifo=True), make_queue(fifo=True)
    aws = ("--broker", "sqs", "--endpoint-url", moto_endpoint, "--region", "us-east-1")
    live = RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", names.schema, *aws, "--queue-url", live_url,
        "--workers", "2", "--poll-interval", "100ms",
    )  # fmt: skip
    relays.append(live)
    locked, unlocked = asyncio.run(history_through_a_live_relay(pg_dsn, producer_dsn, names, db, live, "s", (5, 6)))
    before = db.rows()
    ids = [r["id"] for r in before]
    low, high = ids[len(ids) // 3], ids[2 * len(ids) // 3]
    selected = {i for i in ids if low <= i <= high}
    selection = ("--from-id", str(low), "--to-id", str(high))
    base = ("replay", "--dsn", relay_dsn, "--schema", names.schema, *aws, "--queue-url", live_url, *selection)

    to_fresh = run_relay(*base, "--to", fresh_url)
    assert to_fresh.returncode == 0, to_fresh.stderr[-3000:]
    # Into the queue the live relay delivered them to, its messages still there: inside
    # SQS's de-duplication window, which drops a resend of the same de-duplication id. A
    # replay's carries its run id, so every message arrives again.
    again = run_relay(*base)
    assert again.returncode == 0, again.stderr[-3000:]

    fresh_got = receive_all(sqs_client, fresh_url, idle_s=0.3)
    assert sorted(r.outbox_id for r in fresh_got) == sorted(selected)
    run_id = fresh_got[0].attributes["replay"]
    assert {r.attributes["replay"] for r in fresh_got} == {run_id} and run_id in to_fresh.stdout
    in_live = receive_all(sqs_client, live_url, idle_s=0.3)
    originals = {r.outbox_id: r for r in in_live if "replay" not in r.attributes}
    assert sorted(originals) == ids
    replayed_again = [r for r in in_live if "replay" in r.attributes]
    assert sorted(r.outbox_id for r in replayed_again) == sorted(selected)
    assert run_id not in {r.attributes["replay"] for r in replayed_again}, "each run has its own id"
    for r in fresh_got:
        assert {k: v for k, v in r.attributes.items() if k != "replay"} == originals[r.outbox_id].attributes
        assert r.body == originals[r.outbox_id].body
        assert r.system["MessageGroupId"] == r.attributes["aggregate_id"]
    for got in (fresh_got, replayed_again):
        arrivals = [Arrival(r.outbox_id, r.attributes["aggregate_id"]) for r in got]
        assert order_violations(restricted(locked, selected), arrivals) == []
        assert order_violations(restricted(unlocked, selected), arrivals) == []
    assert db.rows() == before
    assert live.stop() == 0, live.tail()


async def test_a_dry_run_publishes_nothing_and_changes_nothing(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit
) -> None:
    ids = db.insert([(f"a{i % 4}", "OrderPlaced", {"i": i}) for i in range(40)])
    db.conn.execute(f"UPDATE {names.schema}.{names.table} SET status = 'done', done_at = now(), attempts = 1")
    before = db.rows()
    queue = await rabbit.queue()
    proc = run_relay(
        "replay", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "rabbitmq",
        "--from-id", str(ids[10]), "--to-id", str(ids[29]), "--to", "", "--routing-key", queue, "--dry-run",
        env=relay_env(RELAY_AMQP_URL=rabbit.amqp.url),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"would replay 20 messages, ids {ids[10]} to {ids[29]}, 4 aggregates" in proc.stdout
    assert "dry run: nothing was published" in proc.stdout
    assert f"destination: queue '{queue}'" in proc.stdout and " exists" in proc.stdout, proc.stdout
    await asyncio.sleep(0.3)
    assert await rabbit.count(queue) == 0
    assert db.rows() == before


async def test_a_replay_to_a_destination_that_is_not_there_is_refused_before_anything_is_sent(
    relay_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit, make_queue: Any, moto_endpoint: str
) -> None:
    """The issue's finding 10: `relay replay --to <mistyped queue>` waited for ever, and its
    dry run did not look. Both are told now: exit 2, nothing sent, the queue named."""
    ids = db.insert([("a", "OrderPlaced", {"i": 1}), ("b", "OrderPlaced", {"i": 2})])
    db.conn.execute(f"UPDATE {names.schema}.{names.table} SET status = 'done', done_at = now(), attempts = 1")
    typo = f"{rabbit.name}-no-such-queue"
    base = ("replay", "--dsn", relay_dsn, "--schema", names.schema, "--from-id", str(ids[0]))
    amqp = ("--broker", "rabbitmq", "--to", "", "--routing-key", typo)
    env = relay_env(RELAY_AMQP_URL=rabbit.amqp.url)
    dry = run_relay(*base, *amqp, "--dry-run", env=env)
    assert dry.returncode == 2, dry.stdout + dry.stderr
    assert f"destination: queue '{typo}'" in dry.stdout and "missing" in dry.stdout, dry.stdout
    assert "a replay now would wait for the destinations that are not there" in dry.stdout
    for proc, needle in (
        (run_relay(*base, *amqp, env=env), f"queue '{typo}'"),
        (run_relay(*base, *sqs_to_missing(make_queue, moto_endpoint)), "no-such-queue"),
    ):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]  # after the adapter's INFO line that it connected
        assert last.startswith("relay: cannot replay to") and needle in last, proc.stderr
        assert "nothing was published" in last and "replay 2" not in proc.stderr, proc.stderr


def sqs_to_missing(make_queue: Any, moto_endpoint: str) -> tuple[str, ...]:
    missing_url = make_queue().rsplit("/", 1)[0] + "/no-such-queue"
    return ("--broker", "sqs", "--endpoint-url", moto_endpoint, "--region", "us-east-1", "--to", missing_url)


# Long (about 24 s): make test-all runs it; make test keeps the id-range replay beside a live relay.
@pytest.mark.extended
async def test_ctrl_c_mid_replay_prints_a_resume_command_that_finishes_the_rest(
    pg_dsn: str,
    producer_dsn: str,
    relay_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    relays: list[RelayProcess],
) -> None:
    store_ordering(pg_dsn, names)
    env = relay_env(RELAY_AMQP_URL=rabbit.amqp.url)
    exchange = await rabbit.exchange("topic")
    await rabbit.queue(bind=(exchange, "#"))  # the live consumer's, not read here
    live = RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "rabbitmq", "--exchange", exchange,
        "--poll-interval", "100ms", env=env,
    )  # fmt: skip
    relays.append(live)
    locked, unlocked = await history_through_a_live_relay(pg_dsn, producer_dsn, names, db, live, "c", (7, 8))
    assert live.stop() == 0
    selected = {r["id"] for r in db.rows()}
    queue = await rabbit.queue()
    replay = RelayProcess(
        "replay", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "rabbitmq",
        "--since", "1h", "--to", "", "--routing-key", queue, "--rate", "150/s", "--batch-size", "10", env=env,
    )  # fmt: skip
    relays.append(replay)
    for _ in range(300):  # until some are through, at most 30 s
        if await rabbit.count(queue) >= 60 or not replay.running():
            break
        await asyncio.sleep(0.1)
    assert replay.running(), replay.tail()
    replay.proc.send_signal(signal.SIGINT)
    assert replay.wait(30) == 130, replay.tail()
    out = replay.stdout()
    assert "interrupted; the rest (from id " in out, out
    command = out.strip().splitlines()[-1].strip()
    assert command.startswith("relay replay --from-id "), out
    args = shlex.split(command)
    assert "--since" in args and not re.fullmatch(r"\d+[smhd]", args[args.index("--since") + 1]), (
        "a duration counts from now: the resume names the moment"
    )
    run_id = args[args.index("--run-id") + 1]
    first = await rabbit.drain(queue, 1, timeout=5)
    first += await rabbit.drain(queue, len(selected), timeout=1)
    assert 0 < len(first) < len(selected)

    rest = await asyncio.to_thread(run_relay, *args[1:], env=env)
    assert rest.returncode == 0, rest.stderr[-3000:]
    second = await rabbit.drain(queue, len(selected), timeout=10)
    both = [*first, *second]
    assert {m.headers["replay"] for m in both} == {run_id}, "the resume keeps the run id"
    seen: set[int] = set()
    firsts = []
    for m in both:
        outbox_id = int(m.headers["outbox_id"])
        if outbox_id not in seen:
            seen.add(outbox_id)
            firsts.append(Arrival(outbox_id, str(m.headers["aggregate_id"])))
    assert seen == selected, "the two runs together replayed everything"
    assert order_violations(locked.expected(), firsts) == []
    assert order_violations(unlocked.expected(), firsts) == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "say which messages to replay"),
        (("--from-id", "9", "--to-id", "3"), "--from-id 9 is above --to-id 3"),
        (("--from-id", "x1"), "invalid --from-id 'x1'"),
        (("--since", "yesterday"), "invalid --since: 'yesterday'"),
        (("--since", "1h", "--until", "2h"), "--since and --until leave no time between them"),
        (("--from-id", "1", "--rate", "fast"), "invalid --rate 'fast'"),
        (("--from-id", "1", "--rate", "0/s"), "invalid --rate '0/s'"),
        (("--from-id", "1", "--run-id", "a b"), "invalid --run-id 'a b'"),
        (("--aggregate", " "), "invalid --aggregate: must not be empty"),
        (("--from-id", "999999999"), "no finished message matches the selection"),
    ],
)
def test_bad_selectors_and_an_empty_selection_are_one_line_and_exit_2(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db, args: tuple[str, ...], needle: str
) -> None:
    db.insert([("a", "OrderPlaced", {})])
    proc = run_relay("replay", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "log", *args)
    assert_one_line_error(proc, needle)


async def test_a_message_that_cannot_be_replayed_is_named_with_a_resume_command_that_shows_no_password(
    relay_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit
) -> None:
    ids = db.insert([("a", "OrderPlaced", {"big": "x" * 200}), ("a", "OrderPaid", {}), ("b", "OrderPlaced", {})])
    db.conn.execute(f"UPDATE {names.schema}.{names.table} SET status = 'done', attempts = 1")
    before = db.rows()
    queue = await rabbit.queue()
    # Passwords on the command line, in the DSN (trust authentication ignores it) and in
    # the AMQP URL; the first message is larger than the broker is said to take.
    given = conninfo_to_dict(relay_dsn)
    user = str(given["user"])
    dsn = (
        f"postgresql://{user}:dsn-pw-1@{given.get('host') or '127.0.0.1'}:{given.get('port') or 5432}/{given['dbname']}"
    )
    url = rabbit.amqp.url
    proc = run_relay(
        "replay", "--dsn", dsn, "--schema", names.schema, "--broker", "rabbitmq", "--amqp-url", url,
        "--from-id", str(ids[0]), "--to", "", "--routing-key", queue, "--amqp-max-message-size", "100",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    out = proc.stdout
    assert f"1 message could not be replayed (first: id {ids[0]}: PermanentError: message body" in out, out
    assert "; 1 message after them in their aggregates was held back" in out, out
    assert f"not replayed: {ids[0]}" in out
    command = out.strip().splitlines()[-1].strip()
    assert command.startswith(f"relay replay --from-id {ids[0]} "), out
    assert "dsn-pw-1" not in out + proc.stderr and f"{user}:***@" in command
    password = url.split("@")[0].rsplit(":", 1)[1]
    assert f":{password}@" not in out + proc.stderr
    assert "passwords are shown as ***" in out
    replayed = await rabbit.drain(queue, 1, timeout=5)
    assert [int(m.headers["outbox_id"]) for m in replayed] == [ids[2]], "only the other aggregate's message"
    assert db.rows() == before
