"""Logging set up in one place: text or JSON lines, with the message fields attached.

Every log call about a message passes ``extra=message.log_fields()``; the formatters
below print those fields, so each line carries outbox id, aggregate id, event type and
lease_version. Text goes through :func:`relay.dsn.mask` as a last line of defence
against a password inside an exception message.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from relay.dsn import mask

# LogRecord attributes that are not extras.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        line = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()}"
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return mask(line)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return mask(json.dumps(entry, default=str))


def configure(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The SDKs are chatty at INFO (every reconnect, every request); keep their warnings.
    for noisy in ("aio_pika", "aiormq", "botocore", "boto3", "urllib3", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
