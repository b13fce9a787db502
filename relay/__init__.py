"""outbox-relay: delivers transactional-outbox rows from PostgreSQL to a message broker.

The failure classes a publisher sorts outcomes into are importable from here.
"""

from relay.errors import BrokerUnavailable, ConfigError, Defer, PermanentError, RetryableError
from relay.message import OutboxMessage

__all__ = ["BrokerUnavailable", "ConfigError", "Defer", "OutboxMessage", "PermanentError", "RetryableError"]
