"""relay.Replay: a replay from Python, built by the same composition root as `relay replay`
and read back from the broker (a RabbitMQ queue of the test's own)."""

from __future__ import annotations

import pytest

from relay import ConfigError, Replay, Selection
from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.rabbitmq_broker import Rabbit


async def test_a_replay_from_python_sends_the_selected_history_again_in_order(
    relay_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit
) -> None:
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))
    ids = db.insert([("order-1", "OrderPlaced", {"n": 1}), ("order-1", "OrderPaid", {"n": 2}), ("order-2", "E", {})])
    db.conn.execute(f"UPDATE {names.schema}.outbox SET status = 'done', done_at = now()")  # delivered live
    replay = Replay(
        Selection(aggregates=("order-1",)),
        run_id="rebuild-1",
        dsn=relay_dsn,
        schema=names.schema,
        broker="rabbitmq",
        amqp_url=rabbit.amqp.url,
        exchange=exchange,
    )
    assert replay.where.startswith("rabbitmq")
    async with replay:
        assert (replay.summary.count, replay.summary.first_id, replay.summary.last_id) == (2, ids[0], ids[1])
        report = await replay.run()
    assert report.complete and report.published == 2
    got = await rabbit.drain(queue, 2)
    assert [int(m.headers["outbox_id"]) for m in got] == ids[:2]  # type: ignore[arg-type]
    assert {m.headers["replay"] for m in got} == {"rebuild-1"}
    assert db.statuses() == {"done": 3}  # the outbox was not changed


async def test_a_replay_of_nothing_and_bad_settings_are_one_line_errors(relay_dsn: str, names: OutboxNames) -> None:
    with pytest.raises(ConfigError, match="say which messages to replay"):
        Replay(Selection(), dsn=relay_dsn, broker="log")
    with pytest.raises(ConfigError, match=r"unknown replay setting 'worker' \(did you mean 'workers'\?\)"):
        Replay(Selection(from_id=1), dsn=relay_dsn, broker="log", worker=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="no broker chosen"):
        Replay(Selection(from_id=1), dsn=relay_dsn)
    replay = Replay(Selection(from_id=1), dsn=relay_dsn, schema=names.schema, broker="log")
    with pytest.raises(ConfigError, match="no finished message matches the selection"):
        async with replay:
            pass
