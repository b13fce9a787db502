"""Shared settings are explicit: `relay start` reads the ordering map and notify and never
writes them; `relay settings set` and `relay migrate` change them and say old -> new;
`relay status` and `relay settings show` print them."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from relay import runner
from relay.config import CORE_OPTIONS, START_OPTIONS
from relay.db.names import OutboxNames
from relay.db.settings import SettingsUpdate, SharedSettings, read_settings, update_settings
from relay.errors import ConfigError
from relay.options import resolve
from relay.ordering import OrderingMap
from relay.shared_settings import Given, disagreements, given_settings
from relay.testing import InMemoryPublisher
from tests.conftest import Db
from tests.helpers import record_listeners, settings_for
from tests.ops_helpers import relay_json, target
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until, wait_until_async


def stored(db: Db) -> tuple[bool, list[str], list[str], list[str], list[str], bool]:
    """The settings row as stored: ord_default, the four lists, notify."""
    row = db.conn.execute(
        sql.SQL("SELECT ord_default, ord_names, unord_names, ord_patterns, unord_patterns, notify FROM {}").format(
            sql.Identifier(db.names.schema, f"{db.names.table}_settings")
        )
    ).fetchone()
    assert row is not None
    return row  # type: ignore[no-any-return]


DEFAULTS = (True, [], [], [], [], True)


def run_start_until_done(db: Db, relay_dsn: str, *args: str, rows: int, env: dict[str, str] | None = None) -> str:
    """`relay start` (log broker) until ``rows`` rows are done, then SIGTERM; its stderr."""
    with RelayProcess(
        "start", "--schema", db.names.schema, "--broker", "log", "--poll-interval", "100ms", *args,
        env=env or relay_env(RELAY_DSN=relay_dsn),
    ) as proc:  # fmt: skip
        try:
            wait_until(lambda: db.statuses().get("done", 0) >= rows or not proc.running(), timeout=30, interval=0.05)
        finally:
            proc.stop()
        err = proc.stderr()
    assert proc.returncode == 0, err
    assert db.statuses().get("done", 0) == rows, (db.statuses(), err)
    return err


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if " WARNING " in line]


# ---- relay start reads, never writes


def test_start_no_notify_leaves_the_stored_notify_on_and_says_so(relay_dsn: str, db: Db) -> None:
    """The reproduction: a one-off `relay start --no-notify` used to switch wake-ups off for
    every relay and for the producers' trigger, silently, and leave them off after it exited."""
    db.insert([("a", "E", {})])
    err = run_start_until_done(db, relay_dsn, "--no-notify", rows=1)
    assert stored(db) == DEFAULTS  # notify still true: the fleet keeps its wake-ups
    [warning] = warnings_in(err)
    assert "--no-notify: this relay does not LISTEN" in warning
    assert "notify = true" in warning and "unchanged" in warning
    assert "relay settings set --schema " + db.names.schema + " --no-notify" in warning
    assert "wake-ups off (polling every 0.1s)" in err


def test_start_ordering_flags_that_differ_warn_and_change_nothing(relay_dsn: str, db: Db) -> None:
    db.insert([("a", "OrderPlaced", {}), ("a", "EmailSent", {})])
    err = run_start_until_done(
        db, relay_dsn, "--ordering-default", "unordered", "--ordered", "Order*", "--unordered", "Email*", rows=2
    )
    assert stored(db) == DEFAULTS  # the stored map is the one migrate made: everything ordered
    lines = warnings_in(err)
    assert len(lines) == 3, lines
    default, ordered, unordered = lines
    assert "--ordering-default unordered differs from the stored ordering default ordered" in default
    assert "--ordered ['Order*'] differs from the stored ordered list []" in ordered
    assert "--unordered ['Email*'] differs from the stored unordered list []" in unordered
    assert "relay settings set --schema " + db.names.schema + " --ordered 'Order*'" in ordered
    assert "runs by the stored map" in default
    # Rows are routed by the stored map, whatever the relay was told.
    assert "ordering default=ordered ordered=[] unordered=[] (stored)" in err
    assert [r["ordered"] for r in db.rows()] == [True, True]


def test_start_names_where_a_differing_setting_came_from(relay_dsn: str, db: Db, tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text('[ordering]\nunordered = ["Email*"]\n')
    db.insert([("a", "E", {})])
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_ORDERING_DEFAULT="unordered", RELAY_NOTIFY="true")
    err = run_start_until_done(db, relay_dsn, "--config", str(config), rows=1, env=env)
    lines = warnings_in(err)
    assert len(lines) == 2, lines  # RELAY_NOTIFY=true agrees with the stored notify
    assert "RELAY_ORDERING_DEFAULT unordered differs from the stored ordering default ordered" in err
    assert "config [ordering] unordered ['Email*'] differs from the stored unordered list []" in err
    assert stored(db) == DEFAULTS


def test_start_whose_flags_agree_with_the_stored_settings_warns_about_nothing(relay_dsn: str, db: Db) -> None:
    t = target(relay_dsn, db)
    proc = run_relay("settings", "set", *t, "--ordering-default", "unordered", "--ordered", "Order*", "--no-notify")
    assert proc.returncode == 0, proc.stderr
    db.insert([("a", "OrderPlaced", {}), ("a", "EmailSent", {})])
    # The same rules in another order, and the same notify: nothing disagrees.
    err = run_start_until_done(db, relay_dsn, "--ordered", "Order*", "--ordering-default", "unordered", "--no-notify",
                               rows=2)  # fmt: skip
    assert warnings_in(err) == []
    assert "wake-ups off" in err
    assert [r["ordered"] for r in db.rows()] == [True, False]


async def test_a_relay_does_not_listen_while_the_stored_notify_is_off(
    relay_dsn: str, names: OutboxNames, db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        await update_settings(conn, names, SettingsUpdate(notify=False))
        # An idle relay, as its row says (relay.wakeup.Presence): even so the producers'
        # trigger sends nothing now.
        record_listeners(db.conn, names, [("elsewhere:1", True, "1 hour")])
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(f"{names.schema}.{names.table}")))
        db.insert([("a", "E", {})])
        assert [n async for n in conn.notifies(timeout=0.5)] == []
        await update_settings(conn, names, SettingsUpdate(notify=True))
        db.insert([("a", "E", {})])
        assert len([n async for n in conn.notifies(timeout=2, stop_after=1)]) == 1
        await update_settings(conn, names, SettingsUpdate(notify=False))
        record_listeners(db.conn, names, [])
    caplog.set_level(logging.INFO, logger="relay.runner")
    publisher, stop = InMemoryPublisher(), asyncio.Event()
    # Told to notify, but nobody sends wake-ups: it polls, and warns.
    given = (Given("notify", True, "--notify"),)
    settings = settings_for(relay_dsn, names, workers=1, poll_interval=timedelta(milliseconds=100))
    task = asyncio.create_task(runner.run_relay(settings, publisher, stop, given=given))
    try:
        assert await wait_until_async(lambda: len(publisher.delivered) == 2, timeout=10)
    finally:
        stop.set()
        await task
    assert stored_notify(db) is False
    assert "wake-ups off (polling every 0.1s)" in caplog.text
    assert "--notify: the stored setting notify = false" in caplog.text


def stored_notify(db: Db) -> bool:
    return stored(db)[5]


# ---- what counts as given, and the warnings


START = (*CORE_OPTIONS, *START_OPTIONS)


def test_only_explicit_sources_count_as_given() -> None:
    file = {"ordering": {"ordered": ["Order*"]}}
    env = {"RELAY_NOTIFY": "0", "RELAY_UNORDERED": ""}  # an empty variable is not given
    cli = {"ordering_default": "unordered"}
    values = resolve(START, cli, file, env)
    given = given_settings(values, cli, file, env)
    assert given == (
        Given("ordering_default", "unordered", "--ordering-default"),
        Given("ordered", ("Order*",), "config [ordering] ordered"),
        Given("notify", False, "RELAY_NOTIFY"),
    )
    values = resolve(START, {}, {}, {})
    assert given_settings(values, {}, {}, {}) == ()  # defaults are never "given"
    assert given_settings(resolve(START, {"notify": False}, {}, {}), {"notify": False}, {}, {}) == (
        Given("notify", False, "--no-notify"),
    )


def test_disagreements_name_both_values_and_the_command() -> None:
    names = OutboxNames(schema="shop", table="events")
    on_disk = SharedSettings(OrderingMap(default_ordered=False, ordered=("Order*", "Paid")), notify=False)
    lines = disagreements(
        on_disk,
        [
            Given("ordered", ("Paid", "Order*"), "--ordered"),  # the same set: agrees
            Given("unordered", ("Email*",), "RELAY_UNORDERED"),
            Given("notify", True, "--notify"),
        ],
        names,
    )
    assert lines == [
        "RELAY_UNORDERED ['Email*'] differs from the stored unordered list [] of shop.events: rows are routed by"
        " the stored ordering map when they are inserted, so this relay runs by the stored map, not by its own"
        " option; to change the stored one: relay settings set --schema shop --table events --unordered 'Email*'",
        "--notify: the stored setting notify = false of shop.events means producers send no wake-ups, so this"
        " relay polls like the others; to turn wake-ups on for every relay: relay settings set --schema shop"
        " --table events --notify (then restart the relays: each decides at start whether to LISTEN)",
    ]
    emptied = disagreements(on_disk, [Given("ordered", (), "--ordered")], OutboxNames())
    assert emptied[0].endswith("relay settings set --ordered ''")


def test_an_update_changes_only_what_it_names_and_keeps_the_map_valid() -> None:
    before = SharedSettings(OrderingMap(default_ordered=False, ordered=("Order*",), unordered=("Email",)), True)
    after = SettingsUpdate(ordered=("Order*", "Paid")).apply(before)
    assert after.ordering == OrderingMap(default_ordered=False, ordered=("Order*", "Paid"), unordered=("Email",))
    assert after.notify is True
    with pytest.raises(ConfigError, match="'Email' is listed as both ordered and unordered"):
        SettingsUpdate(ordered=("Email",)).apply(before)


# ---- relay settings, relay migrate, relay status


def test_settings_set_changes_only_what_it_is_given_and_prints_old_and_new(relay_dsn: str, db: Db) -> None:
    t = target(relay_dsn, db)
    shown = run_relay("settings", "show", *t)
    assert shown.returncode == 0, shown.stderr
    assert "ordering default  ordered" in shown.stdout and "notify            true" in shown.stdout

    # RELAY_ORDERED in the environment is not a request to change anything.
    proc = run_relay(
        "settings", "set", *t, "--ordering-default", "unordered", "--ordered", "Order*", "--no-notify",
        env=relay_env(RELAY_ORDERED="Nope*", RELAY_NOTIFY="true"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"{db.names.schema}.outbox: shared settings changed" in proc.stdout
    assert "ordering default  ordered -> unordered" in proc.stdout
    assert "ordered           [] -> ['Order*']" in proc.stdout
    assert "notify            true -> false" in proc.stdout
    assert "unordered " not in proc.stdout  # not given, not changed
    assert "changed by" in proc.stderr and "notify" in proc.stderr and relay_dsn not in proc.stderr
    assert stored(db) == (False, [], [], ["^Order.*$"], [], False)

    again = run_relay("settings", "set", *t, "--unordered", "Email*")
    assert again.returncode == 0, again.stderr
    assert "unordered  [] -> ['Email*']" in again.stdout
    assert stored(db) == (False, [], [], ["^Order.*$"], ["^Email.*$"], False)
    db.insert([("a", "OrderPlaced", {}), ("a", "EmailSent", {}), ("a", "Other", {})])
    assert [r["ordered"] for r in db.rows()] == [True, False, False]

    same = run_relay("settings", "set", *t, "--unordered", "Email*")
    assert "shared settings unchanged" in same.stdout
    emptied = relay_json("settings", "set", *t, "--ordered", "", "--notify")
    assert emptied["changed"] == {"ordered": {"old": ["Order*"], "new": []}, "notify": {"old": False, "new": True}}
    assert emptied["settings"]["ordering"] == {"default": "unordered", "ordered": [], "unordered": ["Email*"]}

    as_json = relay_json("settings", "show", *t)
    assert as_json["outbox"] == f"{db.names.schema}.outbox"
    assert as_json["notify"] is True and as_json["ordering"]["unordered"] == ["Email*"]
    assert as_json["updated_at"]


def test_settings_set_refuses_bad_requests_with_one_line(relay_dsn: str, db: Db) -> None:
    t = target(relay_dsn, db)
    assert_one_line_error(run_relay("settings", "set", *t), "say what to change")
    assert_one_line_error(
        run_relay("settings", "set", *t, "--ordered", "X", "--unordered", "X"), "'X' is listed as both"
    )
    assert_one_line_error(run_relay("settings", "set", *t, "--ordering-default", "sideways"), "sideways")
    assert stored(db) == DEFAULTS


def test_migrate_stores_notify_when_asked_and_prints_old_and_new(relay_dsn: str, db: Db) -> None:
    proc = run_relay("migrate", "--dsn", relay_dsn, "--schema", db.names.schema, "--no-notify")
    assert proc.returncode == 0, proc.stderr
    assert "notify  true -> false" in proc.stdout
    assert stored_notify(db) is False
    proc = run_relay("migrate", "--dsn", relay_dsn, "--schema", db.names.schema, "--ordering-default", "unordered")
    assert "ordering default  ordered -> unordered" in proc.stdout
    assert stored(db) == (False, [], [], [], [], False)  # notify left as it was


def test_status_shows_the_stored_settings(relay_dsn: str, db: Db) -> None:
    t = target(relay_dsn, db)
    run_relay("settings", "set", *t, "--ordering-default", "unordered", "--ordered", "Order*", "--no-notify")
    text = run_relay("status", *t)
    assert text.returncode == 0, text.stderr
    assert "shared settings" in text.stdout
    assert "ordering  default unordered, ordered ['Order*'], unordered []" in text.stdout
    assert "notify    false" in text.stdout
    as_json = relay_json("status", *t)
    assert as_json["settings"]["ordering"] == {"default": "unordered", "ordered": ["Order*"], "unordered": []}
    assert as_json["settings"]["notify"] is False


async def test_update_settings_serialises_two_operators(relay_dsn: str, names: OutboxNames) -> None:
    async def change(update: SettingsUpdate) -> None:
        async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
            await update_settings(conn, names, update)

    await asyncio.gather(change(SettingsUpdate(ordered=("A",))), change(SettingsUpdate(unordered=("B",))))
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        now = await read_settings(conn, names)
    assert (now.ordering.ordered, now.ordering.unordered) == (("A",), ("B",))  # neither change lost


def test_commit_order_is_switched_by_the_owner_only_and_shown(relay_dsn: str, pg_dsn: str, db: Db) -> None:
    """The relay's role may change the map but not the table's trigger and index: one line,
    nothing changed. The owner switches it; `settings show` and `settings set` say so."""
    mine = target(relay_dsn, db)
    assert_one_line_error(run_relay("settings", "set", *mine, "--commit-order", "id"), "run it as the table's owner")
    owner = target(pg_dsn, db)
    assert "commit order      stamp" in run_relay("settings", "show", *owner).stdout
    proc = run_relay("settings", "set", *owner, "--commit-order", "id")
    assert proc.returncode == 0, proc.stderr
    assert "commit order  stamp -> id" in proc.stdout
    assert "commit order      id" in run_relay("settings", "show", *mine).stdout
    [(enabled,)] = db.conn.execute(
        "SELECT tgenabled FROM pg_trigger WHERE tgname = %s AND tgrelid = %s::regclass",
        (f"{db.names.table}_stamp", db.names.qualified),
    ).fetchall()
    assert enabled == "D"  # the stamp trigger is off
    assert_one_line_error(run_relay("settings", "set", *owner, "--commit-order", "sideways"), "sideways")
