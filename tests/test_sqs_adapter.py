"""The SQS publisher against moto over real HTTP: delivery, and every failure class.

moto serves every call except the faults it cannot produce (throttling, KMS, 5xx,
entry failures, rejected credentials), which :class:`tests.sqs_server.Faults` answers at
the botocore layer; network faults come from real sockets.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
from botocore.exceptions import ParamValidationError

from relay.adapters.aws.entries import group_id
from relay.adapters.sqs import SPEC, SqsSettings
from relay.adapters.sqs.publisher import SqsPublisher
from relay.contract import DestinationState
from relay.errors import BrokerUnavailable, ConfigError, Defer, PermanentError, RetryableError
from relay.options import resolve
from tests.helpers import DEFAULT_LIMITS
from tests.helpers import outbox_message as msg
from tests.sqs_server import (
    Faults,
    closing_endpoint,
    full_backlog_endpoint,
    queue_url,
    receive_all,
    refused_endpoint,
    silent_endpoint,
    unique_queue_name,
)

MakePublisher = Callable[..., Awaitable[SqsPublisher]]


@pytest.fixture
async def publisher(moto_endpoint: str) -> AsyncIterator[MakePublisher]:
    """``await publisher(queue_url, faults=None, start=True, **settings)``: a publisher on
    its own boto3 session (with the faults' hook), started, closed after the test.

    SDK retries are off (1 attempt) unless a test asks, so each injected fault is seen once
    and no SDK backoff slows the suite. The timeouts are the product's defaults (2 s, 5 s) so
    that a moto slowed by a loaded machine is not a fault; the socket-fault tests pass
    short ones of their own (0.5 s ones failed a concurrent-publish test once in CI).
    """
    made: list[SqsPublisher] = []

    async def make(url: str, *, faults: Faults | None = None, start: bool = True, **overrides: Any) -> SqsPublisher:
        parts = urlsplit(url)
        fields: dict[str, Any] = {
            "queue_url": url,
            "region": "us-east-1",
            "endpoint_url": f"{parts.scheme}://{parts.netloc}",
            "sdk_attempts": 1,
            "connect_timeout_s": 2.0,
            "read_timeout_s": 5.0,
        }
        fields.update(overrides)
        session = boto3.session.Session()
        if faults is not None:
            faults.register(session)
        p = SqsPublisher(SqsSettings(**fields), session=session)
        made.append(p)
        if start:
            await p.start()
        return p

    yield make
    for p in made:
        await p.close()


def assert_all(outcomes: Any, cls: type[BaseException]) -> None:
    assert outcomes and all(isinstance(o, cls) for o in outcomes), outcomes


# ---------------------------------------------------------------------------------------
# Settings


def test_create_without_a_queue_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^no SQS queue: pass --queue-url"):
        SPEC.create({"queue_url": None}, DEFAULT_LIMITS)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"queue_url": "sqs.us-east-1.amazonaws.com/1/q"}, "invalid --queue-url"),
        ({"queue_url": "ftp://example.com/1/q"}, "invalid --queue-url"),
        ({"queue_url": "https://sqs.us-east-1.amazonaws.com/1/bad name"}, "invalid --queue-url"),
        (
            {"queue_url": "https://sqs.us-east-1.amazonaws.com/1/q", "endpoint_url": "localhost:4566"},
            "invalid --endpoint-url",
        ),
        (
            {"queue_url": "https://sqs.us-east-1.amazonaws.com/1/q", "endpoint_url": "http://h:99999"},
            "invalid --endpoint-url",
        ),
        (
            {"queue_url": "https://sqs.us-east-1.amazonaws.com/1/q", "sqs_read_timeout": timedelta(0)},
            "--sqs-read-timeout",
        ),
    ],
)
def test_unusable_settings_are_one_line_config_errors(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        SPEC.create(values, DEFAULT_LIMITS)
    assert "\n" not in str(info.value)


def test_settings_come_from_flags_relay_env_and_the_toml_sqs_table() -> None:
    by_dest = {o.dest: o for o in SPEC.options}
    assert by_dest["queue_url"].flag == "--queue-url" and by_dest["queue_url"].env == "RELAY_QUEUE_URL"
    assert by_dest["endpoint_url"].flag == "--endpoint-url"
    values = resolve(
        SPEC.options,
        cli={"endpoint_url": "http://127.0.0.1:4566"},
        file={"sqs": {"queue_url": "http://127.0.0.1:4566/000000000000/orders.fifo", "connect_timeout": "750ms"}},
        env={"RELAY_REGION": "eu-west-1", "RELAY_SQS_SDK_ATTEMPTS": "3"},
    )
    s = SqsSettings.from_values(values, replace(DEFAULT_LIMITS, workers=3, batch_size=100))
    assert s.queue_url.endswith("/orders.fifo") and s.fifo
    assert (s.region, s.endpoint_url) == ("eu-west-1", "http://127.0.0.1:4566")
    assert (s.connect_timeout_s, s.read_timeout_s, s.sdk_attempts) == (0.75, 5.0, 3)
    assert s.concurrency == 30  # 3 workers x 10 requests of 10 messages


def test_queue_type_region_and_endpoint_follow_from_the_queue_url() -> None:
    aws = SqsSettings.from_values(
        {"queue_url": "https://sqs.eu-central-1.amazonaws.com/123456789012/orders"}, DEFAULT_LIMITS
    )
    assert (aws.fifo, aws.region_from_url(), aws.endpoint_url) == (False, "eu-central-1", None)
    local = SqsSettings.from_values({"queue_url": "http://localhost:9324/000000000000/orders.fifo"}, DEFAULT_LIMITS)
    assert (local.fifo, local.region_from_url(), local.endpoint_url) == (True, None, "http://localhost:9324")


def test_no_region_anywhere_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="no AWS region for SQS: pass --region"):
        SPEC.create({"queue_url": "http://localhost:9324/000000000000/orders"}, DEFAULT_LIMITS)


async def test_client_keeps_sdk_retries_small_with_explicit_timeouts(
    make_queue: Callable[..., str],
) -> None:
    values = {"queue_url": make_queue(), "region": "us-east-1"}
    p = SPEC.create(values, replace(DEFAULT_LIMITS, workers=2, batch_size=50))
    await p.start()
    try:
        config: Any = p.client.meta.config
        assert config.retries == {"mode": "standard", "total_max_attempts": 2}
        assert (config.connect_timeout, config.read_timeout) == (2.0, 5.0)
        assert config.max_pool_connections == p.settings.concurrency == 10
        assert p.settings.worst_call_s() < 20  # inside the default --publish-timeout
    finally:
        await p.close()


async def test_no_credentials_at_start_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
    publisher: MakePublisher,
    moto_endpoint: str,
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="no AWS credentials for SQS"):
        await publisher(queue_url(moto_endpoint, "q"))


async def test_credentials_aws_rejects_at_start_are_a_config_error(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
) -> None:
    faults = Faults()
    faults.error("UnrecognizedClientException", status=400, operation="GetQueueAttributes")
    with pytest.raises(ConfigError, match=r"AWS refused the credentials for SQS queue .*UnrecognizedClientException"):
        await publisher(make_queue(), faults=faults)


async def test_check_destinations_sees_a_queue_created_later_and_tells_denied_from_unreachable(
    publisher: MakePublisher, make_queue: Callable[..., str], moto_endpoint: str, sqs_client: Any
) -> None:
    # (There and missing for every adapter: tests/test_publisher_conformance.py.)
    name = unique_queue_name(fifo=False)
    absent = await publisher(queue_url(moto_endpoint, name))
    [check] = await absent.check_destinations()
    assert check.state is DestinationState.MISSING and "NonExistentQueue" in check.reason, check
    assert check.known_absent and check.describe().startswith(f"SQS queue {queue_url(moto_endpoint, name)} missing: ")
    sqs_client.create_queue(QueueName=name)
    assert [c.state for c in await absent.check_destinations()] == [DestinationState.EXISTS]

    # Credentials that may send but not read attributes: not known absent (sending may work).
    faults = Faults()
    denied = await publisher(make_queue(), faults=faults)
    faults.error("AccessDenied", status=403, query_code="AccessDenied", operation="GetQueueAttributes")
    [check] = await denied.check_destinations()
    assert check.state is DestinationState.DENIED and not check.known_absent, check

    with silent_endpoint() as endpoint:
        silent = await publisher(f"{endpoint}/000000000000/q", read_timeout_s=0.3, connect_timeout_s=0.3)
        [check] = await silent.check_destinations()
    assert check.state is DestinationState.UNREACHABLE and check.known_absent, check


# ---------------------------------------------------------------------------------------
# Delivery


async def test_standard_queue_gets_the_payload_as_body_and_the_envelope_as_attributes(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue(fifo=False)
    p = await publisher(url)
    batch = [msg(i, f"order-{i % 4}", payload={"order": i, "note": "café ☕"}) for i in range(1, 26)]
    assert await p.publish(batch) == [None] * 25
    assert p.stats.requests == 3  # 10 + 10 + 5
    got = sorted(receive_all(sqs_client, url), key=lambda r: r.outbox_id)
    assert [r.outbox_id for r in got] == list(range(1, 26))
    first = got[0]
    assert json.loads(first.body) == {"order": 1, "note": "café ☕"}
    assert first.attributes == {
        "outbox_id": "1",
        "aggregate_type": "order",
        "aggregate_id": "order-1",
        "event_type": "OrderCreated",
    }  # attempt and lease_version stay out of AWS attributes (adapters.aws.entries.LEFT_OUT)
    assert "MessageGroupId" not in first.system


async def test_ordered_messages_carry_their_aggregate_seq_as_a_number_attribute(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue(fifo=True)
    p = await publisher(url)
    assert await p.publish([msg(1, ordered=True, aggregate_seq=17), msg(2, ordered=False)]) == [None, None]
    answer = sqs_client.receive_message(QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"])
    got = {int(m["MessageAttributes"]["outbox_id"]["StringValue"]): m["MessageAttributes"] for m in answer["Messages"]}
    assert got[1]["aggregate_seq"] == {"DataType": "Number", "StringValue": "17"}
    assert "aggregate_seq" not in got[2]


async def test_fifo_groups_by_aggregate_and_collapses_a_resend_by_outbox_id(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue(fifo=True)
    p = await publisher(url)
    assert p.fifo
    batch = [msg(i, f"order-{i % 3}") for i in range(1, 31)]
    assert await p.publish(batch) == [None] * 30
    assert await p.publish(batch[:12]) == [None] * 12  # a redelivery: SQS collapses it
    got = receive_all(sqs_client, url)
    assert sorted(r.outbox_id for r in got) == list(range(1, 31))
    for r in got:
        assert r.system["MessageGroupId"] == r.attributes["aggregate_id"]
        assert r.system["MessageDeduplicationId"] == r.attributes.get("event_id", str(r.outbox_id))
    # (These messages are unordered, so their three requests went out concurrently and
    # their order within a group is not promised; ordered ones are never in flight together.)


async def test_aggregate_ids_sqs_refuses_as_group_ids_get_a_stable_digest(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    odd = "commande n° 7"  # a space and a non-ASCII letter
    assert group_id(odd) == group_id(odd) != odd and group_id("order-7") == "order-7"
    url = make_queue(fifo=True)
    p = await publisher(url)
    assert await p.publish([msg(1, odd), msg(2, odd)]) == [None, None]
    got = receive_all(sqs_client, url)
    assert [r.system["MessageGroupId"] for r in got] == [group_id(odd)] * 2
    assert [r.attributes["aggregate_id"] for r in got] == [odd, odd]


def test_fair_queue_group_ids_are_off_by_default_and_set_by_flag_env_or_the_sqs_table() -> None:
    url = "https://sqs.us-east-1.amazonaws.com/123456789012/orders"
    by_dest = {o.dest: o for o in SPEC.options}
    assert by_dest["sqs_message_group"].flag == "--sqs-message-group"
    assert by_dest["sqs_message_group"].env == "RELAY_SQS_MESSAGE_GROUP"
    assert (
        SqsSettings.from_values(
            resolve(SPEC.options, cli={"queue_url": url}, file={}, env={}), DEFAULT_LIMITS
        ).message_group
        == "none"
    )
    for cli, file, env in (
        ({"sqs_message_group": "standard"}, {}, {}),
        ({}, {}, {"RELAY_SQS_MESSAGE_GROUP": "standard"}),
        ({}, {"sqs": {"message_group": "standard"}}, {}),
    ):
        values = resolve(SPEC.options, cli={"queue_url": url, **cli}, file=file, env=env)
        assert SqsSettings.from_values(values, DEFAULT_LIMITS).message_group == "standard"
    with pytest.raises(ConfigError, match=r"invalid --sqs-message-group.*choose from none, standard"):
        resolve(SPEC.options, cli={"sqs_message_group": "fair"}, file={}, env={})


async def test_a_standard_queue_gets_the_aggregate_as_message_group_with_message_group_standard(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue(fifo=False)
    faults = Faults()  # records what was sent, besides what moto hands back
    p = await publisher(url, faults=faults, message_group="standard")
    odd = "tenant n° 7"
    assert await p.publish([msg(1, "tenant-a"), msg(2, "tenant-b"), msg(3, odd)]) == [None] * 3
    [sent] = faults.sends()
    assert [e.get("MessageGroupId") for e in sent.params["Entries"]] == ["tenant-a", "tenant-b", group_id(odd)]
    assert all("MessageDeduplicationId" not in e for e in sent.params["Entries"])  # standard queues refuse it
    got = {r.outbox_id: r for r in receive_all(sqs_client, url)}
    assert [got[i].system["MessageGroupId"] for i in (1, 2, 3)] == ["tenant-a", "tenant-b", group_id(odd)]
    assert all("MessageDeduplicationId" not in r.system for r in got.values())


async def test_concurrent_publishes_share_one_client(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue(fifo=False)
    p = await publisher(url)
    batches = [[msg(w * 100 + i, f"a{i}") for i in range(40)] for w in range(4)]
    results = await asyncio.gather(*(p.publish(b) for b in batches))
    assert all(r == [None] * 40 for r in results), results
    assert len(receive_all(sqs_client, url)) == 160


# ---------------------------------------------------------------------------------------
# Ordering guard: the ordered claim never puts two ordered messages of one aggregate in a
# batch; if one ever does, the later waits for the earlier's confirmation.


async def test_second_ordered_message_of_an_aggregate_goes_only_after_the_first_is_confirmed(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue(fifo=True)
    faults = Faults()  # no rules: only records the calls
    p = await publisher(url, faults=faults)
    batch = [msg(1, "a", ordered=True), msg(2, "a", ordered=True), msg(3, "b", ordered=True), msg(4, "a")]
    assert await p.publish(batch) == [None] * 4
    assert [c.entry_ids for c in faults.sends()] == [["1", "3", "4"], ["2"]]
    assert [r.outbox_id for r in receive_all(sqs_client, url) if r.attributes["aggregate_id"] == "a"] == [1, 4, 2]


async def test_ordered_successor_of_an_undelivered_message_is_deferred_unsent(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
) -> None:
    faults = Faults()
    faults.fail_entries({"1": ("InternalError", False)})
    p = await publisher(make_queue(), faults=faults)
    first, second = await p.publish([msg(1, "a", ordered=True), msg(2, "a", ordered=True)])
    assert isinstance(first, RetryableError)
    assert isinstance(second, Defer) and "outbox id 1" in second.reason
    assert all("2" not in c.entry_ids for c in faults.sends())


# ---------------------------------------------------------------------------------------
# Retryable


@pytest.mark.parametrize(
    ("code", "status", "query_code"),
    [
        ("RequestThrottled", 403, "RequestThrottled"),  # a 403 that is not permanent
        ("ThrottlingException", 400, None),
        ("KmsThrottled", 400, "KMS.ThrottlingException"),
        ("OverLimit", 403, "OverLimit"),
        ("InternalError", 500, "InternalError"),
        ("ServiceUnavailable", 503, None),
        ("SomethingSQSInventsLater", 400, None),  # unknown: the attempt limit decides
    ],
)
async def test_throttling_5xx_and_unknown_refusals_are_retryable(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    code: str,
    status: int,
    query_code: str | None,
) -> None:
    faults = Faults()
    faults.error(code, status=status, query_code=query_code)
    p = await publisher(make_queue(), faults=faults)
    outcomes = await p.publish([msg(1), msg(2, "order-2")])
    assert_all(outcomes, RetryableError)
    assert (query_code or code) in str(outcomes[0])


async def test_the_sdk_retries_a_5xx_once_then_hands_over_to_the_relay(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
) -> None:
    faults = Faults()
    faults.error("InternalError", status=500, query_code="InternalError")
    p = await publisher(make_queue(), faults=faults, sdk_attempts=2)
    assert_all(await p.publish([msg(1)]), RetryableError)
    assert len(faults.sends()) == 2


async def test_read_timeout_is_retryable(publisher: MakePublisher) -> None:
    with silent_endpoint() as endpoint:
        p = await publisher(queue_url(endpoint, "q.fifo"), read_timeout_s=0.3)
        outcomes = await p.publish([msg(1)])
    assert_all(outcomes, RetryableError)
    assert "ReadTimeout" in str(outcomes[0])


async def test_connect_timeout_is_retryable(publisher: MakePublisher) -> None:
    with full_backlog_endpoint() as endpoint:
        p = await publisher(queue_url(endpoint, "q.fifo"), connect_timeout_s=0.3)
        outcomes = await p.publish([msg(1)])
    assert_all(outcomes, RetryableError)
    assert "ConnectTimeout" in str(outcomes[0])


async def test_closed_connection_is_retryable(publisher: MakePublisher) -> None:
    with closing_endpoint() as endpoint:
        p = await publisher(queue_url(endpoint, "q.fifo"))
        outcomes = await p.publish([msg(1)])
    assert_all(outcomes, RetryableError)
    assert "ConnectionClosed" in str(outcomes[0])


async def test_failed_entries_are_classified_one_by_one(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
) -> None:
    faults = Faults()
    faults.fail_entries(
        {
            "2": ("InternalError", False),
            "3": ("InvalidParameterValue", True),
            "4": ("SomethingNew", True),
            "5": ("SomethingNew", False),
            "6": ("RequestThrottled", True),  # throttling reported as the sender's fault
            "7": ("KMS.DisabledException", True),
        }
    )
    p = await publisher(make_queue(), faults=faults)
    outcomes = await p.publish([msg(i, f"agg-{i}") for i in range(1, 9)])
    assert outcomes[0] is None and outcomes[7] is None
    assert [type(o) for o in outcomes[1:7]] == [
        RetryableError,
        PermanentError,
        PermanentError,
        RetryableError,
        RetryableError,
        BrokerUnavailable,
    ]
    assert len(faults.sends()) == 1


# ---------------------------------------------------------------------------------------
# Permanent for that message only


async def test_message_too_long_is_permanent_and_never_sent(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue()
    p = await publisher(url)
    big = msg(2, payload={"blob": "x" * 1_048_576})
    outcomes = await p.publish([msg(1), big, msg(3)])
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], PermanentError) and "at most 1048576" in str(outcomes[1])
    assert p.stats.requests == 1
    assert sorted(r.outbox_id for r in receive_all(sqs_client, url)) == [1, 3]


async def test_the_queues_own_maximum_message_size_is_read_at_start(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
) -> None:
    p = await publisher(make_queue(MaximumMessageSize="1024"))
    assert p.max_message_bytes == 1024
    outcomes = await p.publish([msg(1, payload={"blob": "x" * 1100}), msg(2)])
    assert isinstance(outcomes[0], PermanentError) and outcomes[1] is None
    assert p.stats.requests == 1


async def test_message_sqs_finds_too_long_is_isolated_by_splitting(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue()
    p = await publisher(url)  # learns 1 MiB; the queue is then narrowed behind its back
    sqs_client.set_queue_attributes(QueueUrl=url, Attributes={"MaximumMessageSize": "1024"})
    batch = [msg(i, f"agg-{i}") for i in range(1, 7)]
    batch[3] = msg(4, "agg-4", payload={"blob": "x" * 2000})
    outcomes = await p.publish(batch)
    assert isinstance(outcomes[3], PermanentError) and "InvalidParameterValue" in str(outcomes[3])
    assert [o for i, o in enumerate(outcomes) if i != 3] == [None] * 5
    assert p.stats.splits >= 1
    assert sorted(r.outbox_id for r in receive_all(sqs_client, url)) == [1, 2, 3, 5, 6]


async def test_characters_sqs_refuses_are_permanent_and_never_sent(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
) -> None:
    p = await publisher(make_queue())
    outcomes = await p.publish([msg(1, body='{"s": "\uffff"}'.encode()), msg(2, "bad\x01id")])
    assert isinstance(outcomes[0], PermanentError) and "U+FFFF" in str(outcomes[0])
    assert isinstance(outcomes[1], PermanentError) and "attribute aggregate_id" in str(outcomes[1])
    assert p.stats.requests == 0


@pytest.mark.parametrize(
    ("code", "query_code"),
    [
        ("InvalidMessageContents", "InvalidMessageContents"),
        ("InvalidAttributeValue", "InvalidAttributeValue"),  # invalid message attributes
        ("MissingParameter", "MissingParameter"),
        ("InvalidParameterValue", "InvalidParameterValue"),
    ],
)
async def test_content_refusals_are_permanent_for_the_culprit_only(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
    code: str,
    query_code: str,
) -> None:
    url = make_queue()
    faults = Faults()  # any request holding entry 5 is refused as a whole; the rest reach moto
    faults.error(code, query_code=query_code, when=lambda call: "5" in call.entry_ids)
    p = await publisher(url, faults=faults)
    outcomes = await p.publish([msg(i, f"agg-{i}") for i in range(1, 11)])
    assert isinstance(outcomes[4], PermanentError) and code in str(outcomes[4])
    assert [o for i, o in enumerate(outcomes) if i != 4] == [None] * 9
    assert sorted(r.outbox_id for r in receive_all(sqs_client, url)) == [1, 2, 3, 4, 6, 7, 8, 9, 10]


async def test_a_request_botocore_refuses_to_build_is_split_like_a_content_refusal(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
) -> None:
    faults = Faults()
    faults.rules.append(lambda call: ParamValidationError(report="bad entry 2") if "2" in call.entry_ids else None)
    p = await publisher(make_queue(), faults=faults)
    outcomes = await p.publish([msg(1), msg(2, "b"), msg(3, "c")])
    assert [type(o) for o in outcomes] == [type(None), PermanentError, type(None)]


# ---------------------------------------------------------------------------------------
# Broker unavailable: configuration faults concern every message


async def test_missing_queue_is_an_outage_reported_once_and_used_as_soon_as_it_exists(
    publisher: MakePublisher,
    moto_endpoint: str,
    sqs_client: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="relay.adapters.sqs")
    name = unique_queue_name(fifo=True)
    url = queue_url(moto_endpoint, name)
    p = await publisher(url)  # start does not fail for it
    for _ in range(3):
        outcomes = await p.publish([msg(1), msg(2, "b")])
        assert_all(outcomes, BrokerUnavailable)
        assert url in str(outcomes[0]) and "NonExistentQueue" in str(outcomes[0])
    errors = [r for r in caplog.records if r.name == "relay.adapters.sqs" and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and url in errors[0].getMessage()

    sqs_client.create_queue(QueueName=name, Attributes={"FifoQueue": "true"})
    assert await p.publish([msg(1), msg(2, "b")]) == [None, None]
    resumed = [r.getMessage() for r in caplog.records if "available again" in r.getMessage()]
    assert len(resumed) == 1 and url in resumed[0]
    assert sorted(r.outbox_id for r in receive_all(sqs_client, url)) == [1, 2]


@pytest.mark.parametrize(
    ("code", "status", "query_code"),
    [
        ("AccessDeniedException", 403, "AccessDenied"),
        ("KmsDisabled", 400, "KMS.DisabledException"),
        ("KmsNotFound", 400, "KMS.NotFoundException"),
        ("KmsAccessDenied", 400, "KMS.AccessDeniedException"),
        ("KmsInvalidState", 400, "KMS.InvalidStateException"),
        ("UnrecognizedClientException", 400, None),  # credentials revoked after start
        ("QueueDoesNotExist", 400, "AWS.SimpleQueueService.NonExistentQueue"),
    ],
)
async def test_configuration_faults_make_every_message_broker_unavailable(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    code: str,
    status: int,
    query_code: str | None,
) -> None:
    url = make_queue()
    faults = Faults()
    faults.error(code, status=status, query_code=query_code)
    p = await publisher(url, faults=faults)
    outcomes = await p.publish([msg(i, f"agg-{i}") for i in range(1, 13)])
    assert_all(outcomes, BrokerUnavailable)
    assert len(outcomes) == 12 and url in str(outcomes[0])


async def test_refused_connections_are_an_outage(publisher: MakePublisher) -> None:
    endpoint = refused_endpoint()
    p = await publisher(queue_url(endpoint, "q.fifo"))
    outcomes = await p.publish([msg(1), msg(2, "b")])
    assert_all(outcomes, BrokerUnavailable)
    assert "CannotConnect" in str(outcomes[0])


# ---------------------------------------------------------------------------------------
# Requests of the relay's own making that SQS refuses: split and resend


async def test_too_many_entries_are_split_and_resent(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue()
    p = await publisher(url, max_entries=12)  # the relay miscounting SQS's limit of ten
    assert await p.publish([msg(i, f"agg-{i}") for i in range(1, 13)]) == [None] * 12
    assert p.stats.splits == 1 and p.stats.requests == 3
    assert len(receive_all(sqs_client, url)) == 12


async def test_a_request_over_the_size_limit_is_split_and_resent(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue()
    p = await publisher(url, max_request_bytes=4 * 1_048_576)  # four 400 kB messages in one request
    batch = [msg(i, f"agg-{i}", payload={"blob": "x" * 400_000}) for i in range(1, 5)]
    assert await p.publish(batch) == [None] * 4
    assert p.stats.splits >= 1
    assert len(receive_all(sqs_client, url)) == 4


async def test_duplicate_entry_ids_are_split_and_resent(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
    sqs_client: Any,
) -> None:
    url = make_queue()
    p = await publisher(url)
    assert await p.publish([msg(1), msg(2, "b"), msg(1)]) == [None, None, None]
    assert p.stats.splits >= 1
    assert sorted(r.outbox_id for r in receive_all(sqs_client, url)) == [1, 2]


async def test_a_message_too_long_for_any_request_is_permanent(
    publisher: MakePublisher,
    make_queue: Callable[..., str],
) -> None:
    p = await publisher(make_queue(), max_request_bytes=4 * 1_048_576)
    p.max_message_bytes = 4 * 1_048_576  # no local size check: SQS itself refuses the lone entry
    outcomes = await p.publish([msg(1, payload={"blob": "x" * 1_100_000}), msg(2, "b")])
    assert isinstance(outcomes[0], PermanentError) and "BatchRequestTooLong" in str(outcomes[0])
    assert outcomes[1] is None
