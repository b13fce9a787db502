"""A Kafka-protocol broker for the tests: noida-db (a broker in Rust from the package index,
MIT; no Apache Kafka distribution can be fetched here), started once per test process on a
free port with its own data directory, and the helpers the tests use on it: topics of
their own (created and deleted), and reading a topic back from the beginning.

``kafka`` is a session fixture registered for every module by ``pytest_plugins`` in
tests/conftest.py; ``own_kafka`` is a broker of the test's own, which it may SIGKILL and
start again (:meth:`KafkaService.kill`, :meth:`KafkaService.restart`).

noida-db keeps its state in memory and writes it to its data directory about every 2 s
(``kafka.json``): a SIGKILL loses what it acknowledged since, records and the producers'
sequence numbers alike, as a Kafka broker that lost its log tail would. Tests that must
not lose acknowledged records wait :data:`PERSIST_S` before a kill.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.protocol.metadata import MetadataRequest

from tests.pg_clusters import free_port
from tests.relay_process import wait_until

# How long after its last change noida-db has surely written its state to disk (it writes
# about every 2 s; measured: records acknowledged 0.3-2 s before a SIGKILL were gone, those
# 2.7 s before it kept).
PERSIST_S = 3.0


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


def start_noida(port: int, data_dir: Path) -> subprocess.Popen[bytes]:
    """noida-db serving Kafka on ``port`` from ``data_dir``, once it listens; its output
    goes to ``<data_dir>.log`` (appended: a restart adds to it)."""
    log = data_dir.parent / f"{data_dir.name}.log"
    with log.open("ab") as out:
        seen = out.tell()
        process = subprocess.Popen(
            [noida_binary(), "start", "--only", "kafka", "--kafka-port", str(port), "--data-dir", str(data_dir)],
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )

    def listening() -> bool:
        return f"127.0.0.1:{port}" in log.read_bytes()[seen:].decode(errors="replace") or process.poll() is not None

    up = wait_until(listening, timeout=30)
    if not (up and process.poll() is None):
        process.kill()
        process.wait()
        raise AssertionError(log.read_text(errors="replace")[-2000:])
    return process


@dataclass
class KafkaService:
    bootstrap: str
    process: subprocess.Popen[bytes]
    data_dir: Path

    @property
    def port(self) -> int:
        return int(self.bootstrap.rsplit(":", 1)[1])

    def kill(self) -> None:
        """SIGKILL the broker (what it acknowledged in its last ~2 s is lost: see the module's
        docstring)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def restart(self) -> None:
        """Start the broker again on its port and data directory, after :meth:`kill`."""
        assert self.process.poll() is not None, "kill() it first"
        self.process = start_noida(self.port, self.data_dir)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                # The broker does not always exit on SIGTERM: it was waited for 10 s at the
                # end of every test session. What it holds is the session's, thrown away.
                self.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def delete_topic(self, topic: str) -> None:
        async def delete() -> None:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            await admin.start()
            try:
                await admin.delete_topics([topic])
            finally:
                await admin.close()

        asyncio.run(delete())

    def partitions(self, topic: str) -> int | None:
        """How many partitions ``topic`` has, None if it does not exist; asked with a
        metadata request that may not create it (the admin client's describe_topics would)."""

        async def ask() -> int | None:
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
            await admin.start()
            try:
                client = admin._client
                response = await client.send(
                    client.get_random_node(), MetadataRequest([topic], allow_auto_topic_creation=False)
                )
            finally:
                await admin.close()
            code, partitions = response.topics[0][0], response.topics[0][-1]
            return len(partitions) if code == 0 else None

        return asyncio.run(ask())

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


def _broker() -> Iterator[KafkaService]:
    data_dir = Path(tempfile.mkdtemp(prefix="relay-noida-"))
    port = free_port()
    service = KafkaService(f"127.0.0.1:{port}", start_noida(port, data_dir), data_dir)
    try:
        yield service
    finally:
        service.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
        (data_dir.parent / f"{data_dir.name}.log").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def kafka() -> Iterator[KafkaService]:
    yield from _broker()


@pytest.fixture
def own_kafka() -> Iterator[KafkaService]:
    """A broker of this test's own, which it may kill and restart (about 0.5 s to start)."""
    yield from _broker()
