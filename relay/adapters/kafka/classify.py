"""aiokafka's exceptions sorted into the relay's failure classes.

- A record too large, corrupt or refused as invalid: **permanent** for that message alone.
- The topic unknown (it was deleted after the check), access to it or the cluster denied,
  SASL refused, no broker reachable: **broker unavailable**, held, no attempt spent.
- The broker lost the producer's idempotence state (:data:`LOST_STATE`): **broker
  unavailable**; the publisher replaces the producer (a fresh one succeeds at once) and
  the messages go again without an attempt spent.
- A timeout, a leader moving, too few in-sync replicas, any error Kafka marks retriable:
  **retryable**, the attempt counts. So is an error this table does not know (never dead
  at once for what may be transient). The publisher looks at the topic first when the
  error says its metadata is stale (:func:`needs_look`): a topic that is gone, or no broker
  answering, holds the message instead.
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
# The broker no longer has the producer's idempotence state (its id, epoch or sequence
# numbers): after a restart that lost the log tail, a topic deleted and created again, the
# producer id expired, another producer fencing it. aiokafka's idempotent producer never
# starts again from a new id on its own: every later send to that partition fails the same.
LOST_STATE = (
    errors.OutOfOrderSequenceNumber,
    errors.InvalidProducerEpoch,
    errors.UnknownProducerId,
    errors.ProducerFenced,
    errors.InvalidProducerIdMapping,
    errors.InvalidTxnState,
)
_UNAVAILABLE = (
    errors.UnknownTopicOrPartitionError,
    errors.TopicAuthorizationFailedError,
    errors.ClusterAuthorizationFailedError,
    errors.KafkaConnectionError,
    errors.NoBrokersAvailable,
    errors.NodeNotReadyError,
)

_TIMEOUTS = (errors.RequestTimedOutError, errors.KafkaTimeoutError)


def said(exc: BaseException) -> str:
    """``Type: text`` of an error for a log line, the type once (aiokafka's own texts
    often start with it), secrets masked."""
    text = mask(first_line(exc))
    name = type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}"


def lost_producer_state(exc: BaseException) -> bool:
    return isinstance(exc, LOST_STATE)


def needs_look(exc: BaseException) -> bool:
    """Whether ``exc`` may mean that the topic is gone or that no broker answers, which
    only a look at the topic tells: an error aiokafka marks as stale metadata (an unknown
    topic or partition, no leader, a lost connection), a timeout."""
    return bool(getattr(exc, "invalid_metadata", False)) or isinstance(exc, _UNAVAILABLE + _TIMEOUTS)


def classify(exc: BaseException, where: str) -> BaseException:
    text = f"{where}: {said(exc)}"
    name = type(exc).__name__
    if isinstance(exc, _PERMANENT) or name in ("InvalidRecordError", "InvalidRecordException"):
        return PermanentError(text)
    if isinstance(exc, _UNAVAILABLE + LOST_STATE) or "Sasl" in name or "Authentication" in name:
        return BrokerUnavailable(text)
    return RetryableError(text)
