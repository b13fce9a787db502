"""outbox-relay: delivers transactional-outbox rows from PostgreSQL to a message broker.

The public API, and the only names with a promise (everything else is private):

* writing events in the application's transaction: :class:`Outbox`, :class:`Event`,
  :func:`to_json`;
* receiving them exactly once: :class:`Inbox`, :class:`Received`, :class:`OutOfOrder`
  and the ``received_from_*`` helpers;
* the failure classes a publisher sorts outcomes into, and :class:`OutboxMessage`.
"""

from relay._transactions import NotInTransaction
from relay.errors import BrokerUnavailable, ConfigError, Defer, PermanentError, RetryableError
from relay.inbox import (
    Inbox,
    OutOfOrder,
    Received,
    received_from_aio_pika,
    received_from_sns,
    received_from_sqs,
)
from relay.message import OutboxMessage
from relay.writer import Event, Outbox, to_json

__all__ = [
    "BrokerUnavailable",
    "ConfigError",
    "Defer",
    "Event",
    "Inbox",
    "NotInTransaction",
    "OutOfOrder",
    "Outbox",
    "OutboxMessage",
    "PermanentError",
    "Received",
    "RetryableError",
    "received_from_aio_pika",
    "received_from_sns",
    "received_from_sqs",
    "to_json",
]
