"""Settings: one declaration per option, read from the command line, ``RELAY_*``
environment variables and a TOML file, in that order of precedence, then defaults.

Every value, whatever its source, goes through the same parser, so a bad value gets the
same one-line error from a flag, a variable or the file.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from relay.backoff import Backoff
from relay.decide import Policy
from relay.dsn import remember_secrets
from relay.durations import format_bound, parse_duration
from relay.errors import ConfigError, shown
from relay.ordering import OrderingMap
from relay.sizes import format_size, parse_size
from relay.sqlnames import OutboxNames
from relay.store import DEFAULT_BATCH_BYTES, MAX_BATCH_BYTES, MIN_BATCH_BYTES
from relay.worker import WorkerConfig

Kind = Literal["str", "int", "float", "duration", "choice", "list", "bool"]


@dataclass(frozen=True)
class Option:
    """One setting. ``dest`` names it everywhere: flag ``--dest-with-dashes``, variable
    ``RELAY_DEST``, and key ``key`` (default ``dest``) in TOML table ``section``."""

    dest: str
    kind: Kind
    default: Any
    help: str
    section: str | None = None
    key: str | None = None
    choices: tuple[str, ...] = ()
    # Bounds, checked whatever the source; for a duration they are seconds.
    minimum: float | None = None
    maximum: float | None = None
    secret: bool = False
    # A string that may not be empty: '' is refused rather than read as "the default".
    nonempty: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def env(self) -> str:
        return "RELAY_" + self.dest.upper()

    @property
    def toml_key(self) -> str:
        return self.key or self.dest

    @property
    def where(self) -> str:
        return f"[{self.section}] {self.toml_key}" if self.section else self.toml_key

    @property
    def bounds(self) -> str | None:
        """The documented range, as --help and the README show it: ``1s..1d``, ``>= 10ms``."""
        fmt = _format_bound if self.kind == "duration" else _format_number
        if self.minimum is not None and self.maximum is not None:
            return f"{fmt(self.minimum)}..{fmt(self.maximum)}"
        if self.minimum is not None:
            return f">= {fmt(self.minimum)}"
        if self.maximum is not None:
            return f"<= {fmt(self.maximum)}"
        return None

    def parse(self, value: Any, source: str) -> Any:
        """Convert ``value`` from ``source`` (a flag, a variable or the file) or raise ConfigError."""
        name = f"{self.flag} (from {source})" if source != "command line" else self.flag
        if self.kind == "duration":
            return parse_duration(
                value,
                name=name,
                minimum=None if self.minimum is None else timedelta(seconds=self.minimum),
                maximum=None if self.maximum is None else timedelta(seconds=self.maximum),
            )
        if self.kind == "list":
            if isinstance(value, str):
                return tuple(v.strip() for v in value.split(",") if v.strip())
            if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
                return tuple(value)
            raise ConfigError(f"invalid {name}: expected a list of strings")
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"invalid {name}: {shown(value)} (expected true or false)")
        if self.kind in ("int", "float"):
            number = _number(value, self.kind == "int")
            if number is None:
                expected = "an integer" if self.kind == "int" else "a number"
                raise ConfigError(f"invalid {name}: {shown(value)} (expected {expected})")
            if self.minimum is not None and number < self.minimum:
                raise ConfigError(f"invalid {name}: {shown(value)} (must be at least {_format_number(self.minimum)})")
            if self.maximum is not None and number > self.maximum:
                raise ConfigError(f"invalid {name}: {shown(value)} (must be at most {_format_number(self.maximum)})")
            return number
        if not isinstance(value, str):
            raise ConfigError(f"invalid {name}: expected a string")
        if self.kind == "choice" and value not in self.choices:
            raise ConfigError(f"invalid {name}: {shown(value)} (choose from {', '.join(self.choices)})")
        if self.nonempty and not value.strip():
            raise ConfigError(f"invalid {name}: must not be empty")
        return value


# Digits are ASCII only: int() also takes "1_0" and "\u0661" (an Arabic-Indic one).
_INT = re.compile(r"[+-]?[0-9]{1,30}")
_FLOAT = re.compile(r"[+-]?[0-9]{1,30}(?:\.[0-9]{1,30})?")


def _number(value: Any, integer: bool) -> int | float | None:
    """``value`` as an int (or float), or None when it is not one: no bool, no float for an
    int (TOML ``workers = 4.9`` must not become 4), no inf or nan, ASCII digits only."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if not integer and math.isfinite(value) else None
    if isinstance(value, str):
        text = value.strip()
        if integer and _INT.fullmatch(text):
            return int(text)
        if not integer and _FLOAT.fullmatch(text):
            return float(text)
    return None


def _format_bound(seconds: float) -> str:
    return format_bound(timedelta(seconds=seconds))


def _format_number(number: float) -> str:
    # Whole numbers in full ("1048576", where :g would print "1.04858e+06").
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


@dataclass(frozen=True)
class SizeOption(Option):
    """An option holding a number of bytes, written ``512KiB``, ``8MiB`` or as bytes
    (:mod:`relay.sizes`); ``minimum`` and ``maximum`` are bytes."""

    @property
    def bounds(self) -> str | None:
        """The documented range in size units: ``64KiB..1GiB``."""
        if self.minimum is None or self.maximum is None:
            return None
        return f"{format_size(int(self.minimum))}..{format_size(int(self.maximum))}"

    def parse(self, value: Any, source: str) -> Any:
        name = f"{self.flag} (from {source})" if source != "command line" else self.flag
        return parse_size(
            value,
            name=name,
            minimum=int(self.minimum or 0),
            maximum=None if self.maximum is None else int(self.maximum),
        )


BROKERS = ("sqs", "rabbitmq", "log")

# Duration bounds are declared in seconds.
MS, SECOND, MINUTE, HOUR, DAY = 0.001, 1.0, 60.0, 3600.0, 86400.0

CORE_OPTIONS: tuple[Option, ...] = (
    Option(
        "dsn",
        "str",
        None,
        "PostgreSQL connection string or URL of the database holding the outbox.",
        secret=True,
    ),
    Option("schema", "str", "public", "Schema of the outbox table.", nonempty=True),
    Option("table", "str", "outbox", "Name of the outbox table.", nonempty=True),
)

START_OPTIONS: tuple[Option, ...] = (
    Option(
        "broker",
        "choice",
        None,
        "Where to deliver: sqs, rabbitmq, or log (JSON lines on stdout).",
        choices=BROKERS,
    ),
    Option("workers", "int", 4, "Dispatch loops in this process.", minimum=1, maximum=256),
    Option("batch_size", "int", 100, "Rows one claim leases at most.", minimum=1, maximum=1000),
    SizeOption(
        "batch_bytes",
        "str",
        DEFAULT_BATCH_BYTES,
        "Payload bytes one claim leases at most (512KiB, 4MiB, 10MB or bytes); a larger message is"
        " claimed alone, one at a time per process.",
        minimum=MIN_BATCH_BYTES,
        maximum=MAX_BATCH_BYTES,
    ),
    Option(
        "lease",
        "duration",
        "60s",
        "How long a claim owns its rows before others may take them over.",
        # Under a second leaves no room for a publish and its finalize; past a day, the rows
        # of a crashed worker wait that long before any other relay may take them over.
        minimum=SECOND,
        maximum=DAY,
    ),
    Option(
        "publish_timeout",
        "duration",
        "20s",
        "Deadline for one batch's publish; must end well inside the lease.",
        # No broker confirms a batch in under 10 ms: a shorter deadline fails every publish.
        minimum=10 * MS,
        maximum=DAY,
    ),
    Option(
        "poll_interval",
        "duration",
        "1s",
        "How long an idle worker waits before it looks again.",
        # Below 10 ms an idle relay spins (at 0 it commits thousands of empty claims a
        # second); above an hour, without wake-ups, new rows wait that long.
        minimum=10 * MS,
        maximum=HOUR,
    ),
    Option(
        "commit_order_guard",
        "bool",
        None,
        "Deprecated, no effect: ordered events follow commit order whatever the producers lock,"
        " and no other transaction holds them back. Accepted so existing configurations still start.",
    ),
    Option(
        "notify",
        "bool",
        True,
        "Wake idle workers on insert with LISTEN/NOTIFY; turn off behind a transaction-mode pooler.",
    ),
    Option(
        "pipeline",
        "bool",
        True,
        "Claim each worker's next batch while its current one publishes; --no-pipeline claims,"
        " publishes and finalizes one after another.",
    ),
    Option("max_attempts", "int", 12, "Claims a message gets before it goes to dead.", minimum=1, maximum=1000),
    Option(
        "backoff_base",
        "duration",
        "1s",
        "First retry waits up to this long (full jitter).",
        # At 0 every retry is immediate, a hot loop against a failing broker.
        minimum=MS,
        maximum=DAY,
    ),
    Option("backoff_cap", "duration", "5m", "No retry waits longer than this.", minimum=MS, maximum=DAY),
    Option(
        "shutdown_grace",
        "duration",
        "10s",
        "On SIGTERM, how long in-flight publishes may finish before they are abandoned.",
        # 0 abandons in-flight publishes at once (their rows go back unspent). Orchestrators
        # kill after 30 s by default; an hour is the most any supervisor waits.
        minimum=0,
        maximum=HOUR,
    ),
    Option(
        "defer_max_age",
        "duration",
        "1d",
        "A message deferred past this age since it was written goes to dead.",
        minimum=SECOND,
        maximum=365 * DAY,
    ),
    Option(
        "ordering_default",
        "choice",
        "ordered",
        "Strategy for event types no ordering rule names.",
        section="ordering",
        key="default",
        choices=("ordered", "unordered"),
    ),
    Option(
        "ordered",
        "list",
        (),
        "Event types (names or globs such as 'Order*') delivered in order per aggregate.",
        section="ordering",
    ),
    Option(
        "unordered",
        "list",
        (),
        "Event types (names or globs) delivered without ordering.",
        section="ordering",
    ),
)

OPERATE_OPTIONS: tuple[Option, ...] = (
    Option(
        "metrics_port",
        "int",
        None,
        "Serve /metrics, /healthz and /readyz on this port (off if unset).",
        minimum=0,
        maximum=65535,
    ),
    Option("metrics_host", "str", "0.0.0.0", "Address the metrics endpoint listens on.", nonempty=True),
    Option(
        "prune_older_than",
        "duration",
        None,
        "Delete done rows older than this, on a schedule (off if unset; see relay prune).",
        # A relay deleting rows it finished a moment ago leaves nothing to look at after an
        # incident; a minute is the least that still means "old".
        minimum=MINUTE,
        maximum=36500 * DAY,
    ),
    Option(
        "prune_interval",
        "duration",
        "1h",
        "How often the scheduled prune runs.",
        # Each run reads at least one chunk; more often than every second is a busy loop.
        minimum=SECOND,
        maximum=7 * DAY,
    ),
)

LOG_OPTIONS: tuple[Option, ...] = (
    Option(
        "log_level",
        "choice",
        "info",
        "debug, info, warning or error.",
        choices=("debug", "info", "warning", "error"),
    ),
    Option("log_format", "choice", "text", "text or json (one object per line).", choices=("text", "json")),
)


# A relay's config file is a few hundred bytes; anything past a mebibyte is not one
# (``--config /dev/zero`` would otherwise be read until memory runs out).
MAX_CONFIG_BYTES = 1024 * 1024
# Tables and arrays inside each other: a relay config uses two levels ([ordering] and a
# list in it); deeper values make no setting, and would recurse through whatever prints them.
MAX_CONFIG_NESTING = 16


def load_file(path: str | None) -> dict[str, Any]:
    """Read the TOML config file, or return {} when none was given."""
    if not path:
        return {}
    file = Path(path)
    try:
        with file.open("rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file is a directory: {path}") from None
    except PermissionError:
        raise ConfigError(f"config file is not readable: {path}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or type(exc).__name__}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES // 1024} KiB: not a relay config")
    try:
        parsed = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"malformed config file {path}: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"malformed config file {path}: {exc}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively.
        raise ConfigError(f"malformed config file {path}: values nested too deeply") from None
    if _nesting(parsed) > MAX_CONFIG_NESTING:
        raise ConfigError(f"malformed config file {path}: values nested too deeply (more than {MAX_CONFIG_NESTING})")
    return parsed


def _nesting(value: Any) -> int:
    """How deep tables and arrays go inside ``value``, counted without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_file_keys(data: Mapping[str, Any], known: Iterable[Option], path: str) -> None:
    """Reject keys no option declares, so a typo never silently means "use the default"."""
    top = {o.toml_key for o in known if o.section is None}
    sections: dict[str, set[str]] = {}
    for o in known:
        if o.section:
            sections.setdefault(o.section, set()).add(o.toml_key)
    for key, value in data.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: [{key}] must be a table")
            for sub in value:
                if sub not in sections[key]:
                    raise ConfigError(f"{path}: unknown key {shown(sub)} in [{key}]")
        elif key not in top:
            raise ConfigError(f"{path}: unknown key {shown(key)}")


def resolve(
    options: Sequence[Option],
    cli: Mapping[str, Any],
    file: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Each option's value: command line, else ``RELAY_*`` variable, else file, else default."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for o in options:
        raw = cli.get(o.dest)
        if raw is not None and raw != ():
            values[o.dest] = o.parse(raw, "command line")
            continue
        # An empty variable means "not set", except where empty is an error of its own.
        if o.env in env and (env[o.env] != "" or o.nonempty):
            values[o.dest] = o.parse(env[o.env], o.env)
            continue
        table = file.get(o.section, {}) if o.section else file
        if o.toml_key in table:
            values[o.dest] = o.parse(table[o.toml_key], f"config {o.where}")
            continue
        values[o.dest] = o.parse(o.default, "default") if o.default is not None else None
    for o in options:
        # From here on every mask() replaces these passwords literally, wherever they
        # appear: a client library quoting a piece of a malformed URL is masked too.
        if o.secret and isinstance(values[o.dest], str):
            remember_secrets(values[o.dest])
    return values


@dataclass(frozen=True)
class RelaySettings:
    """Everything `relay start` needs from the core options, validated together."""

    dsn: str
    names: OutboxNames
    broker: str
    workers: int
    worker: WorkerConfig
    ordering: OrderingMap
    shutdown_grace: timedelta = timedelta(seconds=10)
    notify: bool = True
    # Lines `relay start` logs once as warnings (deprecated options that were given).
    warnings: tuple[str, ...] = ()

    @classmethod
    def from_values(cls, v: Mapping[str, Any]) -> RelaySettings:
        dsn = require_dsn(v)
        if not v.get("broker"):
            raise ConfigError(f"no broker chosen: pass --broker ({', '.join(BROKERS)}) or set RELAY_BROKER")
        lease: timedelta = v["lease"]
        publish_timeout: timedelta = v["publish_timeout"]
        if lease <= timedelta(0):
            raise ConfigError("invalid --lease: must be longer than zero")
        if publish_timeout <= timedelta(0):
            raise ConfigError("invalid --publish-timeout: must be longer than zero")
        if publish_timeout + min(timedelta(seconds=2), lease / 10) > lease:
            raise ConfigError(
                f"--publish-timeout ({publish_timeout.total_seconds():g}s) must end inside --lease"
                f" ({lease.total_seconds():g}s) with a margin of 10% (at most 2s): a publish still running"
                " when its lease expires could deliver out of order after another worker took the message over"
            )
        if v["backoff_cap"] < v["backoff_base"]:
            raise ConfigError("--backoff-cap must not be shorter than --backoff-base")
        ordering = ordering_from(v)
        worker = WorkerConfig(
            batch_size=v["batch_size"],
            batch_bytes=v["batch_bytes"],
            lease=lease,
            publish_timeout=publish_timeout,
            poll_interval=v["poll_interval"],
            pipeline=v["pipeline"],
            policy=Policy(
                max_attempts=v["max_attempts"],
                backoff=Backoff(base=v["backoff_base"], cap=v["backoff_cap"]),
                defer_max_age=v["defer_max_age"],
            ),
        )
        return cls(
            dsn=dsn,
            names=names_from(v),
            broker=v["broker"],
            workers=v["workers"],
            worker=worker,
            ordering=ordering,
            shutdown_grace=v["shutdown_grace"],
            notify=v["notify"],
            warnings=_deprecations(v),
        )


ORDERING_OPTIONS = tuple(o for o in START_OPTIONS if o.section == "ordering")


def _deprecations(v: Mapping[str, Any]) -> tuple[str, ...]:
    if v.get("commit_order_guard") is None:
        return ()
    return (
        "--commit-order-guard/--no-commit-order-guard (RELAY_COMMIT_ORDER_GUARD, commit_order_guard) is deprecated"
        " and has no effect: ordered events are delivered in commit order whatever the producers lock, and no"
        " transaction elsewhere holds them back; remove the setting",
    )


def ordering_from(v: Mapping[str, Any]) -> OrderingMap:
    """The ordering map from resolved option values (defaults where a value is None)."""
    return OrderingMap(
        default_ordered=(v.get("ordering_default") or "ordered") == "ordered",
        ordered=v.get("ordered") or (),
        unordered=v.get("unordered") or (),
    )


def require_dsn(v: Mapping[str, Any]) -> str:
    dsn = v.get("dsn")
    if not dsn:
        raise ConfigError("no database given: pass --dsn, set RELAY_DSN, or put dsn in the config file")
    return str(dsn)


def names_from(v: Mapping[str, Any]) -> OutboxNames:
    # Only a missing value means the default: an empty one was refused when it was parsed,
    # and reaches OutboxNames (which refuses it too) if it was put in by hand.
    schema, table = v.get("schema"), v.get("table")
    return OutboxNames(schema="public" if schema is None else schema, table="outbox" if table is None else table)
