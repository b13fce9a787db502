"""What the AWS brokers (``sqs``, ``sns``) share in their settings: the region and
endpoint options (declared once, for both), the SDK's timeouts and attempts (one
declaration per broker, built here), and the checks and derived values of each.

This module imports neither boto3 nor botocore: the CLI reads every broker's options at
start-up, and a relay that delivers to RabbitMQ should not pay for loading the AWS SDK.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from relay.cloudevents import CloudEvents
from relay.contract import PublishLimits
from relay.dsn import describe_url, register_secret
from relay.errors import ConfigError
from relay.options import Option

# SendMessageBatch and PublishBatch take at most ten entries: an AWS limit, not a tuning knob.
MAX_BATCH_ENTRIES = 10
# Each in-flight batch call holds one thread and one pooled HTTP connection. Past about
# 64 concurrent calls one Python process is bound by the GIL, not by AWS.
MAX_CONCURRENCY = 64

# One setting for whichever AWS broker runs: a relay delivers to one broker, so its region
# and endpoint are the same flag, variable and key for SQS and SNS (`[sqs]` or `[sns]`).
REGION = Option(
    "region",
    "str",
    None,
    "AWS region of the queue or topic. Default: from the queue URL or topic ARN, else the AWS config chain.",
    section="sqs",
    also_in=("sns",),
)
ENDPOINT_URL = Option(
    "endpoint_url",
    "str",
    None,
    "AWS-compatible endpoint such as http://127.0.0.1:4566. Default: AWS's endpoint for the"
    " region, or (SQS) the queue URL's own host when that is not an AWS host.",
    section="sqs",
    also_in=("sns",),
)


def sdk_options(broker: str, service: str) -> tuple[Option, ...]:
    """``--<broker>-connect-timeout``, ``--<broker>-read-timeout`` and
    ``--<broker>-sdk-attempts``, keys of the ``[<broker>]`` table; ``service`` names the
    service in their help ("SQS")."""
    return (
        Option(
            f"{broker}_connect_timeout",
            "duration",
            # A TCP and TLS handshake with AWS takes tens of milliseconds; 2 s allows for a
            # slow network without letting a black-holed endpoint eat the publish deadline.
            "2s",
            f"How long one {service} call may take to connect.",
            section=broker,
            key="connect_timeout",
            # Seconds, as every duration bound is. Under 10 ms no call completes; past a minute
            # (connect) or five (read) a call would outlast any sensible --publish-timeout.
            minimum=0.01,
            maximum=60,
        ),
        Option(
            f"{broker}_read_timeout",
            "duration",
            # A batch call answers in tens of milliseconds. With the defaults a call's worst
            # case is 2 attempts x (2 s + 5 s) + at most 1 s of SDK backoff = 15 s, inside the
            # default 20 s --publish-timeout, so the relay's deadline rarely has to cut a call off.
            "5s",
            f"How long one {service} call may wait for the response.",
            section=broker,
            key="read_timeout",
            minimum=0.01,
            maximum=300,
        ),
        Option(
            f"{broker}_sdk_attempts",
            "int",
            # One quick SDK retry absorbs a dropped pooled connection or a single 5xx without
            # spending a relay attempt; anything longer is the relay's backoff's job, which
            # counts attempts and spreads retries across workers with jitter.
            2,
            "Attempts the AWS SDK makes per call (1 = no SDK retry) before the relay's backoff takes over.",
            section=broker,
            key="sdk_attempts",
            minimum=1,
            maximum=5,
        ),
    )


@dataclass(frozen=True, kw_only=True)
class AwsSettings:
    """What every AWS publisher needs besides its destination, checked.

    ``max_entries`` and ``max_request_bytes`` are AWS limits; they are fields only so that
    tests can make the relay build requests AWS refuses (the split-and-resend path).
    """

    region: str | None = None
    endpoint_url: str | None = None
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 5.0
    sdk_attempts: int = 2
    max_message_bytes: int
    max_request_bytes: int
    max_entries: int = MAX_BATCH_ENTRIES
    concurrency: int = 16
    # --envelope cloudevents-json: each message a structured CloudEvent (relay.cloudevents);
    # binary mode is refused (config.cloudevents_from): its attributes would outgrow the
    # 10 message attributes a message may carry.
    cloudevents: CloudEvents | None = None

    def worst_call_s(self) -> float:
        """Longest one SDK call can take: every attempt times out, with SDK backoff between.

        botocore's standard mode waits at most ``2**(n-1)`` s before its n-th retry of a
        throttled call (1 s before the first).
        """
        backoff = sum(2.0 ** (n - 1) for n in range(1, self.sdk_attempts))
        return self.sdk_attempts * (self.connect_timeout_s + self.read_timeout_s) + backoff


def warn_if_slow(settings: AwsSettings, limits: PublishLimits, log: logging.Logger, service: str) -> None:
    """One warning when one SDK call may outlast ``--publish-timeout`` (the relay then cuts
    slow calls off and retries them, which the timeouts were meant to make rare)."""
    publish_timeout = limits.publish_timeout.total_seconds()
    if settings.worst_call_s() >= publish_timeout:
        log.warning(
            "one %s call may take up to %.0fs (%d SDK attempts x (connect %gs + read %gs)), not less than"
            " --publish-timeout %gs: slow calls will be cut off and retried by the relay",
            service,
            settings.worst_call_s(),
            settings.sdk_attempts,
            settings.connect_timeout_s,
            settings.read_timeout_s,
            publish_timeout,
        )


def sdk_values(values: Mapping[str, Any], broker: str) -> dict[str, Any]:
    """The :class:`AwsSettings` fields from resolved option values, checked; the endpoint
    is left out when none is given (an adapter may derive one)."""
    # Credentials from the environment (where a deployment usually puts them) are
    # masked literally in every log line and error, should an SDK message quote them.
    # The SDK's other sources (files, instance roles) never pass through the relay's text.
    for variable in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        register_secret(os.environ.get(variable, ""))
    fields: dict[str, Any] = {
        "region": (values.get("region") or "").strip() or None,
        "connect_timeout_s": _seconds(values.get(f"{broker}_connect_timeout"), f"--{broker}-connect-timeout", 2.0),
        "read_timeout_s": _seconds(values.get(f"{broker}_read_timeout"), f"--{broker}-read-timeout", 5.0),
        "sdk_attempts": int(values.get(f"{broker}_sdk_attempts") or 2),
    }
    endpoint = (values.get("endpoint_url") or "").strip() or None
    if endpoint is not None:
        check_http_url(endpoint, "--endpoint-url", "an http(s) URL such as http://127.0.0.1:4566")
        fields["endpoint_url"] = endpoint
    return fields


def concurrency_for(workers: int, batch_size: int) -> int:
    """Threads (and pooled connections) for batch calls: every worker's whole batch in
    flight at once, ten messages a call, within :data:`MAX_CONCURRENCY`."""
    return max(4, min(MAX_CONCURRENCY, workers * math.ceil(batch_size / MAX_BATCH_ENTRIES)))


def _seconds(value: Any, name: str, default: float) -> float:
    if value is None:
        return default
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds <= 0:
        raise ConfigError(f"invalid {name}: must be longer than zero")
    return seconds


def check_http_url(url: str, name: str, expected: str) -> None:
    """One ConfigError line unless ``url`` is an http(s) URL with a host and a valid port."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigError(f"invalid {name}: {describe_url(url)!r} (expected {expected})")
