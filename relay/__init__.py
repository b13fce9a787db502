"""outbox-relay: delivers transactional-outbox rows from PostgreSQL to a message broker.

The public API, and the only names with a promise (everything else is private):

* writing events in the application's transaction: :class:`Outbox`, :class:`Event`,
  :func:`to_json`;
* receiving them exactly once: :class:`Inbox`, :class:`Received`, :class:`OutOfOrder`,
  :class:`ConnectionShared` and the ``received_from_*`` helpers; :class:`Consumer` runs
  them for each destination, a message per pooled connection, acknowledged after commit
  (:class:`Verdict`, :class:`WebhookRejected`);
* running the relay in the application's own event loop: :class:`Relay`;
* writing a destination of your own: the :class:`Publisher` contract (:data:`Outcome`,
  :class:`PublishLimits`, :func:`each_message`, :func:`publish_deadline`), its optional
  abilities (:class:`ChecksDestinations`, :class:`WatchesDestinations`,
  :class:`ReportsUnroutable`), the failure classes a publisher sorts outcomes into,
  :class:`OutboxMessage`, and the :class:`DestinationSpec` an installed package declares
  in the entry-point group ``outbox_relay.destinations``, with its options (:class:`Option`);
  :mod:`relay.testing` holds what to test one with.
"""

from typing import TYPE_CHECKING, Any

from relay._transactions import NotInTransaction
from relay.consumers import Consumer, Verdict, WebhookRejected, received_from_webhook
from relay.contract import (
    ChecksDestinations,
    DestinationCheck,
    DestinationSettings,
    DestinationSpec,
    DestinationState,
    Outcome,
    Publisher,
    PublishLimits,
    ReportsUnroutable,
    WatchesDestinations,
    each_message,
    publish_deadline,
)
from relay.errors import (
    BrokerUnavailable,
    ConfigError,
    Defer,
    NoRoomForReplayMarker,
    NotSent,
    PermanentError,
    RetryableError,
)
from relay.inbox import (
    ConnectionShared,
    Inbox,
    OutOfOrder,
    Received,
    received_from_aio_pika,
    received_from_kafka,
    received_from_nats,
    received_from_sns,
    received_from_sqs,
)
from relay.message import OutboxMessage
from relay.options import Option
from relay.writer import Event, Outbox, to_json

if TYPE_CHECKING:
    from relay.embed import Relay


def __getattr__(name: str) -> Any:
    # Relay wires the core to the broker adapters: imported when asked for, so that a
    # producer that only writes events never loads them.
    if name == "Relay":
        from relay.embed import Relay

        return Relay
    raise AttributeError(f"module 'relay' has no attribute {name!r}")


__all__ = [
    "BrokerUnavailable",
    "ChecksDestinations",
    "ConfigError",
    "ConnectionShared",
    "Consumer",
    "Defer",
    "DestinationCheck",
    "DestinationSettings",
    "DestinationSpec",
    "DestinationState",
    "Event",
    "Inbox",
    "NoRoomForReplayMarker",
    "NotInTransaction",
    "NotSent",
    "Option",
    "OutOfOrder",
    "Outbox",
    "OutboxMessage",
    "Outcome",
    "PermanentError",
    "PublishLimits",
    "Publisher",
    "Received",
    "Relay",
    "ReportsUnroutable",
    "RetryableError",
    "Verdict",
    "WatchesDestinations",
    "WebhookRejected",
    "each_message",
    "publish_deadline",
    "received_from_aio_pika",
    "received_from_kafka",
    "received_from_nats",
    "received_from_sns",
    "received_from_sqs",
    "received_from_webhook",
    "to_json",
]
