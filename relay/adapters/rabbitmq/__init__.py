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

from relay.adapters.rabbitmq.settings import OPTIONS, RabbitSettings
from relay.contract import DestinationSpec

__all__ = ["SPEC", "RabbitSettings"]

SPEC = DestinationSpec(
    name="rabbitmq",
    settings=RabbitSettings,
    publisher="relay.adapters.rabbitmq.publisher:RabbitPublisher",
    options=OPTIONS,
    sdk_modules=("aio_pika", "aiormq", "pamqp"),
    extra="outbox-relay[rabbitmq]",
)
