"""The ``sqs`` broker: delivers outbox messages to an AWS SQS queue, standard or FIFO.

``relay start --broker sqs --queue-url URL`` (or ``RELAY_QUEUE_URL``, or ``queue_url`` in
the ``[sqs]`` table of the config file). Credentials come from the usual AWS chain
(environment, profile, IAM role). ``--sqs-message-group standard`` sends a standard queue
the aggregate id as ``MessageGroupId`` too (SQS fair queues); FIFO queues always get it.

How failures are sorted (see :mod:`adapters.aws.classify`, shared with SNS):

- throttling (``RequestThrottled``, a 403; ``ThrottlingException``; ``KMS.ThrottlingException``;
  ``OverLimit``), 5xx, timeouts, dropped connections, and refused entries with
  ``SenderFault`` false: **retryable**, the attempt counts;
- a message too long, with refused characters, attributes or parameters, and refused entries
  with ``SenderFault`` true: **permanent** for that message only, which goes to 'dead';
- a missing queue, access denied, a disabled or missing KMS key, rejected credentials, an
  endpoint refusing connections: **broker unavailable**, for every message of the batch; no
  attempt is spent, one error names the queue, and workers probe again every 0.5-5 s, so
  a queue created later is used within seconds;
- requests the relay built wrong (too many entries, too many bytes, an Id twice): split in
  two and resent, never 'dead' for a message that fits in a request alone.

The AWS SDK is imported only when the broker is used; this module and its options load
without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relay.adapters.aws.entries import LEFT_OUT, MAX_ATTRIBUTES
from relay.adapters.aws.settings import warn_if_slow
from relay.adapters.sqs.settings import OPTIONS, SqsSettings
from relay.contract import PublishLimits

if TYPE_CHECKING:
    from relay.adapters.sqs.publisher import SqsPublisher

__all__ = ["MAX_ENVELOPE_FIELDS", "OPTIONS", "SqsSettings", "create"]

log = logging.getLogger("relay.adapters.sqs")

# Message attributes a message may carry (relay.tracing leaves out a traceparent past it).
# Fields of OutboxMessage.envelope() a message can carry: the attributes AWS takes, and
# the envelope's fields these adapters leave out (attempt, lease_version) on top.
MAX_ENVELOPE_FIELDS = MAX_ATTRIBUTES + len(LEFT_OUT)


def create(values: Mapping[str, Any], limits: PublishLimits) -> SqsPublisher:
    """Build the publisher from resolved option values and the core's limits;
    ``relay.ConfigError`` on bad settings."""
    from relay.adapters.sqs.publisher import SqsPublisher

    settings = SqsSettings.from_values(values, limits)
    warn_if_slow(settings, limits, log, "SQS")
    return SqsPublisher(settings)
