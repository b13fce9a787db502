"""Consuming what the relay delivers, exactly once and in order, with :class:`relay.Inbox`:
one :class:`Consumer` (an event's effect applied in a transaction of its own, on a
connection of its own from a pool) and a small runner per destination, each
acknowledging a message only once that transaction has committed.

========================  ==================================================
destination               runner
========================  ==================================================
RabbitMQ (aio-pika)       :meth:`Consumer.run_rabbitmq` (``rabbitmq.py``)
SQS, SNS to SQS (boto3)   :meth:`Consumer.run_sqs` (``sqs.py``)
Kafka (aiokafka)          :meth:`Consumer.run_kafka` (``kafka.py``)
NATS JetStream (nats-py)  :meth:`Consumer.run_nats` (``nats.py``)
HTTP (aiohttp server)     :meth:`Consumer.webhook_handler` (``webhook.py``)
========================  ==================================================

Each runner imports its client library only when it runs; ``relay.consumers`` itself
needs none of them.
"""

from relay.consumers.consumer import Consumer, Handler
from relay.consumers.verdict import Verdict
from relay.consumers.webhook import WebhookRejected, received_from_webhook

__all__ = ["Consumer", "Handler", "Verdict", "WebhookRejected", "received_from_webhook"]
