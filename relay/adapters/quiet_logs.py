"""Dropping a client library's own log lines that the adapter says better itself.

Client libraries log every failed connection attempt, often at ERROR and repeated on each
try while a broker is down; the adapter reports an outage once, with the broker's reason.
A subclass names the loggers and the message prefixes to drop."""

from __future__ import annotations

import logging


class QuietLines(logging.Filter):
    LOGGERS: tuple[str, ...] = ()
    PREFIXES: tuple[str, ...] = ()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.PREFIXES))

    def install(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)

    def remove(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)
