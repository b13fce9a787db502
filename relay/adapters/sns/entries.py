"""An outbox message as a ``PublishBatch`` entry: the body as ``Message``, the envelope as
message attributes (see :mod:`adapters.aws.entries`, which checks and packs them for SQS
and SNS alike). SNS hands both on to its subscribers; an SQS subscription with
``RawMessageDelivery`` receives the payload and the attributes exactly as an SQS queue
the relay sent to directly would.

A FIFO topic gets ``MessageGroupId`` (the aggregate id, as for a FIFO queue) and
``MessageDeduplicationId`` (the outbox id; with a replay's run id beside it on a
replayed message, :attr:`relay.message.OutboxMessage.dedup_id`); a standard topic gets neither, since SNS
refuses a de-duplication id there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from relay.adapters.aws.entries import Entry, check, group_id
from relay.cloudevents import CloudEvents
from relay.errors import PermanentError
from relay.message import OutboxMessage

if TYPE_CHECKING:
    from mypy_boto3_sns.type_defs import PublishBatchRequestEntryTypeDef

SnsEntry: TypeAlias = "Entry[PublishBatchRequestEntryTypeDef]"


def prepare(
    message: OutboxMessage, *, fifo: bool, max_bytes: int, cloudevents: CloudEvents | None = None
) -> SnsEntry | PermanentError:
    """The entry for ``message`` (a structured CloudEvent with ``cloudevents``), or the
    PermanentError that keeps it from being sent at all."""
    checked = check(message, max_bytes=max_bytes, service="SNS", destination="the SNS topic", cloudevents=cloudevents)
    if isinstance(checked, PermanentError):
        return checked
    request: PublishBatchRequestEntryTypeDef = {
        "Id": checked.id,
        "Message": checked.body,
        "MessageAttributes": {n: {"DataType": t, "StringValue": v} for n, t, v in checked.attributes},
    }
    if fifo:
        request["MessageGroupId"] = group_id(message.aggregate_id)
        request["MessageDeduplicationId"] = message.dedup_id
    return Entry(request, checked.size, checked.id)
