"""outbox-relay: delivers transactional-outbox rows from PostgreSQL to a message broker.

The public API, and the only names with a promise (everything else is private):

* writing events in the application's transaction: :class:`Outbox`, :class:`Event`,
  :func:`to_json`;
* receiving them exactly once: :class:`Inbox`, :class:`Received`, :class:`OutOfOrder`,
  :class:`ConnectionShared` and the ``received_from_*`` helpers; :class:`Consumer` runs
  them for each destination, a message per pooled connection, acknowledged after commit
  (:class:`Verdict`, :class:`WebhookRejected`);
* running the relay in the application's own event loop: :class:`Relay`, its settings
  typed by :class:`RelayOptions`; replaying history from Python: :class:`Replay` of a
  :class:`Selection` (:class:`ReplayOptions`);
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
from relay.claimcheck import PayloadFetcher
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
from relay.options_typed import RelayOptions, ReplayOptions
from relay.writer import Event, Outbox, to_json

if TYPE_CHECKING:
    from relay.embed import Relay
    from relay.replay import Selection
    from relay.replay_run import Replay


def __getattr__(name: str) -> Any:
    # Relay and Replay wire the core to the broker adapters: imported when asked for, so
    # that a producer that only writes events never loads them.
    if name == "Relay":
        from relay.embed import Relay

        return Relay
    if name == "Replay":
        from relay.replay_run import Replay

        return Replay
    if name == "Selection":
        from relay.replay import Selection

        return Selection
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
    "PayloadFetcher",
    "PermanentError",
    "PublishLimits",
    "Publisher",
    "Received",
    "Relay",
    "RelayOptions",
    "Replay",
    "ReplayOptions",
    "ReportsUnroutable",
    "RetryableError",
    "Selection",
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
