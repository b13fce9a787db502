"""The SQS and SNS publishers against moto over real HTTP: delivery, and every failure class.

The two share their publisher (:mod:`relay.adapters.aws`), so each case runs for both
(``aws_kind``, tests/aws_destinations.py), with the fault codes each service speaks where
they differ; a topic's deliveries are read from an SQS queue subscribed to it with raw
message delivery. What one of them does alone (a queue's own size limit, fair-queue group
ids; a publish-only role on a topic) is tested for it alone, at the end of each section.

moto serves every call except the faults it cannot produce (throttling, KMS, 5xx, entry
failures, rejected credentials, SNS's ``BatchRequestTooLong``), which
:class:`tests.sqs_server.Faults` and :class:`tests.sns_server.SnsFaults` answer at the
botocore layer; network faults come from real sockets.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from botocore.exceptions import ParamValidationError

from relay.adapters.aws.entries import group_id
from relay.adapters.aws.settings import REGION
from relay.adapters.registry import broker_options
from relay.adapters.sns import SnsSettings
from relay.adapters.sns.publisher import SnsPublisher
from relay.adapters.sqs import SqsSettings
from relay.contract import DestinationState
from relay.errors import BrokerUnavailable, ConfigError, Defer, PermanentError, RetryableError
from relay.options import resolve
from tests.aws_destinations import KINDS, SNS, SQS, AwsKind, AwsWorld, Destination
from tests.helpers import DEFAULT_LIMITS
from tests.helpers import outbox_message as msg
from tests.sns_server import SnsFaults
from tests.sqs_server import (
    Faults,
    closing_endpoint,
    full_backlog_endpoint,
    receive_all,
    refused_endpoint,
    silent_endpoint,
)


def assert_all(outcomes: Any, cls: type[BaseException]) -> None:
    assert outcomes and all(isinstance(o, cls) for o in outcomes), outcomes


def received_ids(sqs_client: Any, destination: Destination) -> list[int]:
    return sorted(r.outbox_id for r in receive_all(sqs_client, destination.inbox))


def cases(*rows: tuple[Any, ...]) -> list[Any]:
    """Parameters whose first value is the kind, named ``<broker>-<second value>``."""
    return [pytest.param(*row, id=f"{row[0]}-{row[1]}") for row in rows]


# What one destination does alone runs for it alone.
only_sqs = pytest.mark.parametrize("aws_kind", [SQS], ids=str)
only_sns = pytest.mark.parametrize("aws_kind", [SNS], ids=str)


def by_kind(*rows: tuple[Any, ...]) -> list[Any]:
    """Parameters whose first value is the kind, one for each, named by it."""
    return [pytest.param(*row, id=str(row[0])) for row in rows]


# ---------------------------------------------------------------------------------------
# Settings


def test_create_without_a_destination_is_a_config_error(aws_kind: AwsKind) -> None:
    k = aws_kind
    with pytest.raises(ConfigError, match=rf"^no {k.service} {k.noun}: pass {k.flag}"):
        k.create({k.address: None}, DEFAULT_LIMITS)


SQS_URL = "https://sqs.us-east-1.amazonaws.com/1/q"
TOPIC_ARN = "arn:aws:sns:us-east-1:123456789012:orders"


@pytest.mark.parametrize(
    ("aws_kind", "values", "needle"),
    [
        (SQS, {"queue_url": "sqs.us-east-1.amazonaws.com/1/q"}, "invalid --queue-url"),
        (SQS, {"queue_url": "ftp://example.com/1/q"}, "invalid --queue-url"),
        (SQS, {"queue_url": "https://sqs.us-east-1.amazonaws.com/1/bad name"}, "invalid --queue-url"),
        (SQS, {"queue_url": SQS_URL, "endpoint_url": "localhost:4566"}, "invalid --endpoint-url"),
        (SQS, {"queue_url": SQS_URL, "endpoint_url": "http://h:99999"}, "invalid --endpoint-url"),
        (SQS, {"queue_url": SQS_URL, "sqs_read_timeout": timedelta(0)}, "--sqs-read-timeout"),
        (SNS, {"topic_arn": "orders"}, "invalid --topic-arn"),
        (SNS, {"topic_arn": "arn:aws:sqs:us-east-1:123456789012:orders"}, "invalid --topic-arn"),
        (SNS, {"topic_arn": "arn:aws:sns:us-east-1:123456789012:bad name"}, "invalid --topic-arn"),
        (SNS, {"topic_arn": "arn:aws:sns:us-east-1:1234:orders"}, "invalid --topic-arn"),
        (SNS, {"topic_arn": "arn:aws:sns:us-east-1:123456789012:o\n" + "x" * 10_000}, "invalid --topic-arn"),
        (SNS, {"topic_arn": TOPIC_ARN, "endpoint_url": "localhost:4566"}, "invalid --endpoint-url"),
        (SNS, {"topic_arn": TOPIC_ARN, "sns_read_timeout": timedelta(0)}, "--sns-read-timeout"),
    ],
    ids=lambda v: str(v) if isinstance(v, AwsKind) else None,
)
def test_unusable_settings_are_one_line_config_errors(aws_kind: AwsKind, values: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        aws_kind.create(values, DEFAULT_LIMITS)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


@pytest.mark.parametrize(
    ("aws_kind", "address", "region_in_address"),
    by_kind(
        (SQS, "http://127.0.0.1:4566/000000000000/orders.fifo", None),
        (SNS, "arn:aws:sns:eu-west-1:123456789012:orders.fifo", "eu-west-1"),
    ),
)
def test_settings_come_from_flags_relay_env_and_the_toml_table(
    aws_kind: AwsKind, address: str, region_in_address: str | None
) -> None:
    k = aws_kind
    by_dest = {o.dest: o for o in k.options}
    assert by_dest[k.address].flag == k.flag and by_dest[k.address].env == f"RELAY_{k.address.upper()}"
    assert by_dest["endpoint_url"].flag == "--endpoint-url"
    values = resolve(
        k.options,
        cli={"endpoint_url": "http://127.0.0.1:4566"},
        file={k.broker: {k.address: address, "connect_timeout": "750ms"}},
        env={"RELAY_REGION": "eu-central-1", f"RELAY_{k.service}_SDK_ATTEMPTS": "3"},
    )
    s: Any = k.settings.from_values(values, replace(DEFAULT_LIMITS, workers=3, batch_size=100))
    assert getattr(s, k.address) == address and s.fifo
    assert (s.queue_name if k is SQS else s.topic_name) == "orders.fifo"
    region_in = s.region_from_url() if k is SQS else s.region_from_arn()
    assert region_in == region_in_address
    assert (s.region, s.endpoint_url) == ("eu-central-1", "http://127.0.0.1:4566")
    assert (s.connect_timeout_s, s.read_timeout_s, s.sdk_attempts) == (0.75, 5.0, 3)
    assert (s.max_message_bytes, s.max_request_bytes, s.max_entries) == (k.max_message_bytes, k.max_request_bytes, 10)
    assert s.concurrency == 30  # 3 workers x 10 requests of 10 messages


def no_region_sqs() -> object:
    return SQS.create({"queue_url": "http://localhost:9324/000000000000/orders"}, DEFAULT_LIMITS)


def no_region_sns() -> object:
    # An ARN always names its region, so only a settings object built by hand lacks one.
    settings = replace(SnsSettings(topic_arn="arn:aws:sns:us-east-1:123456789012:t"), topic_arn="not-an-arn")
    return SnsPublisher(settings)


@pytest.mark.parametrize(("aws_kind", "build"), by_kind((SQS, no_region_sqs), (SNS, no_region_sns)))
def test_no_region_anywhere_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, aws_kind: AwsKind, build: Callable[[], object]
) -> None:
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match=f"no AWS region for {aws_kind.service}: pass --region"):
        build()


def test_sqs_queue_type_region_and_endpoint_follow_from_the_queue_url() -> None:
    aws = SqsSettings.from_values(
        {"queue_url": "https://sqs.eu-central-1.amazonaws.com/123456789012/orders"}, DEFAULT_LIMITS
    )
    assert (aws.fifo, aws.region_from_url(), aws.endpoint_url) == (False, "eu-central-1", None)
    local = SqsSettings.from_values({"queue_url": "http://localhost:9324/000000000000/orders.fifo"}, DEFAULT_LIMITS)
    assert (local.fifo, local.region_from_url(), local.endpoint_url) == (True, None, "http://localhost:9324")


def test_sqs_fair_queue_group_ids_are_off_by_default_and_set_by_flag_env_or_the_sqs_table() -> None:
    url = "https://sqs.us-east-1.amazonaws.com/123456789012/orders"
    by_dest = {o.dest: o for o in SQS.options}
    assert by_dest["sqs_message_group"].flag == "--sqs-message-group"
    assert by_dest["sqs_message_group"].env == "RELAY_SQS_MESSAGE_GROUP"
    assert (
        SqsSettings.from_values(
            resolve(SQS.options, cli={"queue_url": url}, file={}, env={}), DEFAULT_LIMITS
        ).message_group
        == "none"
    )
    for cli, file, env in (
        ({"sqs_message_group": "standard"}, {}, {}),
        ({}, {}, {"RELAY_SQS_MESSAGE_GROUP": "standard"}),
        ({}, {"sqs": {"message_group": "standard"}}, {}),
    ):
        values = resolve(SQS.options, cli={"queue_url": url, **cli}, file=file, env=env)
        assert SqsSettings.from_values(values, DEFAULT_LIMITS).message_group == "standard"
    with pytest.raises(ConfigError, match=r"invalid --sqs-message-group.*choose from none, standard"):
        resolve(SQS.options, cli={"sqs_message_group": "fair"}, file={}, env={})


def test_region_and_endpoint_are_one_setting_for_sqs_and_sns() -> None:
    assert all(REGION in k.options for k in KINDS)
    flags = [o.flag for o in broker_options()]
    assert flags.count("--region") == flags.count("--endpoint-url") == 1
    assert "--topic-arn" in flags and "--sns-connect-timeout" in flags and "--sqs-connect-timeout" in flags
    for table in ("sqs", "sns"):
        assert resolve(SNS.options, cli={}, file={table: {"region": "eu-west-3"}}, env={})["region"] == "eu-west-3"
    with pytest.raises(ConfigError, match=r"region in both \[sqs\] and \[sns\]"):
        resolve(SNS.options, cli={}, file={"sqs": {"region": "a"}, "sns": {"region": "b"}}, env={})


async def test_the_client_keeps_sdk_retries_small_with_explicit_timeouts(aws: AwsWorld) -> None:
    # The queue URL names moto as its endpoint and SQS is told its region; the ARN names
    # its region and SNS is told the endpoint.
    address = aws.make().address
    values = {aws.kind.address: address, **({"region": "us-east-1"} if aws.kind is SQS else {})}
    if aws.kind is SNS:
        values["endpoint_url"] = aws.endpoint
    p = aws.kind.create(values, replace(DEFAULT_LIMITS, workers=2, batch_size=50))
    assert p.region == "us-east-1"
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
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, aws: AwsWorld
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match=f"no AWS credentials for {aws.kind.service}"):
        await aws.publisher(aws.kind.address_at(aws.endpoint, "orders"))


@pytest.mark.parametrize(
    ("aws_kind", "code", "status", "operation"),
    cases(
        (SQS, "UnrecognizedClientException", 400, "GetQueueAttributes"),
        (SNS, "InvalidClientTokenId", 403, "GetTopicAttributes"),
    ),
)
async def test_credentials_aws_rejects_at_start_are_a_config_error(
    aws: AwsWorld, code: str, status: int, operation: str
) -> None:
    faults = aws.kind.faults()
    faults.error(code, status=status, operation=operation)
    with pytest.raises(ConfigError, match=rf"AWS refused the credentials for {aws.kind.destination} .*{code}"):
        await aws.publisher(aws.make().address, faults=faults)


@pytest.mark.parametrize(
    ("aws_kind", "code", "status", "query_code", "operation"),
    cases(
        (SQS, "AccessDenied", 403, "AccessDenied", "GetQueueAttributes"),
        (SNS, "AuthorizationError", 403, None, "GetTopicAttributes"),
    ),
)
async def test_check_destinations_sees_one_created_later_and_tells_denied_from_unreachable(
    aws: AwsWorld, code: str, status: int, query_code: str | None, operation: str
) -> None:
    # (There and missing for every adapter: tests/test_publisher_conformance.py.)
    name, address = aws.absent(fifo=False)
    absent = await aws.publisher(address)
    [check] = await absent.check_destinations()
    assert check.state is DestinationState.MISSING and aws.kind.missing in check.reason, check
    assert check.known_absent and check.describe().startswith(f"{aws.kind.destination} {address} missing: ")
    aws.create(name)
    assert [c.state for c in await absent.check_destinations()] == [DestinationState.EXISTS]

    # Credentials that may send but not read attributes: not known absent (sending may work).
    faults = aws.kind.faults()
    denied = await aws.publisher(aws.make(fifo=False).address, faults=faults)
    faults.error(code, status=status, query_code=query_code, operation=operation)
    [check] = await denied.check_destinations()
    assert check.state is DestinationState.DENIED and not check.known_absent, check

    with silent_endpoint() as endpoint:
        silent = await aws.publisher_at(endpoint, read_timeout_s=0.3, connect_timeout_s=0.3)
        [check] = await silent.check_destinations()
    assert check.state is DestinationState.UNREACHABLE and check.known_absent, check


# ---------------------------------------------------------------------------------------
# Delivery


async def test_a_standard_destination_gets_the_payload_as_body_and_the_envelope_as_attributes(
    aws: AwsWorld, sqs_client: Any
) -> None:
    destination = aws.make(fifo=False)
    p = await aws.publisher(destination.address)
    assert not p.fifo
    batch = [msg(i, f"order-{i % 4}", payload={"order": i, "note": "café ☕"}) for i in range(1, 26)]
    assert await p.publish(batch) == [None] * 25
    assert p.stats.requests == 3  # 10 + 10 + 5
    got = sorted(receive_all(sqs_client, destination.inbox), key=lambda r: r.outbox_id)
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


async def test_ordered_messages_carry_their_aggregate_seq_as_a_number_attribute(aws: AwsWorld, sqs_client: Any) -> None:
    destination = aws.make(fifo=True)
    p = await aws.publisher(destination.address)
    assert await p.publish([msg(1, ordered=True, aggregate_seq=17), msg(2, ordered=False)]) == [None, None]
    answer = sqs_client.receive_message(
        QueueUrl=destination.inbox, MaxNumberOfMessages=10, MessageAttributeNames=["All"]
    )
    got = {int(m["MessageAttributes"]["outbox_id"]["StringValue"]): m["MessageAttributes"] for m in answer["Messages"]}
    assert got[1]["aggregate_seq"] == {"DataType": "Number", "StringValue": "17"}
    assert "aggregate_seq" not in got[2]


async def test_fifo_groups_by_aggregate_and_collapses_a_resend_by_outbox_id(aws: AwsWorld, sqs_client: Any) -> None:
    destination = aws.make(fifo=True)
    p = await aws.publisher(destination.address)
    assert p.fifo
    odd = "commande n° 7"  # a space and a non-ASCII letter: not a group id the services take
    batch = [msg(i, f"order-{i % 3}") for i in range(1, 31)] + [msg(31, odd)]
    assert await p.publish(batch) == [None] * 31
    assert await p.publish(batch[:12]) == [None] * 12  # a redelivery: the FIFO queue collapses it
    got = receive_all(sqs_client, destination.inbox)
    assert sorted(r.outbox_id for r in got) == list(range(1, 32))
    for r in got:
        assert r.system["MessageGroupId"] == group_id(r.attributes["aggregate_id"])
        assert r.system["MessageDeduplicationId"] == r.attributes.get("event_id", str(r.outbox_id))
    assert [r.system["MessageGroupId"] for r in got if r.outbox_id == 31] == [group_id(odd)] != [odd]
    # (These messages are unordered, so their requests went out concurrently and their
    # order within a group is not promised; ordered ones are never in flight together.)


async def test_aggregate_ids_refused_as_group_ids_get_a_stable_digest(aws: AwsWorld, sqs_client: Any) -> None:
    odd = "commande n° 7"  # a space and a non-ASCII letter
    assert group_id(odd) == group_id(odd) != odd and group_id("order-7") == "order-7"
    destination = aws.make(fifo=True)
    p = await aws.publisher(destination.address)
    assert await p.publish([msg(1, odd), msg(2, odd)]) == [None, None]
    got = receive_all(sqs_client, destination.inbox)
    assert [r.system["MessageGroupId"] for r in got] == [group_id(odd)] * 2
    assert [r.attributes["aggregate_id"] for r in got] == [odd, odd]


@only_sqs
async def test_sqs_standard_queue_gets_the_aggregate_as_message_group_with_message_group_standard(
    aws: AwsWorld, sqs_client: Any
) -> None:
    url = aws.make(fifo=False).address
    faults = Faults()  # records what was sent, besides what moto hands back
    p = await aws.publisher(url, faults=faults, message_group="standard")
    odd = "tenant n° 7"
    assert await p.publish([msg(1, "tenant-a"), msg(2, "tenant-b"), msg(3, odd)]) == [None] * 3
    [sent] = faults.sends()
    assert [e.get("MessageGroupId") for e in sent.params["Entries"]] == ["tenant-a", "tenant-b", group_id(odd)]
    assert all("MessageDeduplicationId" not in e for e in sent.params["Entries"])  # standard queues refuse it
    got = {r.outbox_id: r for r in receive_all(sqs_client, url)}
    assert [got[i].system["MessageGroupId"] for i in (1, 2, 3)] == ["tenant-a", "tenant-b", group_id(odd)]
    assert all("MessageDeduplicationId" not in r.system for r in got.values())


@only_sqs
async def test_sqs_concurrent_publishes_share_one_client(aws: AwsWorld, sqs_client: Any) -> None:
    url = aws.make(fifo=False).address
    p = await aws.publisher(url)
    batches = [[msg(w * 100 + i, f"a{i}") for i in range(40)] for w in range(4)]
    results = await asyncio.gather(*(p.publish(b) for b in batches))
    assert all(r == [None] * 40 for r in results), results
    assert len(receive_all(sqs_client, url)) == 160


# ---------------------------------------------------------------------------------------
# Ordering guard: the ordered claim never puts two ordered messages of one aggregate in a
# batch; if one ever does, the later waits for the earlier's confirmation.


async def test_second_ordered_message_of_an_aggregate_goes_only_after_the_first_is_confirmed(
    aws: AwsWorld, sqs_client: Any
) -> None:
    destination = aws.make(fifo=True)
    faults = aws.kind.faults()  # no rules: only records the calls
    p = await aws.publisher(destination.address, faults=faults)
    batch = [msg(1, "a", ordered=True), msg(2, "a", ordered=True), msg(3, "b", ordered=True), msg(4, "a")]
    assert await p.publish(batch) == [None] * 4
    assert [c.entry_ids for c in faults.sends()] == [["1", "3", "4"], ["2"]]
    got = receive_all(sqs_client, destination.inbox)
    assert [r.outbox_id for r in got if r.attributes["aggregate_id"] == "a"] == [1, 4, 2]


async def test_ordered_successor_of_an_undelivered_message_is_deferred_unsent(aws: AwsWorld) -> None:
    faults = aws.kind.faults()
    faults.fail_entries({"1": ("InternalError", False)})
    p = await aws.publisher(aws.make().address, faults=faults)
    first, second = await p.publish([msg(1, "a", ordered=True), msg(2, "a", ordered=True)])
    assert isinstance(first, RetryableError)
    assert isinstance(second, Defer) and "outbox id 1" in second.reason
    assert all("2" not in c.entry_ids for c in faults.sends())


# ---------------------------------------------------------------------------------------
# Retryable


@pytest.mark.parametrize(
    ("aws_kind", "code", "status", "query_code"),
    cases(
        (SQS, "RequestThrottled", 403, "RequestThrottled"),  # a 403 that is not permanent
        (SQS, "ThrottlingException", 400, None),
        (SQS, "KmsThrottled", 400, "KMS.ThrottlingException"),
        (SQS, "OverLimit", 403, "OverLimit"),
        (SQS, "InternalError", 500, "InternalError"),
        (SQS, "ServiceUnavailable", 503, None),
        (SQS, "SomethingSQSInventsLater", 400, None),  # unknown: the attempt limit decides
        (SNS, "Throttled", 429, None),
        (SNS, "ThrottlingException", 400, None),
        (SNS, "KMSThrottling", 400, None),
        (SNS, "InternalError", 500, None),
        (SNS, "ServiceUnavailable", 503, None),
        (SNS, "SomethingSNSInventsLater", 400, None),  # unknown: the attempt limit decides
    ),
)
async def test_throttling_5xx_and_unknown_refusals_are_retryable(
    aws: AwsWorld, code: str, status: int, query_code: str | None
) -> None:
    faults = aws.kind.faults()
    faults.error(code, status=status, query_code=query_code)
    p = await aws.publisher(aws.make().address, faults=faults)
    outcomes = await p.publish([msg(1), msg(2, "order-2")])
    assert_all(outcomes, RetryableError)
    assert (query_code or code) in str(outcomes[0])


async def test_the_sdk_retries_a_5xx_once_then_hands_over_to_the_relay(aws: AwsWorld) -> None:
    faults = aws.kind.faults()
    faults.error("InternalError", status=500, query_code="InternalError")
    p = await aws.publisher(aws.make().address, faults=faults, sdk_attempts=2)
    assert_all(await p.publish([msg(1)]), RetryableError)
    assert len(faults.sends()) == 2


async def test_read_timeout_is_retryable(aws: AwsWorld) -> None:
    with silent_endpoint() as endpoint:
        p = await aws.publisher_at(endpoint, read_timeout_s=0.3)
        outcomes = await p.publish([msg(1)])
    assert_all(outcomes, RetryableError)
    assert "ReadTimeout" in str(outcomes[0])


async def test_connect_timeout_is_retryable(aws: AwsWorld) -> None:
    with full_backlog_endpoint() as endpoint:
        p = await aws.publisher_at(endpoint, connect_timeout_s=0.3)
        outcomes = await p.publish([msg(1)])
    assert_all(outcomes, RetryableError)
    assert "ConnectTimeout" in str(outcomes[0])


async def test_closed_connection_is_retryable(aws: AwsWorld) -> None:
    with closing_endpoint() as endpoint:
        p = await aws.publisher_at(endpoint)
        outcomes = await p.publish([msg(1)])
    assert_all(outcomes, RetryableError)
    assert "ConnectionClosed" in str(outcomes[0])


@pytest.mark.parametrize(
    ("aws_kind", "invalid", "throttled", "kms_disabled"),
    by_kind(
        (SQS, "InvalidParameterValue", "RequestThrottled", "KMS.DisabledException"),
        (SNS, "InvalidParameter", "Throttled", "KMSDisabled"),
    ),
)
async def test_failed_entries_are_classified_one_by_one(
    aws: AwsWorld, invalid: str, throttled: str, kms_disabled: str
) -> None:
    faults = aws.kind.faults()
    faults.fail_entries(
        {
            "2": ("InternalError", False),
            "3": (invalid, True),
            "4": ("SomethingNew", True),
            "5": ("SomethingNew", False),
            "6": (throttled, True),  # throttling reported as the sender's fault
            "7": (kms_disabled, True),
        }
    )
    p = await aws.publisher(aws.make().address, faults=faults)
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


async def test_message_too_long_is_permanent_and_never_sent(aws: AwsWorld, sqs_client: Any) -> None:
    destination = aws.make()
    p = await aws.publisher(destination.address)
    limit = aws.kind.max_message_bytes
    big = msg(2, payload={"blob": "x" * limit})
    outcomes = await p.publish([msg(1), big, msg(3)])
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], PermanentError)
    assert f"the {aws.kind.destination} takes at most {limit}" in str(outcomes[1])
    assert p.stats.requests == 1
    assert received_ids(sqs_client, destination) == [1, 3]


async def test_characters_the_service_refuses_are_permanent_and_never_sent(aws: AwsWorld) -> None:
    p = await aws.publisher(aws.make().address)
    outcomes = await p.publish([msg(1, body='{"s": "\uffff"}'.encode()), msg(2, "bad\x01id"), msg(3, body=b"\xff")])
    assert isinstance(outcomes[0], PermanentError) and f"U+FFFF, which {aws.kind.service}" in str(outcomes[0])
    assert isinstance(outcomes[1], PermanentError) and "attribute aggregate_id" in str(outcomes[1])
    assert isinstance(outcomes[2], PermanentError) and "not valid UTF-8" in str(outcomes[2])
    assert p.stats.requests == 0


@pytest.mark.parametrize(
    ("aws_kind", "code", "query_code"),
    cases(
        (SQS, "InvalidMessageContents", "InvalidMessageContents"),
        (SQS, "InvalidAttributeValue", "InvalidAttributeValue"),  # invalid message attributes
        (SQS, "MissingParameter", "MissingParameter"),
        (SQS, "InvalidParameterValue", "InvalidParameterValue"),
        (SNS, "InvalidParameter", None),
        (SNS, "InvalidParameterValue", None),
        (SNS, "ParameterValueInvalid", None),
    ),
)
async def test_content_refusals_are_permanent_for_the_culprit_only(
    aws: AwsWorld, sqs_client: Any, code: str, query_code: str | None
) -> None:
    destination = aws.make()
    faults = aws.kind.faults()  # any request holding entry 5 is refused as a whole; the rest reach moto
    faults.error(code, query_code=query_code, when=lambda call: "5" in call.entry_ids)
    p = await aws.publisher(destination.address, faults=faults)
    outcomes = await p.publish([msg(i, f"agg-{i}") for i in range(1, 11)])
    assert isinstance(outcomes[4], PermanentError) and code in str(outcomes[4])
    assert [o for i, o in enumerate(outcomes) if i != 4] == [None] * 9
    assert received_ids(sqs_client, destination) == [1, 2, 3, 4, 6, 7, 8, 9, 10]


@only_sqs
async def test_sqs_the_queues_own_maximum_message_size_is_read_at_start(
    aws: AwsWorld, make_queue: Callable[..., str]
) -> None:
    p = await aws.publisher(make_queue(MaximumMessageSize="1024"))
    assert p.max_message_bytes == 1024
    outcomes = await p.publish([msg(1, payload={"blob": "x" * 1100}), msg(2)])
    assert isinstance(outcomes[0], PermanentError) and outcomes[1] is None
    assert p.stats.requests == 1


@only_sqs
async def test_sqs_a_message_the_queue_finds_too_long_is_isolated_by_splitting(aws: AwsWorld, sqs_client: Any) -> None:
    url = aws.make().address
    p = await aws.publisher(url)  # learns 1 MiB; the queue is then narrowed behind its back
    sqs_client.set_queue_attributes(QueueUrl=url, Attributes={"MaximumMessageSize": "1024"})
    batch = [msg(i, f"agg-{i}") for i in range(1, 7)]
    batch[3] = msg(4, "agg-4", payload={"blob": "x" * 2000})
    outcomes = await p.publish(batch)
    assert isinstance(outcomes[3], PermanentError) and "InvalidParameterValue" in str(outcomes[3])
    assert [o for i, o in enumerate(outcomes) if i != 3] == [None] * 5
    assert p.stats.splits >= 1
    assert sorted(r.outbox_id for r in receive_all(sqs_client, url)) == [1, 2, 3, 5, 6]


@only_sns
async def test_sns_a_message_the_topic_itself_finds_too_long_is_permanent_for_it_alone(
    aws: AwsWorld, sqs_client: Any
) -> None:
    topic = aws.make(fifo=False)
    p = await aws.publisher(topic.address)
    p.max_message_bytes = 1_048_576  # no local size check: moto refuses the entry (SenderFault)
    outcomes = await p.publish([msg(1), msg(2, "b", payload={"blob": "x" * 300_000}), msg(3, "c")])
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], PermanentError) and "InvalidParameter" in str(outcomes[1])
    assert received_ids(sqs_client, topic) == [1, 3]


@only_sqs
async def test_sqs_a_request_botocore_refuses_to_build_is_split_like_a_content_refusal(aws: AwsWorld) -> None:
    faults = Faults()
    faults.rules.append(lambda call: ParamValidationError(report="bad entry 2") if "2" in call.entry_ids else None)
    p = await aws.publisher(aws.make().address, faults=faults)
    outcomes = await p.publish([msg(1), msg(2, "b"), msg(3, "c")])
    assert [type(o) for o in outcomes] == [type(None), PermanentError, type(None)]


# ---------------------------------------------------------------------------------------
# Broker unavailable: configuration faults concern every message


async def test_a_missing_destination_is_an_outage_reported_once_and_used_as_soon_as_it_exists(
    aws: AwsWorld, sqs_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    logger = f"relay.adapters.{aws.kind.broker}"
    caplog.set_level(logging.INFO, logger=logger)
    name, address = aws.absent(fifo=True)
    p = await aws.publisher(address)  # start does not fail for it
    for _ in range(3):
        outcomes = await p.publish([msg(1), msg(2, "b")])
        assert_all(outcomes, BrokerUnavailable)
        assert address in str(outcomes[0]) and aws.kind.missing in str(outcomes[0])
    errors = [r for r in caplog.records if r.name == logger and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and address in errors[0].getMessage()

    created = aws.create(name)
    assert await p.publish([msg(1), msg(2, "b")]) == [None, None]
    resumed = [r.getMessage() for r in caplog.records if "available again" in r.getMessage()]
    assert len(resumed) == 1 and address in resumed[0]
    assert received_ids(sqs_client, created) == [1, 2]


@pytest.mark.parametrize(
    ("aws_kind", "code", "status", "query_code", "says"),
    cases(
        (SQS, "AccessDeniedException", 403, "AccessDenied", "AccessDenied"),
        (SQS, "KmsDisabled", 400, "KMS.DisabledException", "KMS.DisabledException"),
        (SQS, "KmsNotFound", 400, "KMS.NotFoundException", "KMS.NotFoundException"),
        (SQS, "KmsAccessDenied", 400, "KMS.AccessDeniedException", "KMS.AccessDeniedException"),
        (SQS, "KmsInvalidState", 400, "KMS.InvalidStateException", "KMS.InvalidStateException"),
        (SQS, "UnrecognizedClientException", 400, None, "UnrecognizedClientException"),  # revoked after start
        (SQS, "QueueDoesNotExist", 400, "AWS.SimpleQueueService.NonExistentQueue", "NonExistentQueue"),
        (SNS, "AuthorizationError", 403, None, "AuthorizationError"),
        (SNS, "KMSDisabled", 400, None, "KMSDisabled"),
        (SNS, "KMSNotFound", 400, None, "KMSNotFound"),
        (SNS, "KMSAccessDenied", 400, None, "KMSAccessDenied"),
        (SNS, "KMSInvalidState", 400, None, "KMSInvalidState"),
        (SNS, "KMSOptInRequired", 403, None, "KMSOptInRequired"),
        (SNS, "InvalidClientTokenId", 403, None, "InvalidClientTokenId"),  # credentials revoked after start
        (SNS, "NotFound", 404, None, "NotFound"),
    ),
)
async def test_configuration_faults_make_every_message_broker_unavailable(
    aws: AwsWorld, code: str, status: int, query_code: str | None, says: str
) -> None:
    address = aws.make().address
    faults = aws.kind.faults()
    faults.error(code, status=status, query_code=query_code)
    p = await aws.publisher(address, faults=faults)
    outcomes = await p.publish([msg(i, f"agg-{i}") for i in range(1, 13)])
    assert_all(outcomes, BrokerUnavailable)
    assert len(outcomes) == 12 and address in str(outcomes[0]) and says in str(outcomes[0])


async def test_refused_connections_are_an_outage(aws: AwsWorld) -> None:
    p = await aws.publisher_at(refused_endpoint())
    outcomes = await p.publish([msg(1), msg(2, "b")])
    assert_all(outcomes, BrokerUnavailable)
    assert "CannotConnect" in str(outcomes[0])


@only_sns
async def test_sns_access_denied_at_start_is_not_fatal(aws: AwsWorld, sqs_client: Any) -> None:
    topic = aws.make(fifo=True)
    faults = SnsFaults()  # a publish-only role: no sns:GetTopicAttributes
    faults.error("AuthorizationError", status=403, operation="GetTopicAttributes")
    p = await aws.publisher(topic.address, faults=faults)
    assert p.fifo  # from the ARN
    assert await p.publish([msg(1)]) == [None]
    assert received_ids(sqs_client, topic) == [1]


# ---------------------------------------------------------------------------------------
# Requests of the relay's own making that the service refuses: split and resend


async def test_too_many_entries_are_split_and_resent(aws: AwsWorld, sqs_client: Any) -> None:
    destination = aws.make()
    p = await aws.publisher(destination.address, max_entries=12)  # the relay miscounting the limit of ten
    assert await p.publish([msg(i, f"agg-{i}") for i in range(1, 13)]) == [None] * 12
    assert p.stats.splits == 1 and p.stats.requests == 3
    assert len(receive_all(sqs_client, destination.inbox)) == 12


async def test_duplicate_entry_ids_are_split_and_resent(aws: AwsWorld, sqs_client: Any) -> None:
    destination = aws.make()
    p = await aws.publisher(destination.address)
    assert await p.publish([msg(1), msg(2, "b"), msg(1)]) == [None, None, None]
    assert p.stats.splits >= 1
    assert received_ids(sqs_client, destination) == [1, 2]


# A request over the size limit, and a message too long for any request: SQS refuses them
# itself (moto counts a request's bytes), SNS's refusal is injected (moto does not).


@only_sqs
async def test_sqs_a_request_over_the_size_limit_is_split_and_resent(aws: AwsWorld, sqs_client: Any) -> None:
    url = aws.make().address
    p = await aws.publisher(url, max_request_bytes=4 * 1_048_576)  # four 400 kB messages in one request
    batch = [msg(i, f"agg-{i}", payload={"blob": "x" * 400_000}) for i in range(1, 5)]
    assert await p.publish(batch) == [None] * 4
    assert p.stats.splits >= 1
    assert len(receive_all(sqs_client, url)) == 4


@only_sns
async def test_sns_a_request_over_the_size_limit_is_split_and_resent(aws: AwsWorld, sqs_client: Any) -> None:
    topic = aws.make()
    faults = SnsFaults()  # moto does not count a request's bytes; SNS refuses over 256 KiB
    faults.error("BatchRequestTooLong", when=lambda call: len(call.entry_ids) > 1)
    p = await aws.publisher(topic.address, faults=faults, max_request_bytes=4 * 262_144)
    batch = [msg(i, f"agg-{i}", payload={"blob": "x" * 100_000}) for i in range(1, 5)]
    assert await p.publish(batch) == [None] * 4
    assert p.stats.splits == 3  # 4 -> 2 + 2 -> 1 + 1 + 1 + 1
    assert received_ids(sqs_client, topic) == [1, 2, 3, 4]


@only_sqs
async def test_sqs_a_message_too_long_for_any_request_is_permanent(aws: AwsWorld) -> None:
    p = await aws.publisher(aws.make().address, max_request_bytes=4 * 1_048_576)
    p.max_message_bytes = 4 * 1_048_576  # no local size check: SQS itself refuses the lone entry
    outcomes = await p.publish([msg(1, payload={"blob": "x" * 1_100_000}), msg(2, "b")])
    assert isinstance(outcomes[0], PermanentError) and "BatchRequestTooLong" in str(outcomes[0])
    assert outcomes[1] is None


@only_sns
async def test_sns_a_message_too_long_for_any_request_is_permanent(aws: AwsWorld) -> None:
    faults = SnsFaults()
    faults.error("BatchRequestTooLong", when=lambda call: "1" in call.entry_ids)
    p = await aws.publisher(aws.make().address, faults=faults)
    outcomes = await p.publish([msg(1), msg(2, "b")])
    assert isinstance(outcomes[0], PermanentError) and "BatchRequestTooLong" in str(outcomes[0])
    assert outcomes[1] is None
