"""The Kafka destination's options and their checked form. No aiokafka import here: the
CLI reads every broker's options at start-up, Kafka chosen or not."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from relay.cloudevents import CloudEvents
from relay.contract import DEFAULT_PUBLISH_TIMEOUT, PublishLimits
from relay.dsn import register_secret
from relay.errors import ConfigError, shown
from relay.options import Option

SECTION = "kafka"

# A request may use at most this share of --publish-timeout: the relay cancels the whole
# batch at the publish timeout, and an acknowledgement that comes first hands back its own
# outcome.
REQUEST_SHARE_OF_PUBLISH_TIMEOUT = 0.8
# Kafka's own default for a topic's max.message.bytes (and the producer's max.request.size).
KAFKA_MAX_MESSAGE_BYTES = 1_048_576

# Kafka's rule for topic names: letters, digits, '.', '_' and '-', at most 249 characters.
TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_SERVER = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")

OPTIONS: tuple[Option, ...] = (
    Option(
        "bootstrap_servers",
        "str",
        None,
        "Kafka brokers to start from, HOST:PORT[,HOST:PORT...].",
        section=SECTION,
    ),
    Option(
        "topic",
        "str",
        None,
        "Kafka topic the messages go to (it must exist: the relay never creates topics).",
        section=SECTION,
    ),
    Option(
        "kafka_client_id",
        "str",
        "outbox-relay",
        "client.id the brokers see (quotas and logs).",
        section=SECTION,
        key="client_id",
        nonempty=True,
    ),
    Option(
        "kafka_max_message_size",
        "int",
        KAFKA_MAX_MESSAGE_BYTES,
        "Largest record (value, key and headers, bytes) to send; larger ones go dead unsent."
        " Keep it at or below the topic's max.message.bytes.",
        section=SECTION,
        key="max_message_size",
        minimum=1024,
        maximum=1 << 30,
    ),
    Option(
        "kafka_security_protocol",
        "choice",
        "PLAINTEXT",
        "How to talk to the brokers.",
        section=SECTION,
        key="security_protocol",
        choices=("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
    ),
    Option(
        "kafka_sasl_mechanism",
        "choice",
        "PLAIN",
        "SASL mechanism with SASL_PLAINTEXT or SASL_SSL.",
        section=SECTION,
        key="sasl_mechanism",
        choices=("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
    ),
    Option("kafka_sasl_username", "str", None, "SASL user name.", section=SECTION, key="sasl_username"),
    Option(
        "kafka_sasl_password",
        "str",
        None,
        "SASL password; only from the environment (RELAY_KAFKA_SASL_PASSWORD) or the config file.",
        section=SECTION,
        key="sasl_password",
        secret=True,
        env_only=True,
    ),
    Option(
        "kafka_ca_file",
        "str",
        None,
        "CA certificates (PEM) to verify the brokers with (SSL, SASL_SSL), instead of the system's.",
        section=SECTION,
        key="ca_file",
    ),
)


def check_topic(topic: str) -> str:
    if not TOPIC.match(topic) or topic in (".", ".."):
        raise ConfigError(f"invalid topic {shown(topic)}: letters, digits, '.', '_' and '-', at most 249")
    return topic


@dataclass(frozen=True, kw_only=True)
class KafkaSettings:
    """Everything the Kafka publisher needs, checked. Build it with :meth:`from_values`."""

    bootstrap_servers: tuple[str, ...]
    topic: str
    client_id: str = "outbox-relay"
    max_message_bytes: int = KAFKA_MAX_MESSAGE_BYTES
    # The relay's --publish-timeout (the publisher answers before it), and what one request
    # to the broker may take (REQUEST_SHARE_OF_PUBLISH_TIMEOUT of it).
    publish_timeout: timedelta = DEFAULT_PUBLISH_TIMEOUT
    request_timeout: timedelta = DEFAULT_PUBLISH_TIMEOUT * REQUEST_SHARE_OF_PUBLISH_TIMEOUT
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "PLAIN"
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    # --envelope cloudevents[-json]: ce_ headers (binary) or a structured value (relay.cloudevents).
    cloudevents: CloudEvents | None = None

    @property
    def where(self) -> str:
        return f"Kafka topic {self.topic!r} at {','.join(self.bootstrap_servers)}"

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> KafkaSettings:
        """Check resolved option values; :class:`relay.ConfigError` (one line) for what no
        retry can fix: no servers or topic, a malformed one, SASL without its user."""
        servers_text = (values.get("bootstrap_servers") or "").strip()
        if not servers_text:
            raise ConfigError(
                "no Kafka brokers: pass --bootstrap-servers, set RELAY_BOOTSTRAP_SERVERS,"
                " or put bootstrap_servers in [kafka] of the config file"
            )
        servers = tuple(s.strip() for s in servers_text.split(",") if s.strip())
        for server in servers:
            if not _SERVER.match(server):
                raise ConfigError(f"invalid --bootstrap-servers entry {shown(server)}: expected HOST:PORT")
        topic = (values.get("topic") or "").strip()
        if not topic:
            raise ConfigError("no topic: pass --topic, set RELAY_TOPIC, or put topic in [kafka] of the config file")
        protocol = values.get("kafka_security_protocol") or "PLAINTEXT"
        username, password = values.get("kafka_sasl_username"), values.get("kafka_sasl_password")
        if protocol.startswith("SASL") and not (username and password):
            raise ConfigError(
                f"--kafka-security-protocol {protocol} needs --kafka-sasl-username and RELAY_KAFKA_SASL_PASSWORD"
            )
        if password:
            register_secret(password)
        ca_file = values.get("kafka_ca_file")
        if ca_file and not os.access(ca_file, os.R_OK):
            raise ConfigError(f"cannot read --kafka-ca-file {shown(ca_file)}")
        return cls(
            bootstrap_servers=servers,
            topic=check_topic(topic),
            client_id=values.get("kafka_client_id") or "outbox-relay",
            max_message_bytes=int(values.get("kafka_max_message_size") or KAFKA_MAX_MESSAGE_BYTES),
            publish_timeout=limits.publish_timeout,
            request_timeout=limits.publish_timeout * REQUEST_SHARE_OF_PUBLISH_TIMEOUT,
            security_protocol=protocol,
            sasl_mechanism=values.get("kafka_sasl_mechanism") or "PLAIN",
            sasl_username=username,
            sasl_password=password,
            ca_file=ca_file,
            cloudevents=limits.cloudevents,
        )
