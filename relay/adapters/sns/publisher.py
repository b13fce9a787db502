"""The SNS publisher: batches of outbox messages to one topic with ``PublishBatch``
(the batching, splitting and ordering are :class:`adapters.aws.publisher.AwsPublisher`'s)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from relay.adapters.aws.classify import ACCESS_DENIED, CREDENTIALS, classify_client_error, classify_transport_error
from relay.adapters.aws.publisher import AwsPublisher, BatchAnswer
from relay.adapters.sns.entries import SnsEntry, prepare
from relay.adapters.sns.settings import SnsSettings
from relay.errors import ConfigError, PermanentError
from relay.message import OutboxMessage

if TYPE_CHECKING:
    from mypy_boto3_sns.client import SNSClient
    from mypy_boto3_sns.type_defs import PublishBatchRequestEntryTypeDef

log = logging.getLogger("relay.adapters.sns")


class SnsPublisher(AwsPublisher["SNSClient", "PublishBatchRequestEntryTypeDef"]):
    """Publishes outbox messages to one SNS topic, standard or FIFO."""

    name = "sns"
    service = "SNS"
    log = log
    no_region_hint = ", or use a topic ARN of the form arn:aws:sns:<region>:..."
    settings: SnsSettings

    def __init__(self, settings: SnsSettings, *, session: boto3.session.Session | None = None) -> None:
        """:param settings: checked settings (see :meth:`SnsSettings.from_values`).
        :param session: the boto3 session to build the client from (tests register
            botocore event hooks on it); by default a new one on the usual AWS chain."""
        self.topic = settings.topic_arn
        super().__init__(settings, destination=f"SNS topic {self.topic}", session=session)
        self.fifo = settings.fifo

    def region_hint(self) -> str | None:
        return self.settings.region_from_arn()

    def new_client(self, config: Config) -> SNSClient:
        return self.session.client(
            "sns", region_name=self.region, endpoint_url=self.settings.endpoint_url, config=config
        )

    def prepare(self, message: OutboxMessage) -> SnsEntry | PermanentError:
        return prepare(message, fifo=self.fifo, max_bytes=self.max_message_bytes, cloudevents=self.settings.cloudevents)

    def send_batch(self, client: SNSClient, entries: list[PublishBatchRequestEntryTypeDef]) -> BatchAnswer:
        answer = client.publish_batch(TopicArn=self.topic, PublishBatchRequestEntries=entries)
        return BatchAnswer([ok["Id"] for ok in answer.get("Successful", []) if "Id" in ok], answer.get("Failed", []))

    def look(self, client: SNSClient) -> None:
        client.get_topic_attributes(TopicArn=self.topic)

    async def probe(self) -> None:
        """Read FifoTopic when allowed; a failure here is never fatal except for rejected
        credentials."""
        client = self.client
        arn = self.topic
        try:
            answer = await self.run(lambda: client.get_topic_attributes(TopicArn=arn))
        except ClientError as exc:
            fault = classify_client_error(exc)
            if fault.code in CREDENTIALS:
                raise ConfigError(f"AWS refused the credentials for SNS topic {arn}: {fault.code}") from None
            if fault.code in ACCESS_DENIED:
                # Publish-only roles commonly lack sns:GetTopicAttributes; publishing may still work.
                log.info("cannot read the attributes of SNS topic %s (%s); using defaults", arn, fault.code)
            elif fault.kind == "outage":
                # relay start's destination check says it (relay.contract.ChecksDestinations),
                # and the first publish refused logs the outage.
                log.debug("%s unavailable at start: %s", self.destination, fault.text())
            else:
                log.warning("cannot read the attributes of SNS topic %s yet: %s", arn, fault.text())
            return
        except BotoCoreError as exc:
            log.warning(
                "cannot reach SNS for topic %s yet (%s); delivery starts once it answers",
                arn,
                classify_transport_error(exc).text(),
            )
            return
        if answer.get("Attributes", {}).get("FifoTopic") == "true":
            self.fifo = True
        log.info(
            "SNS topic %s: %s, messages up to %d bytes",
            arn,
            "FIFO" if self.fifo else "standard",
            self.max_message_bytes,
        )
