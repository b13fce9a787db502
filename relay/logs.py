"""Logging set up in one place: text or JSON lines, with the message fields attached.

Every log call about a message passes ``extra=message.log_fields()``; the formatters
below print those fields, so each line carries outbox id, aggregate id, event type and
lease_version. Every field goes through :func:`relay.dsn.mask` as a last line of defence
against a password inside an exception message.

Aggregate ids, event types and error texts come from producers and brokers, so each field
is cut to a bound (with a marker saying how long it was) in both formats, and the text
format escapes control characters (:mod:`relay.textsafe`): one record is one line, and no
producer can forge a line or repaint a terminal. JSON escapes them itself.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime

from relay.dsn import mask
from relay.textsafe import clip, escape

# Bounds per field of one log line, in characters. The message carries at most one error
# text (last_error is already cut to 1,000 characters, relay.decide), a field such as an
# aggregate id or event type is an identifier, and a traceback is kept whole unless an
# exception message inside it is huge.
MAX_MESSAGE_CHARS = 4096
MAX_FIELD_CHARS = 256
MAX_TRACEBACK_CHARS = 16384

# LogRecord attributes that are not extras.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


def _bounded(value: object, limit: int) -> str:
    """One field, masked and then cut: cutting first could leave half a password that the
    mask no longer recognises."""
    return clip(mask(str(value)), limit)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        message = escape(_bounded(record.getMessage(), MAX_MESSAGE_CHARS))
        line = f"{stamp} {record.levelname:<7} {record.name}: {message}"
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={escape(_bounded(v, MAX_FIELD_CHARS))}" for k, v in extras.items())
        if record.exc_info:
            # A traceback keeps its own line breaks; within each of its lines, control
            # characters are escaped like everywhere else.
            trace = _bounded(self.formatException(record.exc_info), MAX_TRACEBACK_CHARS)
            line += "\n" + "\n".join(escape(part) for part in trace.split("\n"))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _bounded(record.getMessage(), MAX_MESSAGE_CHARS),
        }
        for key, value in _extras(record).items():
            plain = value is None or isinstance(value, bool | int | float)
            entry[key] = value if plain else _bounded(value, MAX_FIELD_CHARS)
        if record.exc_info:
            entry["exc"] = _bounded(self.formatException(record.exc_info), MAX_TRACEBACK_CHARS)
        return json.dumps(entry)


# The outbox whose run logs (a process serving several: relay.fleet sets it in each
# outbox's task, and every task that run starts inherits it).
OUTBOX: ContextVar[str | None] = ContextVar("relay_outbox", default=None)


class OutboxField(logging.Filter):
    """Adds ``outbox=<name>`` to the records of an outbox's run in a process serving several."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = OUTBOX.get()
        if name is not None and not hasattr(record, "outbox"):
            record.outbox = name
        return True


def configure(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(OutboxField())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The SDKs are chatty at INFO (every reconnect, every request); keep their warnings.
    for noisy in ("aio_pika", "aiormq", "botocore", "boto3", "urllib3", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
