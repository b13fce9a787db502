"""relay.arrivals: draining workers give way to a worker that woke with work, for a
bounded time."""

from __future__ import annotations

import asyncio
import time

from relay.arrivals import GIVE_WAY_S, Arrivals


async def test_nothing_arriving_costs_no_wait() -> None:
    began = time.monotonic()
    await Arrivals().give_way()
    assert time.monotonic() - began < 0.01


async def test_a_draining_worker_waits_until_the_arrival_has_written_its_batch() -> None:
    arrivals = Arrivals()
    arrivals.arrive("quiet:0")
    arrivals.arrive("quiet:1")
    waiting = asyncio.ensure_future(arrivals.give_way())
    await asyncio.sleep(0.005)
    arrivals.leave("quiet:0")
    await asyncio.sleep(0.005)
    assert not waiting.done()  # quiet:1 still arrives
    arrivals.leave("quiet:1")
    await asyncio.wait_for(waiting, 0.01)
    arrivals.leave("quiet:1")  # leaving twice is harmless
    began = time.monotonic()
    await arrivals.give_way()
    assert time.monotonic() - began < 0.01


async def test_an_arrival_that_hangs_holds_the_others_back_for_a_bounded_time() -> None:
    arrivals = Arrivals()
    arrivals.arrive("stuck:0")  # its database hangs: it never writes
    began = time.monotonic()
    await arrivals.give_way()
    assert GIVE_WAY_S <= time.monotonic() - began < GIVE_WAY_S + 0.05
