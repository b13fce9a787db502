"""SNS test services on the session's moto server (:func:`tests.sqs_server.moto_endpoint`).

- :func:`make_topic` (fixture): a topic with a fresh name and an SQS queue subscribed to it
  with ``RawMessageDelivery``, so a test reads what SNS delivered, attributes and group
  ids included, with :func:`tests.sqs_server.receive_all`; FIFO topics get FIFO queues.
- :class:`SnsFaults`: :class:`tests.sqs_server.Faults` in SNS's query protocol (form
  parameters in, XML out), for what moto never says: throttling, 5xx, KMS,
  ``AuthorizationError``, ``BatchRequestTooLong``, entry failures.

The fixtures are registered for every test module by ``pytest_plugins`` in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

import boto3
import pytest
from botocore.awsrequest import AWSPreparedRequest, AWSResponse

from tests.sqs_server import ACCOUNT, Call, Faults, create_queue, raw_response, unique_queue_name

REGION = "us-east-1"
_topic_numbers = itertools.count(1)
_MEMBER = re.compile(r"^PublishBatchRequestEntries\.member\.(\d+)\.(.+)$")
_XMLNS = "http://sns.amazonaws.com/doc/2010-03-31/"


@pytest.fixture(scope="session")
def sns_client(moto_endpoint: str) -> Any:
    """A plain boto3 client on moto, for arranging topics."""
    return boto3.client("sns", endpoint_url=moto_endpoint, region_name=REGION)


@dataclass(frozen=True)
class Topic:
    """A topic and the raw-delivery SQS queue subscribed to it."""

    arn: str
    queue_url: str


def unique_topic_name(fifo: bool) -> str:
    name = f"topic{next(_topic_numbers)}-{uuid.uuid4().hex[:8]}"
    return name + ".fifo" if fifo else name


def topic_arn(name: str) -> str:
    """The ARN moto gives a topic of that name (whether or not it exists yet)."""
    return f"arn:aws:sns:{REGION}:{ACCOUNT}:{name}"


def create_topic(sns_client: Any, name: str) -> str:
    attributes = {"FifoTopic": "true"} if name.endswith(".fifo") else {}
    arn: str = sns_client.create_topic(Name=name, Attributes=attributes)["TopicArn"]
    return arn


def subscribe_queue(sns_client: Any, sqs_client: Any, arn: str) -> str:
    """A new queue (FIFO for a FIFO topic) subscribed to ``arn`` with raw delivery; its URL."""
    name = unique_queue_name(fifo=arn.endswith(".fifo"))
    url = create_queue(sqs_client, name)
    sns_client.subscribe(
        TopicArn=arn,
        Protocol="sqs",
        Endpoint=f"arn:aws:sqs:{REGION}:{ACCOUNT}:{name}",
        Attributes={"RawMessageDelivery": "true"},
    )
    return url


@pytest.fixture
def make_topic(sns_client: Any, sqs_client: Any) -> Iterator[Callable[..., Topic]]:
    """``make_topic(fifo=True)``: a topic with a subscribed queue; both deleted after the test."""
    made: list[Topic] = []

    def make(fifo: bool = True) -> Topic:
        arn = create_topic(sns_client, unique_topic_name(fifo))
        topic = Topic(arn, subscribe_queue(sns_client, sqs_client, arn))
        made.append(topic)
        return topic

    yield make
    for topic in made:
        with contextlib.suppress(Exception):
            sns_client.delete_topic(TopicArn=topic.arn)
        with contextlib.suppress(Exception):
            sqs_client.delete_queue(QueueUrl=topic.queue_url)


class SnsFaults(Faults):
    """:class:`tests.sqs_server.Faults` for an SNS client: ``PublishBatch`` is the batch call."""

    service: ClassVar[str] = "sns"
    batch_operation: ClassVar[str] = "PublishBatch"

    def parse(self, request: AWSPreparedRequest) -> Call:
        body = request.body
        raw = body.decode() if isinstance(body, bytes) else str(body or "")
        form = {k: v[0] for k, v in parse_qs(raw, keep_blank_values=True).items()}
        members: dict[int, dict[str, str]] = {}
        for key, value in form.items():
            found = _MEMBER.match(key)
            if found:
                members.setdefault(int(found.group(1)), {})[found.group(2)] = value
        params: dict[str, Any] = {**form, "Entries": [members[n] for n in sorted(members)]}
        return Call(form.get("Action", ""), params)

    def error_answer(self, code: str, *, status: int, query_code: str | None, message: str) -> AWSResponse:
        body = (
            f'<ErrorResponse xmlns="{_XMLNS}"><Error><Type>Sender</Type><Code>{escape(query_code or code)}</Code>'
            f"<Message>{escape(message)}</Message></Error><RequestId>{uuid.uuid4()}</RequestId></ErrorResponse>"
        )
        return xml_response(status, body)

    def entries_answer(self, ok: list[str], failed: list[tuple[str, str, bool]]) -> AWSResponse:
        good = "".join(f"<member><Id>{escape(i)}</Id><MessageId>{uuid.uuid4()}</MessageId></member>" for i in ok)
        bad = "".join(
            f"<member><Id>{escape(i)}</Id><Code>{escape(c)}</Code><Message>injected</Message>"
            f"<SenderFault>{'true' if f else 'false'}</SenderFault></member>"
            for i, c, f in failed
        )
        body = (
            f'<PublishBatchResponse xmlns="{_XMLNS}"><PublishBatchResult><Successful>{good}</Successful>'
            f"<Failed>{bad}</Failed></PublishBatchResult><ResponseMetadata><RequestId>{uuid.uuid4()}</RequestId>"
            "</ResponseMetadata></PublishBatchResponse>"
        )
        return xml_response(200, body)


def xml_response(status: int, body: str) -> AWSResponse:
    return raw_response(status, body.encode(), {"Content-Type": "text/xml"})
