"""The SQS broker's options, and the settings checked and derived from them.

This module imports neither boto3 nor botocore: the CLI reads every broker's options at
start-up, and a relay that delivers to RabbitMQ should not pay for loading the AWS SDK.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from relay.contract import PublishLimits
from relay.dsn import describe_url, register_secret
from relay.errors import ConfigError
from relay.options import Option

# SendMessageBatch takes at most ten entries: an SQS limit, not a tuning knob.
MAX_BATCH_ENTRIES = 10
# SQS's ceiling for one message (body plus message attributes) and for the sum of the
# messages of one SendMessageBatch request; both were raised from 256 KiB to 1 MiB in
# 2025. A queue's own MaximumMessageSize may be lower: it is read at start when the
# credentials allow GetQueueAttributes, and SQS's refusal is classified anyway.
SQS_MAX_MESSAGE_BYTES = 1_048_576
SQS_MAX_REQUEST_BYTES = 1_048_576
# Each in-flight SendMessageBatch call holds one thread and one pooled HTTP connection.
# Past about 64 concurrent calls one Python process is bound by the GIL, not by SQS.
MAX_CONCURRENCY = 64

# A queue name: letters, digits, '-' and '_', at most 80 characters with '.fifo' counted.
_QUEUE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,75}(\.fifo)?$|^[A-Za-z0-9_-]{1,80}$")
# sqs.<region>.amazonaws.com (also sqs-fips.<region>...), and the legacy <region>.queue.amazonaws.com.
_REGION_IN_HOST = (
    re.compile(r"^sqs(?:-fips)?\.([a-z]{2}(?:-[a-z]+)+-\d+)\."),
    re.compile(r"^([a-z]{2}(?:-[a-z]+)+-\d+)\.queue\."),
)
_AWS_HOST_SUFFIXES = (".amazonaws.com", ".amazonaws.com.cn", ".api.aws")


OPTIONS: tuple[Option, ...] = (
    Option(
        "queue_url",
        "str",
        None,
        "SQS queue URL; a name ending in .fifo means a FIFO queue.",
        section="sqs",
    ),
    Option(
        "region",
        "str",
        None,
        "AWS region of the queue. Default: from the queue URL, else the AWS config chain.",
        section="sqs",
    ),
    Option(
        "endpoint_url",
        "str",
        None,
        "SQS-compatible endpoint such as http://127.0.0.1:4566. Default: AWS's endpoint for the"
        " region, or the queue URL's own host when that is not an AWS host.",
        section="sqs",
    ),
    Option(
        "sqs_connect_timeout",
        "duration",
        # A TCP and TLS handshake with SQS takes tens of milliseconds; 2 s allows for a slow
        # network without letting a black-holed endpoint eat the publish deadline.
        "2s",
        "How long one SQS call may take to connect.",
        section="sqs",
        key="connect_timeout",
        # Seconds, as every duration bound is. Under 10 ms no call completes; past a minute
        # (connect) or five (read) a call would outlast any sensible --publish-timeout.
        minimum=0.01,
        maximum=60,
    ),
    Option(
        "sqs_read_timeout",
        "duration",
        # SendMessageBatch answers in tens of milliseconds. With the defaults a call's worst
        # case is 2 attempts x (2 s + 5 s) + at most 1 s of SDK backoff = 15 s, inside the
        # default 20 s --publish-timeout, so the relay's deadline rarely has to cut a call off.
        "5s",
        "How long one SQS call may wait for the response.",
        section="sqs",
        key="read_timeout",
        minimum=0.01,
        maximum=300,
    ),
    Option(
        "sqs_sdk_attempts",
        "int",
        # One quick SDK retry absorbs a dropped pooled connection or a single 5xx without
        # spending a relay attempt; anything longer is the relay's backoff's job, which
        # counts attempts and spreads retries across workers with jitter.
        2,
        "Attempts the AWS SDK makes per call (1 = no SDK retry) before the relay's backoff takes over.",
        section="sqs",
        key="sdk_attempts",
        minimum=1,
        maximum=5,
    ),
    Option(
        "sqs_max_message_size",
        "int",
        SQS_MAX_MESSAGE_BYTES,
        "Largest message (body plus attributes, bytes) to send; larger ones go to dead unsent."
        " The queue's MaximumMessageSize lowers it when readable.",
        section="sqs",
        key="max_message_size",
        minimum=1024,
        maximum=SQS_MAX_MESSAGE_BYTES,
    ),
)


@dataclass(frozen=True)
class SqsSettings:
    """Everything the SQS publisher needs, checked. Build it with :meth:`from_values`.

    ``max_entries`` and ``max_request_bytes`` are SQS limits; they are fields only so that
    tests can make the relay build requests SQS refuses (the split-and-resend path).
    """

    queue_url: str
    region: str | None = None
    endpoint_url: str | None = None
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 5.0
    sdk_attempts: int = 2
    max_message_bytes: int = SQS_MAX_MESSAGE_BYTES
    max_request_bytes: int = SQS_MAX_REQUEST_BYTES
    max_entries: int = MAX_BATCH_ENTRIES
    concurrency: int = 16

    @property
    def queue_name(self) -> str:
        return urlsplit(self.queue_url).path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def fifo(self) -> bool:
        """SQS requires FIFO queue names to end in ``.fifo``, so the URL alone decides."""
        return self.queue_name.endswith(".fifo")

    def region_from_url(self) -> str | None:
        """The region written in an AWS queue URL's host (``sqs.eu-west-1.amazonaws.com``)."""
        host = urlsplit(self.queue_url).hostname or ""
        for pattern in _REGION_IN_HOST:
            found = pattern.match(host)
            if found:
                return found.group(1)
        return None

    def worst_call_s(self) -> float:
        """Longest one SDK call can take: every attempt times out, with SDK backoff between.

        botocore's standard mode waits at most ``2**(n-1)`` s before its n-th retry of a
        throttled call (1 s before the first).
        """
        backoff = sum(2.0 ** (n - 1) for n in range(1, self.sdk_attempts))
        return self.sdk_attempts * (self.connect_timeout_s + self.read_timeout_s) + backoff

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> SqsSettings:
        """Check resolved option values (see :func:`relay.options.resolve`).

        Raises :class:`relay.ConfigError` for what no retry can fix: no queue URL, a queue
        URL or endpoint that is not an http(s) URL, a zero timeout.
        """
        # Credentials from the environment (where a deployment usually puts them) are
        # masked literally in every log line and error, should an SDK message quote them.
        # The SDK's other sources (files, instance roles) never pass through the relay's text.
        for variable in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            register_secret(os.environ.get(variable, ""))
        queue_url = (values.get("queue_url") or "").strip()
        if not queue_url:
            raise ConfigError(
                "no SQS queue: pass --queue-url, set RELAY_QUEUE_URL, or put queue_url in the [sqs]"
                " table of the config file"
            )
        _check_queue_url(queue_url)
        endpoint = (values.get("endpoint_url") or "").strip() or None
        if endpoint is not None:
            _check_http_url(endpoint, "--endpoint-url", "an http(s) URL such as http://127.0.0.1:4566")
        else:
            endpoint = _endpoint_from_queue_url(queue_url)
        region = (values.get("region") or "").strip() or None
        connect = _seconds(values.get("sqs_connect_timeout"), "--sqs-connect-timeout", 2.0)
        read = _seconds(values.get("sqs_read_timeout"), "--sqs-read-timeout", 5.0)
        return cls(
            queue_url=queue_url,
            region=region,
            endpoint_url=endpoint,
            connect_timeout_s=connect,
            read_timeout_s=read,
            sdk_attempts=int(values.get("sqs_sdk_attempts") or 2),
            max_message_bytes=int(values.get("sqs_max_message_size") or SQS_MAX_MESSAGE_BYTES),
            concurrency=concurrency_for(limits.workers, limits.batch_size),
        )


def concurrency_for(workers: int, batch_size: int) -> int:
    """Threads (and pooled connections) for SQS calls: every worker's whole batch in flight
    at once, ten messages a call, within :data:`MAX_CONCURRENCY`."""
    return max(4, min(MAX_CONCURRENCY, workers * math.ceil(batch_size / MAX_BATCH_ENTRIES)))


def _seconds(value: Any, name: str, default: float) -> float:
    if value is None:
        return default
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds <= 0:
        raise ConfigError(f"invalid {name}: must be longer than zero")
    return seconds


def _check_http_url(url: str, name: str, expected: str) -> None:
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigError(f"invalid {name}: {describe_url(url)!r} (expected {expected})")


def _check_queue_url(url: str) -> None:
    expected = "a queue URL such as https://sqs.us-east-1.amazonaws.com/123456789012/orders.fifo"
    _check_http_url(url, "--queue-url", expected)
    name = urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1]
    if not _QUEUE_NAME.match(name):
        raise ConfigError(f"invalid --queue-url: {describe_url(url)!r} (expected {expected})")


def _endpoint_from_queue_url(queue_url: str) -> str | None:
    """For a queue on an SQS-compatible server (moto, LocalStack, ElasticMQ) the SDK must be
    sent to that server: the JSON protocol posts to the endpoint, not to the queue URL."""
    parts = urlsplit(queue_url)
    host = parts.hostname or ""
    if host.endswith(_AWS_HOST_SUFFIXES):
        return None
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}"
