"""The option engine: one declaration per setting, read from the command line,
``RELAY_*`` environment variables and a TOML file, in that order of precedence, then
defaults.

Every value, whatever its source, goes through the same parser, so a bad value gets the
same one-line error from a flag, a variable or the file. This module knows nothing of the
dispatch path: the core's options are declared in :mod:`relay.config`, each broker's in
its adapter's settings module.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from relay.dsn import remember_secrets
from relay.durations import format_bound, parse_duration
from relay.errors import ConfigError, shown
from relay.sizes import format_size, parse_size

Kind = Literal["str", "int", "float", "duration", "choice", "list", "bool"]

# Duration bounds are declared in seconds.
MS, SECOND, MINUTE, HOUR, DAY = 0.001, 1.0, 60.0, 3600.0, 86400.0


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
    # Other TOML tables that may hold ``key``: a setting several brokers share (``region``
    # in ``[sqs]`` or ``[sns]``) is declared once and read from whichever table is written.
    also_in: tuple[str, ...] = ()
    # No command-line flag, only the variable and the config file: a secret that must not
    # show in a process list or a shell's history.
    env_only: bool = False
    # Only the flag: no variable and no key in the file. For what one run of a command acts
    # on or how it answers (ids, filters, --yes, --dry-run, --json): a value standing in the
    # environment or a shared file would act on messages nobody named, or answer later runs
    # in a shape nobody asked for. Each such declaration says why it is one.
    cli_only: bool = False
    # The flag, when it is not ``--dest-with-dashes``: a command's short flag (`relay console
    # --port`) whose variable and key carry the command's name (RELAY_CONSOLE_PORT,
    # ``[console] port``), so that they say what they set beside every other command's.
    flag_name: str | None = None
    # The name click gives the flag's value (Option.param), when not the flag's own words:
    # a name a command's value has always been known by (`relay console --allow-host`,
    # repeatable, arrives as ``allow_hosts``, and deployment checks read it so).
    param_name: str | None = None
    # What --help and the reference write after the flag (``WHEN``, ``[NAME=]SECRET``);
    # by default a word for the kind (``DURATION``, ``N``).
    metavar: str | None = None
    # The flag's value is checked by click before this module parses it, with click's own
    # words ("Invalid value for '--limit': ..."): a count as ASCII digits within the bounds,
    # a choice among the choices. The operator commands' flags answered so before they were
    # declared here, and scripts may match it; a variable or the file gets this module's words.
    click_checked: bool = False

    def __post_init__(self) -> None:
        # Mistakes of a declaration, caught when the module declaring it is imported.
        if self.cli_only and self.env_only:
            raise ValueError(f"option {self.dest}: cli_only and env_only exclude each other")
        if self.cli_only and (self.section or self.key or self.also_in):
            raise ValueError(f"option {self.dest}: a command-line-only option has no key in the file")
        if self.flag_name is not None and not re.fullmatch(r"--[a-z0-9][a-z0-9-]*", self.flag_name):
            raise ValueError(f"option {self.dest}: flag {self.flag_name!r} is not --lowercase-words")

    @property
    def flag(self) -> str:
        """The command-line flag: ``--dest-with-dashes``, or ``flag_name``."""
        return self.flag_name or "--" + self.dest.replace("_", "-")

    @property
    def param(self) -> str:
        """The name a command receives the flag's value under: the flag without its dashes
        (``port`` for `relay console --port`), so the dest unless ``flag_name`` or
        ``param_name`` say otherwise."""
        return self.param_name or self.flag[2:].replace("-", "_")

    @property
    def reads_env(self) -> bool:
        """Whether a ``RELAY_*`` variable sets it (every option but the command-line-only ones)."""
        return not self.cli_only

    @property
    def env(self) -> str:
        """The environment variable: ``RELAY_DEST``."""
        return "RELAY_" + self.dest.upper()

    @property
    def toml_key(self) -> str:
        """The key in the config file's table (``key``, or ``dest``)."""
        return self.key or self.dest

    @property
    def where(self) -> str:
        """Where in the config file: ``[section] key``, or the top-level key."""
        return f"[{self.section}] {self.toml_key}" if self.section else self.toml_key

    @property
    def bounds(self) -> str | None:
        """The documented range, as --help and docs/reference/cli.md show it: ``1s..1d``, ``>= 10ms``."""
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
    known = [o for o in known if not o.cli_only]  # they have no key: one in the file is a mistake
    top = {o.toml_key for o in known if o.section is None}
    sections: dict[str, set[str]] = {}
    for o in known:
        for section in (o.section, *o.also_in) if o.section else ():
            sections.setdefault(section, set()).add(o.toml_key)
    for key, value in data.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: [{key}] must be a table")
            for sub in value:
                if sub not in sections[key]:
                    raise ConfigError(f"{path}: unknown key {shown(sub)} in [{key}]")
        elif key not in top:
            raise ConfigError(f"{path}: unknown key {shown(key)}")


@dataclass(frozen=True)
class Given:
    """Where an option's value came from, and the value as that source wrote it."""

    source: str  # "command line", the variable ("RELAY_ORDERED") or "config [ordering] ordered"
    raw: Any


def source_of(o: Option, cli: Mapping[str, Any], file: Mapping[str, Any], env: Mapping[str, str]) -> Given | None:
    """The source that sets ``o``: the command line, else its ``RELAY_*`` variable, else the
    config file; None when none does (the default applies). The one precedence rule."""
    raw = cli.get(o.dest)
    if raw is not None and raw != ():
        return Given("command line", raw)
    if o.cli_only:
        return None
    # An empty variable means "not set", except where empty is an error of its own.
    if o.env in env and (env[o.env] != "" or o.nonempty):
        return Given(o.env, env[o.env])
    if not o.section:
        return Given(f"config {o.where}", file[o.toml_key]) if o.toml_key in file else None
    written = [s for s in (o.section, *o.also_in) if isinstance(file.get(s), Mapping) and o.toml_key in file[s]]
    if len(written) > 1:
        raise ConfigError(f"config sets {o.toml_key} in both [{written[0]}] and [{written[1]}]: keep one")
    if written:
        return Given(f"config [{written[0]}] {o.toml_key}", file[written[0]][o.toml_key])
    return None


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
        given = source_of(o, cli, file, env)
        if given is not None:
            values[o.dest] = o.parse(given.raw, given.source)
        else:
            values[o.dest] = o.parse(o.default, "default") if o.default is not None else None
    for o in options:
        # From here on every mask() replaces these passwords literally, wherever they
        # appear: a client library quoting a piece of a malformed URL is masked too.
        if o.secret and isinstance(values[o.dest], str):
            remember_secrets(values[o.dest])
    return values


# A name is offered when it is this close to the one given (difflib's ratio, as click uses
# with its 0.6); of several, those nearly as close as the closest (within the margin):
# "worker" gets 'workers' (0.92), not also 'broker' (0.83).
SIMILAR = 0.6
SIMILAR_MARGIN = 0.05


def did_you_mean(name: str, known: Iterable[str], *, quote: bool = True, prefix: str = "") -> str:
    """`` (did you mean 'workers'?)`` for the names of ``known`` closest to ``name``, or
    ``''`` when none is close. ``quote=False`` for names that need no quotes (environment
    variables); a ``prefix`` they all share is left out of the comparison, where it would
    make every pair look alike."""
    matcher = difflib.SequenceMatcher()
    matcher.set_seq2(name.removeprefix(prefix))
    scored = []
    for candidate in known:
        matcher.set_seq1(candidate.removeprefix(prefix))
        if matcher.real_quick_ratio() >= SIMILAR and matcher.quick_ratio() >= SIMILAR:
            ratio = matcher.ratio()
            if ratio >= SIMILAR:
                scored.append((ratio, candidate))
    if not scored:
        return ""
    best = max(ratio for ratio, _ in scored)
    close = [repr(c) if quote else c for ratio, c in sorted(scored, reverse=True) if ratio >= best - SIMILAR_MARGIN]
    if len(close) == 1:
        return f" (did you mean {close[0]}?)"
    return f" (did you mean {', '.join(close[:-1])} or {close[-1]}?)"


# RELAY_* variables of the test suite (tests/services.py): passed to the relays it starts,
# read by no relay.
TEST_VARIABLES_PREFIX = "RELAY_TEST_"
_VARIABLE_NAME = re.compile(r"[A-Z0-9_]{1,100}")


def unknown_variables(env: Mapping[str, str], known: Collection[str]) -> list[str]:
    """A warning line for each ``RELAY_*`` variable of ``env`` that is not in ``known``
    (every variable some command reads): a misspelt ``RELAY_WORKER=3`` would otherwise
    mean "the default", silently. The value is never quoted: it may be a secret."""
    lines = []
    for name in sorted(env):
        if not name.startswith("RELAY_") or name in known or name.startswith(TEST_VARIABLES_PREFIX):
            continue
        hint = did_you_mean(name, known, quote=False, prefix="RELAY_")
        named = name if _VARIABLE_NAME.fullmatch(name) else shown(name)
        lines.append(f"{named} is set, but no setting of the relay has that name: it is ignored{hint}")
    return lines
