"""The SNS broker's options, and the settings checked and derived from them.

The region and endpoint are the AWS brokers' shared options (:mod:`adapters.aws.settings`),
written ``--region``/``--endpoint-url`` or in ``[sns]``; the SDK's timeouts and attempts
are SNS's own (``--sns-connect-timeout``, ...), declared by the same builder as SQS's.

This module imports neither boto3 nor botocore: the CLI reads every broker's options at
start-up, and a relay that delivers to RabbitMQ should not pay for loading the AWS SDK.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from relay.adapters.aws.settings import (
    ENDPOINT_URL,
    REGION,
    AwsSettings,
    concurrency_for,
    sdk_options,
    sdk_values,
    warn_if_slow,
)
from relay.contract import PublishLimits
from relay.errors import ConfigError, shown
from relay.options import Option

log = logging.getLogger("relay.adapters.sns")

# SNS's ceiling for one message (body plus message attributes) and for the sum of the
# messages of one PublishBatch request: 256 KiB each (SQS went to 1 MiB; SNS did not).
SNS_MAX_MESSAGE_BYTES = 262_144
SNS_MAX_REQUEST_BYTES = 262_144

# arn:<partition>:sns:<region>:<account>:<name>; a name is 1-256 letters, digits, '-' and
# '_', and a FIFO topic's ends in '.fifo' (counted in the 256).
_TOPIC_ARN = re.compile(
    r"^arn:(aws|aws-cn|aws-us-gov|aws-iso|aws-iso-b):sns:([a-z]{2}(?:-[a-z]+)+-\d+):(\d{12}):"
    r"([A-Za-z0-9_-]{1,251}\.fifo|[A-Za-z0-9_-]{1,256})$"
)

OPTIONS: tuple[Option, ...] = (
    Option(
        "topic_arn",
        "str",
        None,
        "SNS topic ARN; a name ending in .fifo means a FIFO topic.",
        section="sns",
    ),
    REGION,
    ENDPOINT_URL,
    *sdk_options("sns", "SNS"),
)


@dataclass(frozen=True, kw_only=True)
class SnsSettings(AwsSettings):
    """Everything the SNS publisher needs, checked. Build it with :meth:`from_values`."""

    topic_arn: str
    max_message_bytes: int = SNS_MAX_MESSAGE_BYTES
    max_request_bytes: int = SNS_MAX_REQUEST_BYTES

    @property
    def topic_name(self) -> str:
        return self.topic_arn.rsplit(":", 1)[-1]

    @property
    def fifo(self) -> bool:
        """SNS requires FIFO topic names to end in ``.fifo``, so the ARN alone decides."""
        return self.topic_name.endswith(".fifo")

    def region_from_arn(self) -> str | None:
        """The region written in the ARN (``arn:aws:sns:eu-west-1:...``)."""
        found = _TOPIC_ARN.match(self.topic_arn)
        return found.group(2) if found else None

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> SnsSettings:
        """Check resolved option values (see :func:`relay.options.resolve`).

        Raises :class:`relay.ConfigError` for what no retry can fix: no topic ARN, one that
        is not an SNS topic ARN, an endpoint that is not an http(s) URL, a zero timeout.
        """
        topic_arn = (values.get("topic_arn") or "").strip()
        if not topic_arn:
            raise ConfigError(
                "no SNS topic: pass --topic-arn, set RELAY_TOPIC_ARN, or put topic_arn in the [sns]"
                " table of the config file"
            )
        if not _TOPIC_ARN.match(topic_arn):
            raise ConfigError(
                f"invalid --topic-arn: {shown(topic_arn)} (expected an SNS topic ARN such as"
                " arn:aws:sns:us-east-1:123456789012:orders.fifo)"
            )
        settings = cls(
            topic_arn=topic_arn,
            concurrency=concurrency_for(limits.workers, limits.batch_size),
            cloudevents=limits.cloudevents,
            **sdk_values(values, "sns"),
        )
        warn_if_slow(settings, limits, log, "SNS")
        return settings
