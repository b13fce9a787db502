"""SQS test services: moto in server mode over real HTTP, and faults moto cannot produce.

- :func:`moto_endpoint` (session fixture): ``moto.server.ThreadedMotoServer`` on a free
  127.0.0.1 port, in this process, with fake AWS credentials in the environment, and its
  cost per message kept from growing with the queue (:func:`speed_up_moto`).
- :class:`Faults`: answers chosen calls at the botocore layer (a ``before-send`` hook
  returning an ``AWSResponse``), for what moto never says: throttling, KMS, 5xx, entry
  failures, rejected credentials. Everything else reaches moto.
- :func:`silent_endpoint`, :func:`closing_endpoint`, :func:`full_backlog_endpoint`,
  :func:`refused_endpoint`: real sockets that time out reads, drop connections, time out
  connects, and refuse connections.

The fixtures are registered for every test module by ``pytest_plugins`` in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import boto3
import pytest
from botocore.awsrequest import AWSPreparedRequest, AWSResponse

from tests.relay_process import FAKE_AWS_ENV

ACCOUNT = "123456789012"  # moto's default account
_queue_numbers = itertools.count(1)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of an in-process moto server, for the whole session."""
    saved = {k: os.environ.get(k) for k in (*FAKE_AWS_ENV, "AWS_PROFILE", "AWS_SESSION_TOKEN")}
    os.environ.update(FAKE_AWS_ENV)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(key, None)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request
    speed_up_moto()
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def speed_up_moto() -> None:
    """Keep moto's SQS cost per message from growing with the queue.

    moto refreshes three approximate message counters on every message sent, by looking
    at every message in the queue and reading the clock through datetime arithmetic for
    each: 1,000 messages into a FIFO queue cost about a minute of CPU. Under that load
    the relay's reads time out and it resends, and moto's FIFO de-duplication (a scan of
    the queue, then an append, not atomic) can let a resend that overlaps the original
    through. Real SQS has neither problem, so the fixture removes the cost:

    - the clock: ``time.time()`` gives the same milliseconds, read twenty times faster;
    - the counters (``ApproximateNumberOfMessages*``, read by no test) answer 0.
    """
    import moto.sqs.models

    models: Any = moto.sqs.models
    if getattr(models, "_relay_sped_up", False):
        return
    slow_seconds, slow_millis = models.unix_time, models.unix_time_millis

    def unix_time(dt: Any = None) -> float:
        return time.time() if dt is None else float(slow_seconds(dt))

    def unix_time_millis(dt: Any = None) -> float:
        return time.time() * 1000.0 if dt is None else float(slow_millis(dt))

    models.unix_time, models.unix_time_millis = unix_time, unix_time_millis
    for counter in (
        "approximate_number_of_messages",
        "approximate_number_of_messages_delayed",
        "approximate_number_of_messages_not_visible",
    ):
        setattr(models.Queue, counter, property(lambda self: 0))
    models._relay_sped_up = True


@pytest.fixture(scope="session")
def sqs_client(moto_endpoint: str) -> Any:
    """A plain boto3 client on moto, for arranging queues and consuming from them."""
    return boto3.client("sqs", endpoint_url=moto_endpoint, region_name="us-east-1")


@pytest.fixture
def make_queue(sqs_client: Any) -> Iterator[Callable[..., str]]:
    """``make_queue(fifo=True, **attributes)`` creates a queue with a fresh name; deleted after the test."""
    made: list[str] = []

    def make(fifo: bool = True, **attributes: str) -> str:
        url = create_queue(sqs_client, unique_queue_name(fifo), **attributes)
        made.append(url)
        return url

    yield make
    for url in made:
        with contextlib.suppress(Exception):
            sqs_client.delete_queue(QueueUrl=url)


def unique_queue_name(fifo: bool) -> str:
    name = f"t{next(_queue_numbers)}-{uuid.uuid4().hex[:8]}"
    return name + ".fifo" if fifo else name


def create_queue(client: Any, name: str, **attributes: str) -> str:
    attrs = dict(attributes)
    if name.endswith(".fifo"):
        attrs.setdefault("FifoQueue", "true")
    url: str = client.create_queue(QueueName=name, Attributes=attrs)["QueueUrl"]
    return url


def queue_url(endpoint: str, name: str) -> str:
    """The URL moto gives a queue of that name (whether or not it exists yet)."""
    return f"{endpoint}/{ACCOUNT}/{name}"


@dataclass(frozen=True)
class Received:
    """One message as a consumer got it."""

    body: str
    attributes: dict[str, str]  # message attributes, by name
    system: dict[str, str]  # MessageGroupId, MessageDeduplicationId, ...
    data_types: dict[str, str] = field(default_factory=dict)  # each attribute's DataType: String, Number

    @property
    def outbox_id(self) -> int:
        return int(self.attributes["outbox_id"])


def receive_all(client: Any, url: str, *, idle_s: float = 0.0) -> list[Received]:
    """Read and delete everything in the queue, in the order SQS hands it out.

    Stops at the first empty receive (after ``idle_s`` more seconds of empty receives).
    Deleting each batch before the next receive keeps FIFO groups from blocking.
    """
    got: list[Received] = []
    deadline: float | None = None
    while True:
        answer = client.receive_message(
            QueueUrl=url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=0,
            MessageAttributeNames=["All"],
            MessageSystemAttributeNames=["All"],
        )
        messages = answer.get("Messages", [])
        if not messages:
            if deadline is None:
                deadline = time.monotonic() + idle_s
            if time.monotonic() >= deadline:
                return got
            time.sleep(0.05)
            continue
        deadline = None
        for m in messages:
            attrs = {k: v["StringValue"] for k, v in m.get("MessageAttributes", {}).items()}
            types = {k: v["DataType"] for k, v in m.get("MessageAttributes", {}).items()}
            got.append(Received(m["Body"], attrs, dict(m.get("Attributes", {})), types))
        client.delete_message_batch(
            QueueUrl=url,
            Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)],
        )


# ---------------------------------------------------------------------------------------
# Faults at the botocore layer


class _Body:
    """The ``raw`` an AWSResponse reads its content from."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._data


@dataclass
class Call:
    """One request the client was about to send."""

    operation: str  # e.g. "SendMessageBatch"
    params: dict[str, Any]

    @property
    def entry_ids(self) -> list[str]:
        return [e["Id"] for e in self.params.get("Entries", [])]


Rule = Callable[[Call], "AWSResponse | BaseException | None"]


@dataclass
class Faults:
    """Answers chosen calls before they reach the network; records every call.

    Register on the boto3 session a publisher is built from (``faults.register(session)``),
    since a client copies its session's hooks when it is created. This one speaks SQS's
    JSON protocol; :class:`tests.sns_server.SnsFaults` says the same in SNS's query protocol.
    """

    rules: list[Rule] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    service: ClassVar[str] = "sqs"
    batch_operation: ClassVar[str] = "SendMessageBatch"

    def register(self, session: boto3.session.Session) -> None:
        hook: Any = self._before_send  # a before-send handler may return the response
        session.events.register(f"before-send.{self.service}", hook)

    def _before_send(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse | None:
        call = self.parse(request)
        self.calls.append(call)
        for rule in self.rules:
            answer = rule(call)
            if isinstance(answer, BaseException):
                raise answer
            if answer is not None:
                return answer
        return None

    def parse(self, request: AWSPreparedRequest) -> Call:
        """The call a request makes: its operation, and its parameters with ``Entries``."""
        target = request.headers.get("X-Amz-Target", b"")
        target = target.decode() if isinstance(target, bytes) else str(target)
        body = request.body
        raw = body.decode() if isinstance(body, bytes) else str(body or "{}")
        return Call(target.rsplit(".", 1)[-1], json.loads(raw or "{}"))

    def error_answer(self, code: str, *, status: int, query_code: str | None, message: str) -> AWSResponse:
        return error_response(code, status=status, query_code=query_code, message=message)

    def entries_answer(self, ok: list[str], failed: list[tuple[str, str, bool]]) -> AWSResponse:
        """A 200 answer to a batch call: ``ok`` Ids succeeded, ``failed`` (Id, Code, SenderFault) did not."""
        return json_response(
            200,
            {
                "Successful": [{"Id": i, "MessageId": str(uuid.uuid4()), "MD5OfMessageBody": "0" * 32} for i in ok],
                "Failed": [{"Id": i, "SenderFault": f, "Code": c, "Message": "injected"} for i, c, f in failed],
            },
        )

    def sends(self) -> list[Call]:
        return [c for c in self.calls if c.operation == self.batch_operation]

    def error(
        self,
        code: str,
        *,
        status: int = 400,
        query_code: str | None = None,
        message: str = "injected",
        operation: str | None = None,
        when: Callable[[Call], bool] | None = None,
    ) -> None:
        """Refuse matching calls (by default the batch call) the way the service does: for
        SQS ``__type`` in the body and the query-protocol code in ``x-amzn-query-error``."""
        operation = operation or self.batch_operation

        def rule(call: Call) -> AWSResponse | None:
            if call.operation != operation or (when is not None and not when(call)):
                return None
            return self.error_answer(code, status=status, query_code=query_code, message=message)

        self.rules.append(rule)

    def fail_entries(self, failures: dict[str, tuple[str, bool]]) -> None:
        """Answer the batch call with 200 and refuse entries by Id: ``{id: (code, sender_fault)}``;
        the rest are reported Successful (without reaching moto)."""

        def rule(call: Call) -> AWSResponse | None:
            if call.operation != self.batch_operation or not set(call.entry_ids) & set(failures):
                return None
            ok = [i for i in call.entry_ids if i not in failures]
            failed = [(i, *failures[i]) for i in call.entry_ids if i in failures]
            return self.entries_answer(ok, failed)

        self.rules.append(rule)

    def raise_(self, exc: Callable[[], BaseException], operation: str | None = None) -> None:
        operation = operation or self.batch_operation
        self.rules.append(lambda call: exc() if call.operation == operation else None)


def json_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> AWSResponse:
    all_headers = {"Content-Type": "application/x-amz-json-1.0", **(headers or {})}
    return raw_response(status, json.dumps(body).encode(), all_headers)


def raw_response(status: int, data: bytes, headers: dict[str, str]) -> AWSResponse:
    """An answer as botocore would have read it off the wire."""
    all_headers: Any = {"x-amzn-RequestId": str(uuid.uuid4()), **headers}
    return AWSResponse("https://injected", status, all_headers, _Body(data))


def error_response(code: str, *, status: int, query_code: str | None, message: str) -> AWSResponse:
    headers = {"x-amzn-query-error": f"{query_code};Sender"} if query_code else {}
    type_ = code if "#" in code or code.endswith("Exception") else f"com.amazonaws.sqs#{code}"
    return json_response(status, {"__type": type_, "message": message}, headers)


# ---------------------------------------------------------------------------------------
# Network faults, with real sockets


def _listener(backlog: int = 16) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


@contextlib.contextmanager
def _serving(handle: Callable[[socket.socket], None], backlog: int = 16) -> Iterator[str]:
    sock = _listener(backlog)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def loop() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except (TimeoutError, OSError):
                continue
            conns.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()
        sock.close()


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """Accepts connections and requests, and never answers: read timeouts."""

    def hold(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass

    with _serving(hold) as url:
        yield url


@contextlib.contextmanager
def closing_endpoint() -> Iterator[str]:
    """Reads the request, then closes the connection without a word: connection closed."""

    def drop(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.recv(65536)
            conn.close()

    with _serving(drop) as url:
        yield url


@contextlib.contextmanager
def full_backlog_endpoint() -> Iterator[str]:
    """A listener whose accept queue is full and never drained: new connects time out."""
    sock = _listener(backlog=0)
    filler = socket.create_connection(sock.getsockname(), timeout=1)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        filler.close()
        sock.close()


def refused_endpoint() -> str:
    """A port nothing listens on: connections are refused."""
    sock = _listener()
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"
