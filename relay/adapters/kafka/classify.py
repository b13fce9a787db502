"""aiokafka's exceptions sorted into the relay's failure classes.

- A record too large, corrupt or refused as invalid: **permanent** for that message alone.
- The topic unknown (it was deleted after the check), access to it or the cluster denied,
  SASL refused, no broker reachable: **broker unavailable**, held, no attempt spent.
- A timeout, a leader moving, too few in-sync replicas, any error Kafka marks retriable:
  **retryable**, the attempt counts. So is an error this table does not know (never dead
  at once for what may be transient).
"""

from __future__ import annotations

from aiokafka import errors

from relay.dsn import mask
from relay.errors import BrokerUnavailable, PermanentError, RetryableError, first_line

_PERMANENT = (
    errors.MessageSizeTooLargeError,
    errors.RecordTooLargeError,
    errors.RecordListTooLargeError,
    errors.CorruptRecordException,
    errors.InvalidTopicError,
)
_UNAVAILABLE = (
    errors.UnknownTopicOrPartitionError,
    errors.TopicAuthorizationFailedError,
    errors.ClusterAuthorizationFailedError,
    errors.KafkaConnectionError,
    errors.NoBrokersAvailable,
    errors.NodeNotReadyError,
)


def classify(exc: BaseException, where: str) -> BaseException:
    text = f"{where}: {type(exc).__name__}: {mask(first_line(exc))}"
    name = type(exc).__name__
    if isinstance(exc, _PERMANENT) or name in ("InvalidRecordError", "InvalidRecordException"):
        return PermanentError(text)
    if isinstance(exc, _UNAVAILABLE) or "Sasl" in name or "Authentication" in name:
        return BrokerUnavailable(text)
    return RetryableError(text)
