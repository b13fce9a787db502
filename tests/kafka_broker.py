"""A Kafka-protocol broker for the tests: noida-db (a broker in Rust from the package index,
MIT; no Apache Kafka distribution can be fetched here), started once per test process on a
free port with its own data directory, and the helpers the tests use on it: topics of
their own (created and deleted), and reading a topic back from the beginning.

``kafka`` is a session fixture registered for every module by ``pytest_plugins`` in
tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tests.pg_clusters import free_port
from tests.relay_process import wait_until


def noida_binary() -> str:
    """The broker binary itself. The ``noida-db`` console script is a Python wrapper that
    runs it as a child and does not pass on a SIGTERM: stopping the wrapper left the broker
    running (one per test process, found still up after the runs)."""
    import noida_db

    path = Path(noida_db.__file__).with_name("noida-db")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return str(path)


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: dict[str, str]


@dataclass
class KafkaService:
    bootstrap: str
    process: subprocess.Popen[bytes]
    data_dir: Path

    def create_topic(self, partitions: int = 3, name: str | None = None) -> str:
        topic = name or f"relay-test-{uuid.uuid4().hex[:10]}"

        async def create() -> None:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            await admin.start()
            try:
                await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
            finally:
                await admin.close()

        asyncio.run(create())
        return topic

    def topics(self) -> list[str]:
        async def listed() -> list[str]:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            await admin.start()
            try:
                return list(await admin.list_topics())
            finally:
                await admin.close()

        return asyncio.run(listed())

    def read(self, topic: str, *, idle_s: float = 1.0) -> list[Record]:
        """Every record of ``topic`` from the beginning, partition by partition in offset
        order (what a consumer of each partition reads)."""

        async def read_all() -> list[Record]:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
            )
            await consumer.start()
            try:
                partitions = consumer.partitions_for_topic(topic) or set()
                if not partitions:
                    await consumer._client.force_metadata_update()
                    partitions = consumer.partitions_for_topic(topic) or set()
                tps = [TopicPartition(topic, p) for p in sorted(partitions)]
                consumer.assign(tps)
                await consumer.seek_to_beginning(*tps)
                ends = await consumer.end_offsets(tps)
                got: list[Record] = []

                async def behind() -> bool:
                    return any([await consumer.position(tp) < ends[tp] for tp in tps])

                while await behind():
                    batch = await consumer.getmany(timeout_ms=int(idle_s * 1000))
                    if not batch:
                        break
                    for tp, records in batch.items():
                        for r in records:
                            headers = {k: v.decode() for k, v in r.headers}
                            got.append(Record(tp.topic, tp.partition, r.offset, r.key, r.value, headers))
                return sorted(got, key=lambda r: (r.partition, r.offset))
            finally:
                await consumer.stop()

        return asyncio.run(read_all())


@pytest.fixture(scope="session")
def kafka() -> Iterator[KafkaService]:
    data_dir = Path(tempfile.mkdtemp(prefix="relay-noida-"))
    port = free_port()
    log = data_dir.parent / f"{data_dir.name}.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [noida_binary(), "start", "--only", "kafka", "--kafka-port", str(port), "--data-dir", str(data_dir)],
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )
    service = KafkaService(f"127.0.0.1:{port}", process, data_dir)
    try:
        up = wait_until(lambda: f"127.0.0.1:{port}" in log.read_text() or process.poll() is not None, timeout=30)
        assert up and process.poll() is None, log.read_text()[-2000:]
        yield service
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
        log.unlink(missing_ok=True)
