"""SQS and SNS side by side, for the tests both AWS destinations share
(tests/test_aws_adapters.py, tests/test_aws_e2e.py).

The two adapters share their publisher, failure classes and entry checks
(:mod:`relay.adapters.aws`), so one test serves both, parametrized by :class:`AwsKind`:
what differs is how a destination is addressed (a queue URL, a topic ARN), what the service
calls a missing one, which fault hook speaks its protocol, and its size limits. What a
topic delivered is read from the SQS queue subscribed to it (:func:`tests.sns_server.make_topic`),
so both are read back the same way. Registered as a plugin by tests/conftest.py.

- the ``aws_kind`` fixture runs a test once per destination; a test parametrized on
  ``aws_kind`` with cases of its own (the fault codes each service speaks) overrides it;
- the ``aws`` fixture (moto) makes destinations of that kind and publishers on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest

from relay.adapters import sns, sqs
from relay.adapters.aws.publisher import AwsPublisher
from relay.adapters.sns.publisher import SnsPublisher
from relay.adapters.sqs.publisher import SqsPublisher
from relay.contract import PublishLimits
from relay.options import Option
from tests.sns_server import SnsFaults, Topic, create_topic, subscribe_queue, topic_arn, unique_topic_name
from tests.sqs_server import Faults, create_queue, queue_url, unique_queue_name

AnyPublisher = AwsPublisher[Any, Any]


@dataclass(frozen=True)
class AwsKind:
    """What a test needs to know of one AWS destination."""

    broker: str  # --broker, the config file's table, the prefix of its own options
    service: str  # how messages name the service: "SQS", "SNS"
    noun: str  # and its destination: "queue", "topic"
    address: str  # the option that names the destination (its dest)
    missing: str  # what the service says of a destination that is not there
    options: tuple[Option, ...]
    create: Callable[[Mapping[str, Any], PublishLimits], AnyPublisher]
    publisher: Callable[..., AnyPublisher]  # the class: (settings, *, session)
    settings: type[sqs.SqsSettings] | type[sns.SnsSettings]
    faults: type[Faults]  # the botocore hook that speaks its protocol
    max_message_bytes: int  # what the service takes in one message, and in one batch request
    max_request_bytes: int

    @property
    def flag(self) -> str:
        return "--" + self.address.replace("_", "-")

    @property
    def destination(self) -> str:
        """How messages name a destination of this kind: "SQS queue", "SNS topic"."""
        return f"{self.service} {self.noun}"

    def address_at(self, endpoint: str, name: str) -> str:
        """The address of a destination named ``name`` on ``endpoint`` (moto's, or a socket's)."""
        return queue_url(endpoint, name) if self is SQS else topic_arn(name)

    def fields(self, address: str, endpoint: str | None) -> dict[str, Any]:
        """The settings a test publisher starts from (before its own overrides). SQS is
        told its region; SNS reads it from the ARN."""
        if self is SQS:
            parts = urlsplit(address)
            return {"queue_url": address, "region": "us-east-1", "endpoint_url": f"{parts.scheme}://{parts.netloc}"}
        return {"topic_arn": address, "endpoint_url": endpoint}

    def __str__(self) -> str:
        return self.broker


SQS = AwsKind(
    broker="sqs",
    service="SQS",
    noun="queue",
    address="queue_url",
    missing="NonExistentQueue",
    options=sqs.SPEC.options,
    create=sqs.SPEC.create,
    publisher=SqsPublisher,
    settings=sqs.SqsSettings,
    faults=Faults,
    max_message_bytes=1_048_576,  # 1 MiB since 2025
    max_request_bytes=1_048_576,
)
SNS = AwsKind(
    broker="sns",
    service="SNS",
    noun="topic",
    address="topic_arn",
    missing="NotFound",
    options=sns.SPEC.options,
    create=sns.SPEC.create,
    publisher=SnsPublisher,
    settings=sns.SnsSettings,
    faults=SnsFaults,
    max_message_bytes=262_144,  # 256 KiB: SNS did not follow SQS to 1 MiB
    max_request_bytes=262_144,
)
KINDS = (SQS, SNS)


@dataclass(frozen=True)
class Destination:
    """A queue or topic a test made: its ``address`` (queue URL, topic ARN) and the queue its
    messages are read from (``inbox``: the queue itself, or the one subscribed to the topic)."""

    address: str
    inbox: str


@dataclass
class AwsWorld:
    """Destinations of one kind on the session's moto server, and publishers on them (each
    on its own boto3 session, so a test's fault hook reaches its publisher only)."""

    kind: AwsKind
    endpoint: str  # moto's
    sqs_client: Any
    sns_client: Any
    make_queue: Callable[..., str]
    make_topic: Callable[..., Topic]
    made: list[AnyPublisher] = field(default_factory=list)
    created: list[Destination] = field(default_factory=list)  # made by create(), removed after the test

    def make(self, fifo: bool = True) -> Destination:
        """A fresh destination, removed after the test."""
        if self.kind is SQS:
            url = self.make_queue(fifo=fifo)
            return Destination(url, url)
        topic = self.make_topic(fifo=fifo)
        return Destination(topic.arn, topic.queue_url)

    def absent(self, fifo: bool) -> tuple[str, str]:
        """A name no destination has yet, and the address it will have."""
        name = unique_queue_name(fifo) if self.kind is SQS else unique_topic_name(fifo)
        return name, self.kind.address_at(self.endpoint, name)

    def create(self, name: str) -> Destination:
        """The destination ``name`` made now (one :meth:`absent` named; FIFO when the name
        ends in .fifo), removed after the test."""
        if self.kind is SQS:
            url = create_queue(self.sqs_client, name)
            made = Destination(url, url)
        else:
            arn = create_topic(self.sns_client, name)
            made = Destination(arn, subscribe_queue(self.sns_client, self.sqs_client, arn))
        self.created.append(made)
        return made

    async def publisher(
        self,
        address: str,
        *,
        faults: Faults | None = None,
        endpoint: str | None = None,
        start: bool = True,
        **overrides: Any,
    ) -> AnyPublisher:
        """A publisher on ``address`` (through ``endpoint``, by default moto), started.

        SDK retries are off (1 attempt) unless a test asks, so each injected fault is seen
        once and no SDK backoff slows the suite. The timeouts are the product's defaults
        (2 s, 5 s) so that a moto slowed by a loaded machine is not a fault; the socket-fault
        tests pass short ones of their own (0.5 s ones failed a concurrent-publish test once
        in CI)."""
        fields = {
            **self.kind.fields(address, endpoint or self.endpoint),
            "sdk_attempts": 1,
            "connect_timeout_s": 2.0,
            "read_timeout_s": 5.0,
            **overrides,
        }
        session = boto3.session.Session()
        if faults is not None:
            faults.register(session)
        p = self.kind.publisher(self.kind.settings(**fields), session=session)
        self.made.append(p)
        if start:
            await p.start()
        return p

    async def publisher_at(self, endpoint: str, **overrides: Any) -> AnyPublisher:
        """A publisher whose requests go to ``endpoint`` (a socket that misbehaves)."""
        return await self.publisher(self.kind.address_at(endpoint, "orders.fifo"), endpoint=endpoint, **overrides)

    async def close(self) -> None:
        for p in self.made:
            await p.close()
        for d in self.created:
            if self.kind is SNS:
                with contextlib.suppress(Exception):
                    self.sns_client.delete_topic(TopicArn=d.address)
            with contextlib.suppress(Exception):
                self.sqs_client.delete_queue(QueueUrl=d.inbox)


@pytest.fixture(params=KINDS, ids=str)
def aws_kind(request: pytest.FixtureRequest) -> AwsKind:
    """Each AWS destination in turn."""
    k: AwsKind = request.param
    return k


@pytest.fixture
async def aws(
    aws_kind: AwsKind,
    moto_endpoint: str,
    sqs_client: Any,
    sns_client: Any,
    make_queue: Callable[..., str],
    make_topic: Callable[..., Topic],
) -> AsyncIterator[AwsWorld]:
    world = AwsWorld(aws_kind, moto_endpoint, sqs_client, sns_client, make_queue, make_topic)
    yield world
    await world.close()
