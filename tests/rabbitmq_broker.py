"""The real RabbitMQ the RabbitMQ tests run against, and the means to break it on purpose.

Where the broker comes from: ``RELAY_TEST_AMQP_URL``; else a testcontainers RabbitMQ where
a Docker engine answers; else the tests skip with a line saying how to provide one (and
fail instead under ``RELAY_TEST_REQUIRE_SERVICES=1``).

The broker is shared with other suites, so everything here touches only what a test made
itself: exchanges and queues with unique names (deleted afterwards), connections named
through ``client_properties`` (the only ones closed or suspended), and broker settings
restored in ``finally``. The fixtures are registered for every test module by
``pytest_plugins`` in tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import aio_pika
import aio_pika.abc
import pytest

from relay.adapters.rabbitmq.publisher import RabbitPublisher
from relay.adapters.rabbitmq.settings import RabbitSettings, RoutingKeyTemplate
from relay.db.names import OutboxNames
from relay.message import OutboxMessage
from tests.services import docker_answers, require_services

SKIP_AMQP = (
    "no RabbitMQ for the tests: set RELAY_TEST_AMQP_URL=amqp://user:password@host:5672/ "
    "(bash .ci/run does this) or run a Docker engine for testcontainers"
)
SKIP_CTL = (
    "rabbitmqctl cannot reach the test broker (it must run on this machine, as a user that "
    "holds its Erlang cookie, or in the testcontainers broker)"
)


@dataclass(frozen=True)
class AmqpService:
    """Where the test broker is, and how to run ``rabbitmqctl`` against it (None: not possible)."""

    url: str
    ctl_argv: tuple[str, ...] | None

    def with_path(self, vhost: str) -> str:
        """The URL with another virtual host."""
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))

    def with_password(self, password: str) -> str:
        parts = urlsplit(self.url)
        user = parts.username or "guest"
        host = parts.hostname or "127.0.0.1"
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}{port}"))

    def with_user(self, user: str, password: str) -> str:
        parts = urlsplit(self.url)
        host = parts.hostname or "127.0.0.1"
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}{port}"))

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 5672


@contextlib.contextmanager
def rabbitmq_service() -> Iterator[AmqpService | None]:
    url = os.environ.get("RELAY_TEST_AMQP_URL")
    if url:
        local = shutil.which("rabbitmqctl")
        yield AmqpService(url, (local,) if local else None)
        return
    if docker_answers():
        from testcontainers.community.rabbitmq import RabbitMqContainer

        with RabbitMqContainer("rabbitmq:3.10") as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(container.port)
            cid = container.get_wrapped_container().id
            yield AmqpService(f"amqp://guest:guest@{host}:{port}/", ("docker", "exec", cid, "rabbitmqctl"))
        return
    yield None


@pytest.fixture(scope="session")
def amqp() -> Iterator[AmqpService]:
    """The test broker (session-wide)."""
    with rabbitmq_service() as service:
        if service is None:
            if require_services():
                pytest.fail(SKIP_AMQP)
            pytest.skip(SKIP_AMQP)
        yield service


@pytest.fixture(scope="session")
def ctl(amqp: AmqpService) -> BrokerControl:
    """``rabbitmqctl`` against the test broker, for faults only the broker side can make."""
    control = BrokerControl(amqp.ctl_argv) if amqp.ctl_argv else None
    if control is None or not control.works():
        if require_services():
            pytest.fail(SKIP_CTL)
        pytest.skip(SKIP_CTL)
    return control


class BrokerControl:
    """``rabbitmqctl``, limited to what a test may do on a shared broker."""

    def __init__(self, argv: tuple[str, ...]) -> None:
        self.argv = argv

    def run(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        proc = subprocess.run([*self.argv, *args], capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout.strip()

    def works(self) -> bool:
        try:
            return "ok" in self.run("eval", "ok.", check=False, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return False

    def eval(self, expression: str) -> str:
        return self.run("eval", expression)

    def connection_pids(self, connection_name: str) -> list[str]:
        """Broker-side ids of the connections a client named ``connection_name``."""
        out = self.run("list_connections", "pid", "client_properties", "--no-table-headers", "--silent")
        wanted = f'{{"connection_name","{connection_name}"}}'
        return [line.split("\t", 1)[0] for line in out.splitlines() if wanted in line]

    def close_connections(self, connection_name: str) -> int:
        """Close, from the broker side, every connection named ``connection_name``."""
        pids = self.connection_pids(connection_name)
        for pid in pids:
            # Exit status 69 with channel_termination_timeout still closes the connection
            # (a suspended channel does not answer the shutdown request).
            self.run("close_connection", pid, "closed by the relay's tests", check=False)
        return len(pids)

    def suspend_channels(self, connection_name: str) -> list[str]:
        """Stop the broker's channel processes of one named connection (only that one): the
        broker then routes and confirms nothing on them, as a stalled broker would."""
        name = connection_name.replace("\\", "\\\\").replace('"', '\\"')
        out = self.eval(
            f'Name = <<"{name}">>,'
            " Conns = [P || P <- rabbit_networking:connections(),"
            '   lists:member({<<"connection_name">>, longstr, Name},'
            "     proplists:get_value(client_properties, rabbit_reader:info(P, [client_properties]), []))],"
            " Chs = [C || C <- rabbit_channel:list(),"
            "   lists:member(proplists:get_value(connection, rabbit_channel:info(C, [connection])), Conns)],"
            " [sys:suspend(C) || C <- Chs],"
            " [pid_to_list(C) || C <- Chs]."
        )
        return re.findall(r'"(<[0-9.]+>)"', out)

    def resume(self, pids: list[str]) -> None:
        if pids:
            listed = ", ".join(f'"{p}"' for p in pids)
            self.eval(f"[catch sys:resume(list_to_pid(P)) || P <- [{listed}]].")

    @contextlib.contextmanager
    def suspended(self, connection_name: str) -> Iterator[list[str]]:
        pids = self.suspend_channels(connection_name)
        try:
            yield pids
        finally:
            self.resume(pids)

    @contextlib.contextmanager
    def max_message_size(self, size: int) -> Iterator[None]:
        """Lower the broker's max_message_size for channels opened meanwhile; always restored."""
        before = self.eval("application:get_env(rabbit, max_message_size).")
        self.eval(f"application:set_env(rabbit, max_message_size, {int(size)}).")
        try:
            yield
        finally:
            match = re.search(r"\{ok,\s*(\d+)\}", before)
            if match:
                self.eval(f"application:set_env(rabbit, max_message_size, {match.group(1)}).")
            else:
                self.eval("application:unset_env(rabbit, max_message_size).")

    def alarms(self) -> str:
        """The broker's resource alarms (``[]`` when none)."""
        return self.eval("rabbit_alarm:get_alarms().")

    @contextlib.contextmanager
    def memory_alarm(self) -> Iterator[None]:
        """Put the broker under its memory alarm (a watermark no node is under), so it blocks
        every publishing connection; the exact previous watermark is always restored, and
        the alarm is gone when this returns. Keep it short: the broker is shared."""
        before = self.eval("vm_memory_monitor:get_vm_memory_high_watermark().")
        # The term as printed (0.4, or {absolute,N}) is what the setter takes back.
        with self._alarm(
            "memory",
            lambda: self.run("set_vm_memory_high_watermark", "0.0000001"),
            lambda: self.eval(f"vm_memory_monitor:set_vm_memory_high_watermark({before})."),
        ):
            yield

    @contextlib.contextmanager
    def disk_alarm(self) -> Iterator[None]:
        """Like :meth:`memory_alarm` with the disk alarm: a free-space limit of a petabyte."""
        before = self.eval("rabbit_disk_monitor:get_disk_free_limit().")
        if not before.isdigit():
            raise RuntimeError(f"unexpected disk_free_limit {before!r}")
        with self._alarm(
            "disk",
            lambda: self.run("set_disk_free_limit", str(10**15)),
            lambda: self.run("set_disk_free_limit", before),
        ):
            yield

    @contextlib.contextmanager
    def _alarm(self, kind: str, raise_it: Callable[[], object], restore: Callable[[], object]) -> Iterator[None]:
        if self.alarms() != "[]":
            pytest.skip(f"the broker is already under an alarm: {self.alarms()}")
        try:
            raise_it()
            deadline = time.monotonic() + 15
            while kind not in self.alarms():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {kind} alarm 15 s after setting it")
                time.sleep(0.1)
            yield
        finally:
            restore()
            deadline = time.monotonic() + 30
            while self.alarms() != "[]" and time.monotonic() < deadline:
                time.sleep(0.2)
            if self.alarms() != "[]":
                raise RuntimeError(f"alarm still on 30 s after restoring: {self.alarms()}")

    @contextlib.contextmanager
    def user(self, configure: str, write: str, read: str, vhost: str = "/") -> Iterator[tuple[str, str]]:
        """A throwaway user with the given permission patterns; deleted afterwards."""
        name = f"relay-test-{uuid.uuid4().hex[:8]}"
        password = uuid.uuid4().hex
        self.run("add_user", name, password)
        try:
            self.run("set_permissions", "-p", vhost, name, configure, write, read)
            yield name, password
        finally:
            self.run("delete_user", name, check=False)


def unique(prefix: str) -> str:
    return f"relay-test-{prefix}-{uuid.uuid4().hex[:10]}"


_ids = iter(range(1_000_000, 10**9))


def outbox_message(
    *,
    aggregate_id: str = "order-1",
    event_type: str = "OrderPlaced",
    body: bytes = b'{"n": 1}',
    ordered: bool = False,
    aggregate_type: str = "order",
    attempt: int = 1,
    lease_version: int = 1,
    id: int | None = None,
    aggregate_seq: int | None = None,
) -> OutboxMessage:
    """A claimed outbox row as the publisher sees it, with a fresh id."""
    return OutboxMessage(
        id=next(_ids) if id is None else id,
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        event_type=event_type,
        body=body,
        attempt=attempt,
        lease_version=lease_version,
        ordered=ordered,
        aggregate_seq=aggregate_seq,
    )


@dataclass
class Rabbit:
    """A test's own view of the broker: a named connection for arranging topology and
    reading queues, and the publishers under test, all cleaned up afterwards."""

    amqp: AmqpService
    connection: aio_pika.abc.AbstractRobustConnection
    name: str
    exchanges: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    publishers: list[RabbitPublisher] = field(default_factory=list)

    async def _channel(self) -> aio_pika.abc.AbstractChannel:
        # A fresh plain channel per operation: a failed one (404) closes only itself.
        channel = aio_pika.Channel(self.connection, publisher_confirms=False)
        await channel.initialize()
        return channel

    async def _on_channel(self, action: Callable[[aio_pika.abc.AbstractChannel], Awaitable[Any]]) -> Any:
        channel = await self._channel()
        try:
            return await action(channel)
        finally:
            if not channel.is_closed:
                await channel.close()

    async def exchange(self, type: str = "direct", name: str | None = None) -> str:
        name = name or unique("ex")
        self.exchanges.append(name)
        await self._on_channel(lambda ch: ch.declare_exchange(name, type, durable=True))
        return name

    async def queue(
        self, bind: tuple[str, str] | None = None, arguments: dict[str, Any] | None = None, name: str | None = None
    ) -> str:
        """Declare a queue (durable, so persistent messages stay persistent), bound if asked."""
        name = name or unique("q")
        self.queues.append(name)

        async def declare(ch: aio_pika.abc.AbstractChannel) -> None:
            queue = await ch.declare_queue(name, durable=True, arguments=arguments)
            if bind is not None:
                await queue.bind(bind[0], bind[1])

        await self._on_channel(declare)
        return name

    async def bind(self, queue: str, exchange: str, key: str) -> None:
        async def run(ch: aio_pika.abc.AbstractChannel) -> None:
            await (await ch.get_queue(queue, ensure=False)).bind(exchange, key)

        await self._on_channel(run)

    async def unbind(self, queue: str, exchange: str, key: str) -> None:
        async def run(ch: aio_pika.abc.AbstractChannel) -> None:
            await (await ch.get_queue(queue, ensure=False)).unbind(exchange, key)

        await self._on_channel(run)

    async def delete_exchange(self, name: str) -> None:
        await self._on_channel(lambda ch: ch.exchange_delete(name))

    async def count(self, queue: str) -> int:
        async def run(ch: aio_pika.abc.AbstractChannel) -> int:
            declared = await ch.declare_queue(queue, passive=True)
            return int(declared.declaration_result.message_count or 0)

        result: int = await self._on_channel(run)
        return result

    async def drain(
        self, queue: str, expected: int, timeout: float = 10.0
    ) -> list[aio_pika.abc.AbstractIncomingMessage]:
        """Consume (and ack) messages in arrival order until ``expected`` arrived or
        ``timeout`` passed; then wait a little for any extra (a duplicate) to show up."""
        got: list[aio_pika.abc.AbstractIncomingMessage] = []
        arrived = asyncio.Event()
        if expected <= 0:
            arrived.set()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()
            got.append(message)
            if len(got) >= expected:
                arrived.set()

        channel = await self._channel()
        try:
            await channel.set_qos(prefetch_count=1000)
            q = await channel.get_queue(queue, ensure=False)
            tag = await q.consume(on_message)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), timeout)
            await asyncio.sleep(0.1)
            await q.cancel(tag)
        finally:
            await channel.close()
        return got

    async def publisher(self, **options: Any) -> RabbitPublisher:
        """A started publisher under test; ``options`` override RabbitSettings fields
        (``routing_key`` may be a template string), ``url`` the broker address."""
        if isinstance(options.get("routing_key"), str):
            options["routing_key"] = RoutingKeyTemplate(options["routing_key"])
        options.setdefault("url", self.amqp.url)
        publisher = RabbitPublisher(RabbitSettings(**options), connection_name=unique("publisher"))
        await publisher.start()
        self.publishers.append(publisher)
        return publisher

    async def cleanup(self) -> None:
        for publisher in self.publishers:
            await publisher.close()
        for queue in self.queues:
            with contextlib.suppress(Exception):
                await self._on_channel(lambda ch, q=queue: ch.queue_delete(q))  # type: ignore[misc]
        for exchange in self.exchanges:
            with contextlib.suppress(Exception):
                await self._on_channel(lambda ch, x=exchange: ch.exchange_delete(x))  # type: ignore[misc]
        await self.connection.close()


@pytest.fixture
async def rabbit(amqp: AmqpService) -> AsyncIterator[Rabbit]:
    """A fresh :class:`Rabbit`; everything it made is deleted after the test."""
    name = unique("arrange")
    connection = await aio_pika.connect_robust(amqp.url, client_properties={"connection_name": name})
    helper = Rabbit(amqp, connection, name)
    try:
        yield helper
    finally:
        await helper.cleanup()


class TcpProxy:
    """A TCP relay between the publisher and the broker: the network between them, which
    a test can slow down (``latency``, which applies from broker to client, and may be
    changed while connections are open) or cut and restore, without touching the broker."""

    def __init__(self, host: str, port: int, latency: float = 0.0) -> None:
        self.target = (host, port)
        self.latency = latency
        # Bytes that, seen from a client, reset that client's connection: a fault of one
        # message (a limit nobody checked) that takes its whole connection down.
        self.poison: bytes | None = None
        self.poisoned = 0  # connections reset so
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def url(self, base: str) -> str:
        parts = urlsplit(base)
        auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{self.port}"))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Stop listening and reset every connection: to the client, the broker is gone."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def restore(self) -> None:
        await self.start()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers |= {client_writer, upstream_writer}

        def sever() -> None:
            self.poisoned += 1
            client_writer.transport.abort()
            upstream_writer.transport.abort()

        for task in (
            asyncio.create_task(self._pump(client_reader, upstream_writer, lambda: 0.0, sever)),
            asyncio.create_task(self._pump(upstream_reader, client_writer, lambda: self.latency)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        latency: Callable[[], float],
        sever: Callable[[], None] | None = None,
    ) -> None:
        # Each chunk is delivered `latency` after it was read, in order: a delay on the
        # path, not a bandwidth limit.
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - loop.time()))
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        tail = b""
        try:
            while data := await reader.read(65536):
                if sever is not None and self.poison and self.poison in tail + data:
                    sever()
                    break
                tail = data[-64:]
                queue.put_nowait((loop.time() + latency(), data))
            queue.put_nowait((0.0, b""))
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()
            writer.transport.abort()
            self._writers.discard(writer)


@pytest.fixture
async def proxy(amqp: AmqpService) -> AsyncIterator[TcpProxy]:
    """A :class:`TcpProxy` to the test broker, torn down afterwards."""
    p = TcpProxy(amqp.host, amqp.port)
    await p.start()
    try:
        yield p
    finally:
        await p.cut()


def relay_args(pg_dsn: str, names: OutboxNames, url: str, *extra: str) -> list[str]:
    """The arguments of `relay start` delivering outbox ``names`` to RabbitMQ at ``url``."""
    return ["--dsn", pg_dsn, "--schema", names.schema, "--broker", "rabbitmq", "--amqp-url", url, *extra]
