"""The NATS JetStream destination's throughput: `relay start --broker nats` into a stream
of the local nats-server against raw nats-py JetStream publishes of the same messages,
each awaiting its acknowledgement, same run, as a ratio; and each sender's CPU per message.

The raw publisher sends what the relay sends: 4 tasks (the relay's 4 workers), each
publishing 100 messages at once (the relay's batch size) with the same headers and
`Nats-Msg-Id`, then awaiting all their acknowledgements before the next 100. The relay's
rate counts from the stream's first message to its N-th, so its start-up is left out; its
CPU is its process's over the same span.

    python scripts/bench_nats.py [--messages 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nats
from nats.js.api import StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_http import (
    DEFAULT_DSN,
    PAYLOAD,
    RELAY,
    SCHEMA,
    SERVER_PIDS,
    Result,
    Span,
    alternate,
    log_run,
    report,
    setup,
    timed,
)
from scripts.procstat import pids_named

URL = os.environ.get("RELAY_BENCH_NATS_URL", "nats://127.0.0.1:4222")


async def _stream(name: str, prefix: str, *, create: bool = False, delete: bool = False) -> int:
    nc = await nats.connect(URL)
    js = nc.jetstream()
    try:
        if create:
            await js.add_stream(StreamConfig(name=name, subjects=[prefix + ".>"], duplicate_window=600))
            return 0
        if delete:
            await js.delete_stream(name)
            return 0
        return int((await js.stream_info(name)).state.messages)
    finally:
        await nc.close()


def relay_run(dsn: str, messages: int) -> Result:
    token = uuid.uuid4().hex[:8]
    name, prefix = f"BENCH_{token}", f"bench.{token}"
    asyncio.run(_stream(name, prefix, create=True))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_DSN=dsn, RELAY_LOG_LEVEL="warning")
    proc = subprocess.Popen(
        [RELAY, "start", "--schema", SCHEMA, "--broker", "nats", "--nats-url", URL, "--subject", f"{prefix}.orders",
         "--workers", "4", "--batch-size", "100", "--poll-interval", "50ms"],
        env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        seen = lambda: asyncio.run(_stream(name, prefix))  # noqa: E731
        return timed(proc.pid, messages, lambda: seen() > 0, lambda: seen() >= messages, 0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        asyncio.run(_stream(name, prefix, delete=True))


async def raw_run(messages: int) -> Result:
    token = uuid.uuid4().hex[:8]
    name, prefix = f"BENCH_RAW_{token}", f"benchraw.{token}"
    await _stream(name, prefix, create=True)
    nc = await nats.connect(URL)
    js = nc.jetstream()
    body = PAYLOAD.encode()
    per_task = messages // 4
    span = Span(os.getpid())

    async def task(t: int) -> None:
        for start in range(0, per_task, 100):
            publishes = []
            for i in range(start, min(start + 100, per_task)):
                n = t * per_task + i
                event_id = str(uuid.uuid4())
                headers = {"outbox_id": str(n), "event_id": event_id, "aggregate_type": "order",
                           "aggregate_id": f"order-{n % 1000}", "event_type": "OrderPaid", "attempt": "1",
                           "lease_version": "1", "Nats-Msg-Id": event_id}  # fmt: skip
                publishes.append(js.publish(f"{prefix}.orders", body, headers=headers, timeout=10))
            await asyncio.gather(*publishes)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(task(t) for t in range(4)))
        elapsed = time.perf_counter() - started
    finally:
        await nc.close()
        await _stream(name, prefix, delete=True)
    return span.result(per_task * 4, elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.messages, args.rounds = 4000, 1
    SERVER_PIDS[:] = pids_named("nats-server")

    def relay() -> Result:
        setup(args.dsn, args.messages)
        return relay_run(args.dsn, args.messages)

    def log() -> Result:
        setup(args.dsn, args.messages)
        return log_run(args.dsn, args.messages)

    raw = lambda: asyncio.run(raw_run(args.messages))  # noqa: E731
    results = alternate(args.rounds, {"relay": relay, "raw": raw, "log": log})
    report(
        f"NATS JetStream: {args.messages:,} messages, median of {args.rounds} rounds",
        {
            "raw": "raw nats-py JetStream publishes",
            "relay": "relay start --broker nats",
            "log": "relay start --broker log",
        },
        results,
    )


if __name__ == "__main__":
    main()
