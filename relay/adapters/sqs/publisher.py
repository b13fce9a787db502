"""The SQS publisher: batches of outbox messages to one queue with ``SendMessageBatch``
(the batching, splitting and ordering are :class:`adapters.aws.publisher.AwsPublisher`'s)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from relay.adapters.aws.classify import ACCESS_DENIED, CREDENTIALS, classify_client_error, classify_transport_error
from relay.adapters.aws.publisher import AwsPublisher, BatchAnswer
from relay.adapters.sqs.entries import SqsEntry, prepare
from relay.adapters.sqs.settings import SqsSettings
from relay.dsn import describe_url
from relay.errors import ConfigError, PermanentError
from relay.message import OutboxMessage

if TYPE_CHECKING:
    from mypy_boto3_sqs.client import SQSClient
    from mypy_boto3_sqs.type_defs import SendMessageBatchRequestEntryTypeDef

log = logging.getLogger("relay.adapters.sqs")


class SqsPublisher(AwsPublisher["SQSClient", "SendMessageBatchRequestEntryTypeDef"]):
    """Publishes outbox messages to one SQS queue, standard or FIFO."""

    name = "sqs"
    service = "SQS"
    log = log
    no_region_hint = ", or use a queue URL of the form https://sqs.<region>.amazonaws.com/..."
    settings: SqsSettings

    def __init__(self, settings: SqsSettings, *, session: boto3.session.Session | None = None) -> None:
        """:param settings: checked settings (see :meth:`SqsSettings.from_values`).
        :param session: the boto3 session to build the client from (tests register
            botocore event hooks on it); by default a new one on the usual AWS chain."""
        self.queue = describe_url(settings.queue_url)
        super().__init__(settings, destination=f"SQS queue {self.queue}", session=session)
        self.fifo = settings.fifo
        # Fair queues: a standard queue honours MessageGroupId when it is sent.
        self.group = settings.message_group == "standard"

    def region_hint(self) -> str | None:
        return self.settings.region_from_url()

    def new_client(self, config: Config) -> SQSClient:
        return self.session.client(
            "sqs", region_name=self.region, endpoint_url=self.settings.endpoint_url, config=config
        )

    def prepare(self, message: OutboxMessage) -> SqsEntry | PermanentError:
        return prepare(
            message,
            fifo=self.fifo,
            max_bytes=self.max_message_bytes,
            group=self.group,
            cloudevents=self.settings.cloudevents,
        )

    def send_batch(self, client: SQSClient, entries: list[SendMessageBatchRequestEntryTypeDef]) -> BatchAnswer:
        answer = client.send_message_batch(QueueUrl=self.settings.queue_url, Entries=entries)
        return BatchAnswer([ok["Id"] for ok in answer.get("Successful", [])], answer.get("Failed", []))

    def look(self, client: SQSClient) -> None:
        client.get_queue_attributes(QueueUrl=self.settings.queue_url, AttributeNames=["QueueArn"])

    async def probe(self) -> None:
        """Read FifoQueue and MaximumMessageSize when allowed; a failure here is never fatal
        except for rejected credentials."""
        client = self.client
        url = self.settings.queue_url
        try:
            answer = await self.run(
                lambda: client.get_queue_attributes(QueueUrl=url, AttributeNames=["FifoQueue", "MaximumMessageSize"])
            )
        except ClientError as exc:
            fault = classify_client_error(exc)
            if fault.code in CREDENTIALS:
                raise ConfigError(f"AWS refused the credentials for SQS queue {self.queue}: {fault.code}") from None
            if fault.code in ACCESS_DENIED:
                # Send-only roles commonly lack sqs:GetQueueAttributes; sending may still work.
                log.info("cannot read the attributes of SQS queue %s (%s); using defaults", self.queue, fault.code)
            elif fault.kind == "outage":
                # relay start's destination check says it (relay.contract.ChecksDestinations),
                # and the first publish refused logs the outage.
                log.debug("%s unavailable at start: %s", self.destination, fault.text())
            else:
                log.warning("cannot read the attributes of SQS queue %s yet: %s", self.queue, fault.text())
            return
        except BotoCoreError as exc:
            log.warning(
                "cannot reach SQS for queue %s yet (%s); delivery starts once it answers",
                self.queue,
                classify_transport_error(exc).text(),
            )
            return
        attrs = answer.get("Attributes", {})
        if attrs.get("FifoQueue") == "true":
            self.fifo = True
        size = attrs.get("MaximumMessageSize", "")
        if size.isdigit():
            self.max_message_bytes = min(self.max_message_bytes, int(size))
        log.info(
            "SQS queue %s: %s, messages up to %d bytes",
            self.queue,
            "FIFO" if self.fifo else "fair (standard, with message groups)" if self.group else "standard",
            self.max_message_bytes,
        )
