"""outbox-relay: delivers transactional-outbox rows from PostgreSQL to a message broker.

The failure classes a publisher sorts outcomes into are importable from here.
"""

from relay.errors import BrokerUnavailable, ConfigError, Defer, NoRoomForReplayMarker, PermanentError, RetryableError
from relay.message import OutboxMessage

__all__ = [
    "BrokerUnavailable",
    "ConfigError",
    "Defer",
    "NoRoomForReplayMarker",
    "OutboxMessage",
    "PermanentError",
    "RetryableError",
]
