"""The ``rabbitmq`` broker: confirmed, persistent publishing with aio-pika.

- ``settings``: the options (``--amqp-url``, ``--exchange``, ``--routing-key``, ...) and
  their validation; importable without aio-pika, since the CLI reads every broker's
  options whichever broker runs.
- ``envelope``: an outbox row as an AMQP message, refused before sending when the broker
  or the client could never take it.
- ``classify``: every broker and client failure sorted into the relay's failure classes.
- ``unroutable``: routing keys no queue is bound for, each held alone until one is.
- ``publisher``: the connection, the confirm channels and the batch publish.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relay.adapters.rabbitmq.settings import OPTIONS, RabbitSettings
from relay.contract import PublishLimits

if TYPE_CHECKING:
    from relay.adapters.rabbitmq.publisher import RabbitPublisher

__all__ = ["OPTIONS", "RabbitSettings", "create"]


def create(values: Mapping[str, Any], limits: PublishLimits) -> RabbitPublisher:
    """The publisher for resolved option ``values`` and the core's ``limits``; a bad option
    raises ``relay.ConfigError``."""
    settings = RabbitSettings.from_values(values, limits)
    # Imported here so that only a relay that publishes to RabbitMQ loads aio-pika.
    from relay.adapters.rabbitmq.publisher import RabbitPublisher

    return RabbitPublisher(settings)
