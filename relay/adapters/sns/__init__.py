"""The ``sns`` broker: delivers outbox messages to an AWS SNS topic, standard or FIFO.

``relay start --broker sns --topic-arn ARN`` (or ``RELAY_TOPIC_ARN``, or ``topic_arn`` in
the ``[sns]`` table of the config file); ``--region`` and ``--endpoint-url`` as for SQS.
Credentials come from the usual AWS chain (environment, profile, IAM role).

Messages go out with ``PublishBatch``, ten at a time within SNS's 256 KiB per request,
carrying the payload as the message and the envelope as message attributes (the same as
SQS's: :mod:`adapters.aws.entries`). A FIFO topic (its name ends in ``.fifo``) gets
``MessageGroupId`` = aggregate id and ``MessageDeduplicationId`` = outbox id.

How failures are sorted (:mod:`adapters.aws.classify`, shared with SQS):

- throttling (``Throttled``, ``ThrottlingException``, ``KMSThrottling``), 5xx, timeouts,
  dropped connections, and refused entries with ``SenderFault`` false: **retryable**;
- a message too long, an invalid parameter or attribute (``InvalidParameter``,
  ``InvalidParameterValue``), and refused entries with ``SenderFault`` true: **permanent**
  for that message only;
- a missing topic (``NotFound``), ``AuthorizationError``, a disabled or missing KMS key,
  rejected credentials, an endpoint refusing connections: **broker unavailable**, for every
  message of the batch; no attempt is spent, and a topic created later is used within seconds;
- requests the relay built wrong (``TooManyEntriesInBatchRequest``, ``BatchRequestTooLong``,
  ``BatchEntryIdsNotDistinct``): split in two and resent.

The AWS SDK is imported only when the broker is used; this module and its options load
without it.
"""

from __future__ import annotations

from relay.adapters.aws.entries import MAX_ENVELOPE_FIELDS
from relay.adapters.sns.settings import OPTIONS, SnsSettings
from relay.contract import DestinationSpec

__all__ = ["SPEC", "SnsSettings"]

SPEC = DestinationSpec(
    name="sns",
    settings=SnsSettings,
    publisher="relay.adapters.sns.publisher:SnsPublisher",
    options=OPTIONS,
    sdk_modules=("boto3", "botocore"),
    extra="outbox-relay[sns]",
    max_envelope_fields=MAX_ENVELOPE_FIELDS,
)
