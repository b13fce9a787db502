"""The supervisor of a running relay's duties and workers, and the election that gives a
duty to one relay of an outbox."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import timedelta

import psycopg
import pytest

from relay.backoff import Backoff
from relay.db.names import OutboxNames
from relay.services import Duty, Elected, Every
from relay.supervisor import Supervisor
from tests.relay_process import wait_until_async

FAST = Backoff(base=timedelta(milliseconds=10), cap=timedelta(milliseconds=40))


@dataclass
class Recorder:
    """A duty that records its steps, fails its first ``fail`` runs, and may refuse to start."""

    name: str
    log: list[str]
    fail: int = 0
    refuse_start: bool = False
    runs: int = field(default=0)

    async def start(self) -> None:
        if self.refuse_start:
            raise OSError(f"{self.name}: port taken")
        self.log.append(f"start {self.name}")

    async def run(self, stop: asyncio.Event) -> None:
        self.runs += 1
        if self.runs <= self.fail:
            raise RuntimeError(f"{self.name} broke")
        await stop.wait()

    async def close(self) -> None:
        self.log.append(f"close {self.name}")


async def test_duties_start_before_the_workers_and_close_after_them_in_reverse() -> None:
    steps: list[str] = []
    stop = asyncio.Event()

    async def worker() -> None:
        steps.append("worker runs")
        await stop.wait()
        steps.append("worker ends")

    ready = asyncio.Event()
    run = asyncio.create_task(
        Supervisor([Recorder("a", steps), Recorder("b", steps)]).run(
            [worker()], stop, timedelta(seconds=1), ready=ready
        )
    )
    await asyncio.wait_for(ready.wait(), 5)
    stop.set()
    await asyncio.wait_for(run, 5)
    assert steps == ["start a", "start b", "worker runs", "worker ends", "close b", "close a"]


async def test_a_failing_duty_is_logged_and_started_again_without_touching_the_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    steps: list[str] = []
    flaky = Recorder("flaky", steps, fail=2)
    stop = asyncio.Event()
    worked = asyncio.Event()

    async def worker() -> None:
        await stop.wait()
        worked.set()

    caplog.set_level(logging.ERROR, logger="relay.supervisor")
    run = asyncio.create_task(Supervisor([flaky], restart=FAST).run([worker()], stop, timedelta(seconds=1)))
    assert await wait_until_async(lambda: flaky.runs == 3, 5)
    assert not run.done()  # the workers ran on
    stop.set()
    await asyncio.wait_for(run, 5)
    assert worked.is_set()
    failures = [r for r in caplog.records if "flaky failed (RuntimeError: flaky broke)" in r.getMessage()]
    assert len(failures) == 2 and all(r.exc_info for r in failures)


async def test_a_duty_that_cannot_start_refuses_the_start_and_closes_what_started() -> None:
    steps: list[str] = []
    stop = asyncio.Event()
    ran = False

    async def worker() -> None:
        nonlocal ran
        ran = True

    supervisor = Supervisor([Recorder("first", steps), Recorder("metrics", steps, refuse_start=True)])
    with pytest.raises(OSError, match="port taken"):
        await supervisor.run([worker()], stop, timedelta(seconds=1))
    assert steps == ["start first", "close first"]
    assert not ran  # no worker claimed anything


async def test_a_worker_that_fails_stops_the_duties_and_is_raised() -> None:
    steps: list[str] = []

    async def broken() -> None:
        raise ValueError("a worker's bug")

    with pytest.raises(ValueError, match="a worker's bug"):
        await Supervisor([Recorder("d", steps)]).run([broken()], asyncio.Event(), timedelta(seconds=1))
    assert steps == ["start d", "close d"]


# ---- the election: one relay of an outbox runs an elected duty


def elected(
    names: OutboxNames, dsn: str, counts: dict[str, int], who: str, retry: timedelta = timedelta(milliseconds=100)
) -> Elected:
    async def job() -> None:
        counts[who] = counts.get(who, 0) + 1

    inner = Every(f"prune ({who})", timedelta(milliseconds=50), job)
    return Elected(inner, dsn, names, duty="prune", retry=retry, check=timedelta(milliseconds=100))


async def test_one_relay_of_an_outbox_runs_an_elected_duty_and_another_takes_over_when_it_goes(
    relay_dsn: str, pg_dsn: str, names: OutboxNames
) -> None:
    counts: dict[str, int] = {}
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    # a asks again only after 2 s once it lost the lead; b every 100 ms.
    a = asyncio.create_task(elected(names, relay_dsn, counts, "a", retry=timedelta(seconds=2)).run(stop_a))
    await wait_until_async(lambda: counts.get("a", 0) >= 2, 5)
    b = asyncio.create_task(elected(names, relay_dsn, counts, "b").run(stop_b))
    await asyncio.sleep(1.0)
    assert counts.get("b", 0) == 0, counts  # a leads: b stands by
    # The leader's connection is killed (a network cut, a failover): its lock goes with
    # it, and the other relay leads within its retry.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        killed = conn.execute(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks AS l"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objid = hashtext(%s)::oid",
            (names.qualified,),
        ).fetchall()
    assert killed == [(True,)]
    assert await wait_until_async(lambda: counts.get("b", 0) >= 2, 10), counts
    before = counts["a"]
    await asyncio.sleep(0.5)
    # a noticed it lost the lead and stopped its duty; it now stands by behind b.
    assert counts["a"] <= before + 1
    stop_a.set()
    stop_b.set()
    await asyncio.wait_for(asyncio.gather(a, b), 10)


async def test_different_outboxes_elect_apart(relay_dsn: str, names: OutboxNames, pg_dsn: str) -> None:
    counts: dict[str, int] = {}
    other = OutboxNames(schema=names.schema, table="other_outbox")  # the lock is per outbox
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(elected(names, relay_dsn, counts, "one").run(stop)),
        asyncio.create_task(elected(other, relay_dsn, counts, "two").run(stop)),
    ]
    assert await wait_until_async(lambda: counts.get("one", 0) >= 2 and counts.get("two", 0) >= 2, 5), counts
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


async def test_a_duty_that_ends_when_stopped_closes_its_connection(relay_dsn: str, names: OutboxNames) -> None:
    stop = asyncio.Event()
    duty = Elected(Duty("noop", lambda s: s.wait()), relay_dsn, names, duty="noop")  # type: ignore[arg-type, return-value]
    task = asyncio.create_task(duty.run(stop))
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.wait_for(task, 5)
    with psycopg.connect(relay_dsn, autocommit=True) as conn:
        held = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = hashtext(%s)::oid",
            (names.qualified,),
        ).fetchone()
    assert held == (0,)
