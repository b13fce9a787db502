"""An outbox message as a ``SendMessageBatch`` entry: the body as ``MessageBody``, the
envelope as message attributes (see :mod:`adapters.aws.entries`, which checks and packs
them for SQS and SNS alike).

A FIFO queue always gets ``MessageGroupId`` (the aggregate id) and
``MessageDeduplicationId`` (the outbox id; with a replay's run id beside it on a
replayed message, :attr:`relay.message.OutboxMessage.dedup_id`); a standard queue gets the group id too when
``group`` is set (``--sqs-message-group standard``: SQS fair queues, where a group is a
tenant whose backlog may not starve the others), and never a de-duplication id, which
standard queues refuse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from relay.adapters.aws.entries import Entry, check, group_id
from relay.cloudevents import CloudEvents
from relay.errors import PermanentError
from relay.message import OutboxMessage

if TYPE_CHECKING:
    from mypy_boto3_sqs.type_defs import SendMessageBatchRequestEntryTypeDef

SqsEntry: TypeAlias = "Entry[SendMessageBatchRequestEntryTypeDef]"


def prepare(
    message: OutboxMessage,
    *,
    fifo: bool,
    max_bytes: int,
    group: bool = False,
    cloudevents: CloudEvents | None = None,
) -> SqsEntry | PermanentError:
    """The entry for ``message`` (a structured CloudEvent with ``cloudevents``), or the
    PermanentError that keeps it from being sent at all."""
    checked = check(message, max_bytes=max_bytes, service="SQS", destination="the SQS queue", cloudevents=cloudevents)
    if isinstance(checked, PermanentError):
        return checked
    request: SendMessageBatchRequestEntryTypeDef = {
        "Id": checked.id,
        "MessageBody": checked.body,
        "MessageAttributes": {n: {"DataType": t, "StringValue": v} for n, t, v in checked.attributes},
    }
    if fifo or group:
        request["MessageGroupId"] = group_id(message.aggregate_id)
    if fifo:
        request["MessageDeduplicationId"] = message.dedup_id
    return Entry(request, checked.size, checked.id)
