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

from relay.adapters.aws.entries import MAX_ENVELOPE_FIELDS
from relay.adapters.sqs.settings import OPTIONS, SqsSettings
from relay.contract import DestinationSpec

__all__ = ["SPEC", "SqsSettings"]

SPEC = DestinationSpec(
    name="sqs",
    settings=SqsSettings,
    publisher="relay.adapters.sqs.publisher:SqsPublisher",
    options=OPTIONS,
    sdk_modules=("boto3", "botocore"),
    extra="outbox-relay[sqs]",
    max_envelope_fields=MAX_ENVELOPE_FIELDS,
)
