"""The SQS broker's options, and the settings checked and derived from them.

This module imports neither boto3 nor botocore: the CLI reads every broker's options at
start-up, and a relay that delivers to RabbitMQ should not pay for loading the AWS SDK.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from relay.adapters.aws.settings import (
    ENDPOINT_URL,
    REGION,
    AwsSettings,
    check_http_url,
    concurrency_for,
    sdk_options,
    sdk_values,
    warn_if_slow,
)
from relay.contract import PublishLimits
from relay.dsn import describe_url
from relay.errors import ConfigError
from relay.options import Option

log = logging.getLogger("relay.adapters.sqs")

# SQS's ceiling for one message (body plus message attributes) and for the sum of the
# messages of one SendMessageBatch request; both were raised from 256 KiB to 1 MiB in
# 2025. A queue's own MaximumMessageSize may be lower: it is read at start when the
# credentials allow GetQueueAttributes, and SQS's refusal is classified anyway.
SQS_MAX_MESSAGE_BYTES = 1_048_576
SQS_MAX_REQUEST_BYTES = 1_048_576

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
    REGION,
    ENDPOINT_URL,
    *sdk_options("sqs", "SQS"),
    Option(
        "sqs_message_group",
        "choice",
        "none",
        "MessageGroupId on a standard queue: 'standard' sends the aggregate id as on a FIFO queue"
        " (fair queues), 'none' sends none. FIFO queues always get it.",
        section="sqs",
        key="message_group",
        choices=("none", "standard"),
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


@dataclass(frozen=True, kw_only=True)
class SqsSettings(AwsSettings):
    """Everything the SQS publisher needs, checked. Build it with :meth:`from_values`.

    ``message_group``: ``"standard"`` sends ``MessageGroupId`` on a standard queue too
    (SQS fair queues); a FIFO queue always gets it.
    """

    queue_url: str
    message_group: str = "none"
    max_message_bytes: int = SQS_MAX_MESSAGE_BYTES
    max_request_bytes: int = SQS_MAX_REQUEST_BYTES

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

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> SqsSettings:
        """Check resolved option values (see :func:`relay.options.resolve`).

        Raises :class:`relay.ConfigError` for what no retry can fix: no queue URL, a queue
        URL or endpoint that is not an http(s) URL, a zero timeout.
        """
        queue_url = (values.get("queue_url") or "").strip()
        if not queue_url:
            raise ConfigError(
                "no SQS queue: pass --queue-url, set RELAY_QUEUE_URL, or put queue_url in the [sqs]"
                " table of the config file"
            )
        _check_queue_url(queue_url)
        fields = sdk_values(values, "sqs")
        fields.setdefault("endpoint_url", _endpoint_from_queue_url(queue_url))
        settings = cls(
            queue_url=queue_url,
            message_group=str(values.get("sqs_message_group") or "none"),
            max_message_bytes=int(values.get("sqs_max_message_size") or SQS_MAX_MESSAGE_BYTES),
            concurrency=concurrency_for(limits.workers, limits.batch_size),
            cloudevents=limits.cloudevents,
            **fields,
        )
        warn_if_slow(settings, limits, log, "SQS")
        return settings


def _check_queue_url(url: str) -> None:
    expected = "a queue URL such as https://sqs.us-east-1.amazonaws.com/123456789012/orders.fifo"
    check_http_url(url, "--queue-url", expected)
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
