"""The SNS publisher against moto over real HTTP: delivery, and every failure class.

What arrives is read from an SQS queue subscribed to the topic with raw message delivery
(:func:`tests.sns_server.make_topic`). moto serves every call except the faults it
cannot produce (throttling, 5xx, KMS, ``AuthorizationError``, ``BatchRequestTooLong``,
entry failures other than a message too long), which :class:`tests.sns_server.SnsFaults`
answers at the botocore layer; network faults come from real sockets.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import boto3
import pytest

from relay.adapters.aws.entries import group_id
from relay.adapters.aws.settings import REGION
from relay.adapters.registry import broker_options
from relay.adapters.sns import SPEC, SnsSettings
from relay.adapters.sns.publisher import SnsPublisher
from relay.adapters.sqs import SPEC as SQS
from relay.contract import DestinationState
from relay.errors import BrokerUnavailable, ConfigError, Defer, PermanentError, RetryableError
from relay.options import resolve
from tests.helpers import DEFAULT_LIMITS
from tests.helpers import outbox_message as msg
from tests.sns_server import SnsFaults, Topic, create_topic, subscribe_queue, topic_arn, unique_topic_name
from tests.sqs_server import (
    closing_endpoint,
    full_backlog_endpoint,
    receive_all,
    refused_endpoint,
    silent_endpoint,
)

MakePublisher = Callable[..., Awaitable[SnsPublisher]]


@pytest.fixture
async def publisher(moto_endpoint: str) -> AsyncIterator[MakePublisher]:
    """``await publisher(arn, faults=None, endpoint=moto, start=True, **settings)``: a
    publisher on its own boto3 session (with the faults' hook), started, closed after the test.

    SDK retries are off (1 attempt) unless a test asks, so each injected fault is seen once
    and no SDK backoff slows the suite. The timeouts are the product's defaults (2 s, 5 s) so
    that a moto slowed by a loaded machine is not a fault; the socket-fault tests pass
    short ones of their own (0.5 s ones failed a concurrent-publish test once in CI).
    """
    made: list[SnsPublisher] = []

    async def make(
        arn: str,
        *,
        faults: SnsFaults | None = None,
        endpoint: str = moto_endpoint,
        start: bool = True,
        **overrides: Any,
    ) -> SnsPublisher:
        fields: dict[str, Any] = {
            "topic_arn": arn,
            "endpoint_url": endpoint,
            "sdk_attempts": 1,
            "connect_timeout_s": 2.0,
            "read_timeout_s": 5.0,
        }
        fields.update(overrides)
        session = boto3.session.Session()
        if faults is not None:
            faults.register(session)
        p = SnsPublisher(SnsSettings(**fields), session=session)
        made.append(p)
        if start:
            await p.start()
        return p

    yield make
    for p in made:
        await p.close()


def assert_all(outcomes: Any, cls: type[BaseException]) -> None:
    assert outcomes and all(isinstance(o, cls) for o in outcomes), outcomes


def received_ids(sqs_client: Any, topic: Topic) -> list[int]:
    return sorted(r.outbox_id for r in receive_all(sqs_client, topic.queue_url))


# ---------------------------------------------------------------------------------------
# Settings


def test_create_without_a_topic_arn_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^no SNS topic: pass --topic-arn"):
        SPEC.create({"topic_arn": None}, DEFAULT_LIMITS)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"topic_arn": "orders"}, "invalid --topic-arn"),
        ({"topic_arn": "arn:aws:sqs:us-east-1:123456789012:orders"}, "invalid --topic-arn"),
        ({"topic_arn": "arn:aws:sns:us-east-1:123456789012:bad name"}, "invalid --topic-arn"),
        ({"topic_arn": "arn:aws:sns:us-east-1:1234:orders"}, "invalid --topic-arn"),
        ({"topic_arn": "arn:aws:sns:us-east-1:123456789012:o\n" + "x" * 10_000}, "invalid --topic-arn"),
        (
            {"topic_arn": "arn:aws:sns:us-east-1:123456789012:orders", "endpoint_url": "localhost:4566"},
            "invalid --endpoint-url",
        ),
        (
            {"topic_arn": "arn:aws:sns:us-east-1:123456789012:orders", "sns_read_timeout": timedelta(0)},
            "--sns-read-timeout",
        ),
    ],
)
def test_unusable_settings_are_one_line_config_errors(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        SPEC.create(values, DEFAULT_LIMITS)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_settings_come_from_flags_relay_env_and_the_toml_sns_table() -> None:
    by_dest = {o.dest: o for o in SPEC.options}
    assert by_dest["topic_arn"].flag == "--topic-arn" and by_dest["topic_arn"].env == "RELAY_TOPIC_ARN"
    values = resolve(
        SPEC.options,
        cli={"endpoint_url": "http://127.0.0.1:4566"},
        file={"sns": {"topic_arn": "arn:aws:sns:eu-west-1:123456789012:orders.fifo", "connect_timeout": "750ms"}},
        env={"RELAY_REGION": "eu-central-1", "RELAY_SNS_SDK_ATTEMPTS": "3"},
    )
    s = SnsSettings.from_values(values, replace(DEFAULT_LIMITS, workers=3, batch_size=100))
    assert s.fifo and s.topic_name == "orders.fifo" and s.region_from_arn() == "eu-west-1"
    assert (s.region, s.endpoint_url) == ("eu-central-1", "http://127.0.0.1:4566")
    assert (s.connect_timeout_s, s.read_timeout_s, s.sdk_attempts) == (0.75, 5.0, 3)
    assert (s.max_message_bytes, s.max_request_bytes, s.max_entries) == (262_144, 262_144, 10)
    assert s.concurrency == 30


def test_region_and_endpoint_are_one_setting_for_sqs_and_sns() -> None:
    assert REGION in SPEC.options and REGION in SQS.options
    flags = [o.flag for o in broker_options()]
    assert flags.count("--region") == flags.count("--endpoint-url") == 1
    assert "--topic-arn" in flags and "--sns-connect-timeout" in flags and "--sqs-connect-timeout" in flags
    for table in ("sqs", "sns"):
        assert resolve(SPEC.options, cli={}, file={table: {"region": "eu-west-3"}}, env={})["region"] == "eu-west-3"
    with pytest.raises(ConfigError, match=r"region in both \[sqs\] and \[sns\]"):
        resolve(SPEC.options, cli={}, file={"sqs": {"region": "a"}, "sns": {"region": "b"}}, env={})


def test_no_region_anywhere_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    # An ARN always names its region, so only a settings object built by hand lacks one.
    settings = replace(SnsSettings(topic_arn="arn:aws:sns:us-east-1:123456789012:t"), topic_arn="not-an-arn")
    with pytest.raises(ConfigError, match="no AWS region for SNS: pass --region"):
        SnsPublisher(settings)


async def test_the_region_comes_from_the_arn_and_sdk_retries_stay_small(make_topic: Callable[..., Topic]) -> None:
    topic = make_topic(fifo=False)
    p = SPEC.create({"topic_arn": topic.arn}, replace(DEFAULT_LIMITS, workers=2, batch_size=50))
    assert p.region == "us-east-1"
    assert p.settings.worst_call_s() < 20  # inside the default --publish-timeout
    config: Any = p.client_config()
    assert config.retries == {"mode": "standard", "total_max_attempts": 2}
    assert (config.connect_timeout, config.read_timeout, config.max_pool_connections) == (2.0, 5.0, 10)


async def test_no_credentials_at_start_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
    publisher: MakePublisher,
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="no AWS credentials for SNS"):
        await publisher(topic_arn("t"))


async def test_credentials_aws_rejects_at_start_are_a_config_error(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
) -> None:
    faults = SnsFaults()
    faults.error("InvalidClientTokenId", status=403, operation="GetTopicAttributes")
    with pytest.raises(ConfigError, match=r"AWS refused the credentials for SNS topic .*InvalidClientTokenId"):
        await publisher(make_topic().arn, faults=faults)


# ---------------------------------------------------------------------------------------
# Delivery


async def test_check_destinations_sees_a_topic_created_later_and_tells_denied(
    publisher: MakePublisher, make_topic: Callable[..., Topic], sns_client: Any
) -> None:
    # (There and missing for every adapter: tests/test_publisher_conformance.py.)
    name = unique_topic_name(fifo=False)
    absent = await publisher(topic_arn(name))
    [check] = await absent.check_destinations()
    assert check.state is DestinationState.MISSING and "NotFound" in check.reason, check
    create_topic(sns_client, name)
    assert [c.state for c in await absent.check_destinations()] == [DestinationState.EXISTS]

    faults = SnsFaults()
    denied = await publisher(make_topic(fifo=False).arn, faults=faults)
    faults.error("AuthorizationError", status=403, operation="GetTopicAttributes")
    [check] = await denied.check_destinations()
    assert check.state is DestinationState.DENIED and not check.known_absent, check


async def test_standard_topic_delivers_the_payload_as_body_and_the_envelope_as_attributes(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic(fifo=False)
    p = await publisher(topic.arn)
    assert not p.fifo
    batch = [msg(i, f"order-{i % 4}", payload={"order": i, "note": "café ☕"}) for i in range(1, 26)]
    assert await p.publish(batch) == [None] * 25
    assert p.stats.requests == 3  # 10 + 10 + 5
    got = sorted(receive_all(sqs_client, topic.queue_url), key=lambda r: r.outbox_id)
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
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic(fifo=True)
    p = await publisher(topic.arn)
    assert await p.publish([msg(1, ordered=True, aggregate_seq=17), msg(2, ordered=False)]) == [None, None]
    answer = sqs_client.receive_message(QueueUrl=topic.queue_url, MaxNumberOfMessages=10, MessageAttributeNames=["All"])
    got = {int(m["MessageAttributes"]["outbox_id"]["StringValue"]): m["MessageAttributes"] for m in answer["Messages"]}
    assert got[1]["aggregate_seq"] == {"DataType": "Number", "StringValue": "17"}
    assert "aggregate_seq" not in got[2]


async def test_fifo_topic_groups_by_aggregate_and_collapses_a_resend_by_outbox_id(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic(fifo=True)
    p = await publisher(topic.arn)
    assert p.fifo
    odd = "commande n° 7"  # a space and a non-ASCII letter: not a group id SNS takes
    batch = [msg(i, f"order-{i % 3}") for i in range(1, 31)] + [msg(31, odd)]
    assert await p.publish(batch) == [None] * 31
    assert await p.publish(batch[:12]) == [None] * 12  # a redelivery: the FIFO queue collapses it
    got = receive_all(sqs_client, topic.queue_url)
    assert sorted(r.outbox_id for r in got) == list(range(1, 32))
    for r in got:
        assert r.system["MessageGroupId"] == group_id(r.attributes["aggregate_id"])
        assert r.system["MessageDeduplicationId"] == r.attributes.get("event_id", str(r.outbox_id))
    assert [r.system["MessageGroupId"] for r in got if r.outbox_id == 31] == [group_id(odd)] != [odd]


async def test_second_ordered_message_of_an_aggregate_goes_only_after_the_first_is_confirmed(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic(fifo=True)
    faults = SnsFaults()  # no rules: only records the calls
    p = await publisher(topic.arn, faults=faults)
    batch = [msg(1, "a", ordered=True), msg(2, "a", ordered=True), msg(3, "b", ordered=True), msg(4, "a")]
    assert await p.publish(batch) == [None] * 4
    assert [c.entry_ids for c in faults.sends()] == [["1", "3", "4"], ["2"]]
    got = receive_all(sqs_client, topic.queue_url)
    assert [r.outbox_id for r in got if r.attributes["aggregate_id"] == "a"] == [1, 4, 2]


async def test_ordered_successor_of_an_undelivered_message_is_deferred_unsent(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
) -> None:
    faults = SnsFaults()
    faults.fail_entries({"1": ("InternalError", False)})
    p = await publisher(make_topic().arn, faults=faults)
    first, second = await p.publish([msg(1, "a", ordered=True), msg(2, "a", ordered=True)])
    assert isinstance(first, RetryableError)
    assert isinstance(second, Defer) and "outbox id 1" in second.reason
    assert all("2" not in c.entry_ids for c in faults.sends())


# ---------------------------------------------------------------------------------------
# Retryable


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("Throttled", 429),
        ("ThrottlingException", 400),
        ("KMSThrottling", 400),
        ("InternalError", 500),
        ("ServiceUnavailable", 503),
        ("SomethingSNSInventsLater", 400),  # unknown: the attempt limit decides
    ],
)
async def test_throttling_5xx_and_unknown_refusals_are_retryable(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    code: str,
    status: int,
) -> None:
    faults = SnsFaults()
    faults.error(code, status=status)
    p = await publisher(make_topic().arn, faults=faults)
    outcomes = await p.publish([msg(1), msg(2, "order-2")])
    assert_all(outcomes, RetryableError)
    assert code in str(outcomes[0])


async def test_the_sdk_retries_a_5xx_once_then_hands_over_to_the_relay(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
) -> None:
    faults = SnsFaults()
    faults.error("InternalError", status=500)
    p = await publisher(make_topic().arn, faults=faults, sdk_attempts=2)
    assert_all(await p.publish([msg(1)]), RetryableError)
    assert len(faults.sends()) == 2


async def test_read_timeout_is_retryable(publisher: MakePublisher) -> None:
    with silent_endpoint() as endpoint:
        p = await publisher(topic_arn("t.fifo"), endpoint=endpoint, read_timeout_s=0.3)
        outcomes = await p.publish([msg(1)])
    assert_all(outcomes, RetryableError)
    assert "ReadTimeout" in str(outcomes[0])


async def test_connect_timeout_is_retryable(publisher: MakePublisher) -> None:
    with full_backlog_endpoint() as endpoint:
        p = await publisher(topic_arn("t.fifo"), endpoint=endpoint, connect_timeout_s=0.3)
        outcomes = await p.publish([msg(1)])
    assert_all(outcomes, RetryableError)
    assert "ConnectTimeout" in str(outcomes[0])


async def test_closed_connection_is_retryable(publisher: MakePublisher) -> None:
    with closing_endpoint() as endpoint:
        p = await publisher(topic_arn("t.fifo"), endpoint=endpoint)
        outcomes = await p.publish([msg(1)])
    assert_all(outcomes, RetryableError)
    assert "ConnectionClosed" in str(outcomes[0])


async def test_failed_entries_are_classified_one_by_one(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
) -> None:
    faults = SnsFaults()
    faults.fail_entries(
        {
            "2": ("InternalError", False),
            "3": ("InvalidParameter", True),
            "4": ("SomethingNew", True),
            "5": ("SomethingNew", False),
            "6": ("Throttled", True),  # throttling reported as the sender's fault
            "7": ("KMSDisabled", True),
        }
    )
    p = await publisher(make_topic().arn, faults=faults)
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
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic()
    p = await publisher(topic.arn)
    big = msg(2, payload={"blob": "x" * 262_144})
    outcomes = await p.publish([msg(1), big, msg(3)])
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], PermanentError) and "the SNS topic takes at most 262144" in str(outcomes[1])
    assert p.stats.requests == 1
    assert received_ids(sqs_client, topic) == [1, 3]


async def test_a_message_sns_itself_finds_too_long_is_permanent_for_it_alone(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic(fifo=False)
    p = await publisher(topic.arn)
    p.max_message_bytes = 1_048_576  # no local size check: moto refuses the entry (SenderFault)
    outcomes = await p.publish([msg(1), msg(2, "b", payload={"blob": "x" * 300_000}), msg(3, "c")])
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], PermanentError) and "InvalidParameter" in str(outcomes[1])
    assert received_ids(sqs_client, topic) == [1, 3]


async def test_characters_sns_refuses_are_permanent_and_never_sent(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
) -> None:
    p = await publisher(make_topic().arn)
    outcomes = await p.publish([msg(1, body='{"s": "\uffff"}'.encode()), msg(2, "bad\x01id"), msg(3, body=b"\xff")])
    assert isinstance(outcomes[0], PermanentError) and "U+FFFF, which SNS" in str(outcomes[0])
    assert isinstance(outcomes[1], PermanentError) and "attribute aggregate_id" in str(outcomes[1])
    assert isinstance(outcomes[2], PermanentError) and "not valid UTF-8" in str(outcomes[2])
    assert p.stats.requests == 0


@pytest.mark.parametrize("code", ["InvalidParameter", "InvalidParameterValue", "ParameterValueInvalid"])
async def test_content_refusals_are_permanent_for_the_culprit_only(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    sqs_client: Any,
    code: str,
) -> None:
    topic = make_topic()
    faults = SnsFaults()  # any request holding entry 5 is refused as a whole; the rest reach moto
    faults.error(code, when=lambda call: "5" in call.entry_ids)
    p = await publisher(topic.arn, faults=faults)
    outcomes = await p.publish([msg(i, f"agg-{i}") for i in range(1, 11)])
    assert isinstance(outcomes[4], PermanentError) and code in str(outcomes[4])
    assert [o for i, o in enumerate(outcomes) if i != 4] == [None] * 9
    assert received_ids(sqs_client, topic) == [1, 2, 3, 4, 6, 7, 8, 9, 10]


# ---------------------------------------------------------------------------------------
# Broker unavailable: configuration faults concern every message


async def test_missing_topic_is_an_outage_reported_once_and_used_as_soon_as_it_exists(
    publisher: MakePublisher,
    sns_client: Any,
    sqs_client: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="relay.adapters.sns")
    name = unique_topic_name(fifo=True)
    arn = topic_arn(name)
    p = await publisher(arn)  # start does not fail for it
    for _ in range(3):
        outcomes = await p.publish([msg(1), msg(2, "b")])
        assert_all(outcomes, BrokerUnavailable)
        assert arn in str(outcomes[0]) and "NotFound" in str(outcomes[0])
    errors = [r for r in caplog.records if r.name == "relay.adapters.sns" and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and arn in errors[0].getMessage()

    create_topic(sns_client, name)
    queue = subscribe_queue(sns_client, sqs_client, arn)
    assert await p.publish([msg(1), msg(2, "b")]) == [None, None]
    resumed = [r.getMessage() for r in caplog.records if "available again" in r.getMessage()]
    assert len(resumed) == 1 and arn in resumed[0]
    assert sorted(r.outbox_id for r in receive_all(sqs_client, queue)) == [1, 2]
    sns_client.delete_topic(TopicArn=arn)
    sqs_client.delete_queue(QueueUrl=queue)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("AuthorizationError", 403),
        ("KMSDisabled", 400),
        ("KMSNotFound", 400),
        ("KMSAccessDenied", 400),
        ("KMSInvalidState", 400),
        ("KMSOptInRequired", 403),
        ("InvalidClientTokenId", 403),  # credentials revoked after start
        ("NotFound", 404),
    ],
)
async def test_configuration_faults_make_every_message_broker_unavailable(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    code: str,
    status: int,
) -> None:
    topic = make_topic()
    faults = SnsFaults()
    faults.error(code, status=status)
    p = await publisher(topic.arn, faults=faults)
    outcomes = await p.publish([msg(i, f"agg-{i}") for i in range(1, 13)])
    assert_all(outcomes, BrokerUnavailable)
    assert len(outcomes) == 12 and topic.arn in str(outcomes[0]) and code in str(outcomes[0])


async def test_access_denied_at_start_is_not_fatal(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic(fifo=True)
    faults = SnsFaults()  # a publish-only role: no sns:GetTopicAttributes
    faults.error("AuthorizationError", status=403, operation="GetTopicAttributes")
    p = await publisher(topic.arn, faults=faults)
    assert p.fifo  # from the ARN
    assert await p.publish([msg(1)]) == [None]
    assert received_ids(sqs_client, topic) == [1]


async def test_refused_connections_are_an_outage(publisher: MakePublisher) -> None:
    p = await publisher(topic_arn("t.fifo"), endpoint=refused_endpoint())
    outcomes = await p.publish([msg(1), msg(2, "b")])
    assert_all(outcomes, BrokerUnavailable)
    assert "CannotConnect" in str(outcomes[0])


# ---------------------------------------------------------------------------------------
# Requests of the relay's own making that SNS refuses: split and resend


async def test_too_many_entries_are_split_and_resent(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic()
    p = await publisher(topic.arn, max_entries=12)  # the relay miscounting SNS's limit of ten
    assert await p.publish([msg(i, f"agg-{i}") for i in range(1, 13)]) == [None] * 12
    assert p.stats.splits == 1 and p.stats.requests == 3
    assert len(receive_all(sqs_client, topic.queue_url)) == 12


async def test_duplicate_entry_ids_are_split_and_resent(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic()
    p = await publisher(topic.arn)
    assert await p.publish([msg(1), msg(2, "b"), msg(1)]) == [None, None, None]
    assert p.stats.splits >= 1
    assert received_ids(sqs_client, topic) == [1, 2]


async def test_a_request_over_the_size_limit_is_split_and_resent(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
    sqs_client: Any,
) -> None:
    topic = make_topic()
    faults = SnsFaults()  # moto does not count a request's bytes; SNS refuses over 256 KiB
    faults.error("BatchRequestTooLong", when=lambda call: len(call.entry_ids) > 1)
    p = await publisher(topic.arn, faults=faults, max_request_bytes=4 * 262_144)
    batch = [msg(i, f"agg-{i}", payload={"blob": "x" * 100_000}) for i in range(1, 5)]
    assert await p.publish(batch) == [None] * 4
    assert p.stats.splits == 3  # 4 -> 2 + 2 -> 1 + 1 + 1 + 1
    assert received_ids(sqs_client, topic) == [1, 2, 3, 4]


async def test_a_message_too_long_for_any_request_is_permanent(
    publisher: MakePublisher,
    make_topic: Callable[..., Topic],
) -> None:
    faults = SnsFaults()
    faults.error("BatchRequestTooLong", when=lambda call: "1" in call.entry_ids)
    p = await publisher(make_topic().arn, faults=faults)
    outcomes = await p.publish([msg(1), msg(2, "b")])
    assert isinstance(outcomes[0], PermanentError) and "BatchRequestTooLong" in str(outcomes[0])
    assert outcomes[1] is None
