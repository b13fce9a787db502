"""The reference pages under docs/reference/, generated from the code.

    .venv/bin/python scripts/docs_reference.py           # rewrite the three pages
    .venv/bin/python scripts/docs_reference.py --check   # exit 1 if one is stale or missing

- docs/reference/cli.md: every ``relay`` command (the click group, walked recursively)
  with its usage and options, and every declared setting (relay.options.Option) with its
  flag, variable, TOML key, default and bounds;
- docs/reference/metrics.md: every series relay.metrics.RelayMetrics registers;
- docs/reference/python-api.md: every name of ``relay.__all__``.

Each render function takes what it documents as parameters (the click group, the option
groups, the metrics object, the module), so that tests/test_docs_reference.py can feed it
a changed copy and see the page change. The output depends on the code only: no time, no
path, no terminal width, no ``RELAY_*`` variable.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import html
import inspect
import itertools
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The pages document the built-in destinations: an installed one (tests/plugins/ in the
# test environment) must not add its options and name to them. Set before relay is imported.
os.environ["OUTBOX_RELAY_DISABLE_PLUGIN_AUTOLOAD"] = "1"

import click
from prometheus_client import Histogram

import relay
import relay.metrics
import relay.outboxes
from relay.adapters.registry import options_by_broker
from relay.cli.common import ALL_OPTIONS, AsciiInt, DeclaredOption
from relay.cli.main import cli
from relay.config import CORE_OPTIONS, GRANT_OPTIONS, LOG_OPTIONS, OPERATE_OPTIONS, START_OPTIONS
from relay.durations import MAX_DURATION, format_bound, parse_duration
from relay.metrics import RelayMetrics
from relay.operator_options import (
    BY,
    CONSOLE_OPTIONS,
    DEAD_FILTER_OPTIONS,
    DEAD_LIST_OPTIONS,
    DEAD_SELECT_OPTIONS,
    DRY_RUN,
    JSON,
    MIGRATE_PARTITION_OPTIONS,
    PRUNE_OPTIONS,
    REASON,
    RELEASE_OWN_OPTIONS,
    REPLAY_RUN_OPTIONS,
    SETTINGS_SET_OPTIONS,
    STATUS_OPTIONS,
)
from relay.options import MAX_CONFIG_BYTES, MAX_CONFIG_NESTING, Option, SizeOption
from relay.routes import ROUTES_OPTION, RoutesOption
from relay.sizes import format_size

NOTE = (
    "*Generated from the code by `scripts/docs_reference.py`; do not edit by hand (`make docs-reference` rewrites it).*"
)
REGENERATE = "python scripts/docs_reference.py"
CLI_PAGE = "docs/reference/cli.md"
METRICS_PAGE = "docs/reference/metrics.md"
API_PAGE = "docs/reference/python-api.md"
# Usage lines are wrapped by click at its formatter's width, which otherwise follows the
# terminal the script runs in.
USAGE_WIDTH = 80
# A signature longer than this is written one parameter per line.
SIGNATURE_WIDTH = 88
DASH = "—"
# The Environment column of an option that has no variable and no key (Option.cli_only).
COMMAND_LINE_ONLY = f"{DASH} (command line only)"

# ---- Markdown text


# Sphinx roles (:class:`Outbox`, :meth:`~A.b`), reST literals (``x``) and Markdown code (`x`).
_INLINE = re.compile(r":(?P<role>[a-z]+):`(?P<target>[^`]+)`|``(?P<literal>.+?)``|`(?P<code>[^`]+)`", re.DOTALL)
# What Markdown would read as emphasis, a link, code or an escape in plain text. An
# underscore inside a word (AGGREGATE_ID) is no emphasis, for Python-Markdown and GitHub alike.
_SPECIAL = re.compile(r"[\\*\[`]|(?<!\w)_|_(?!\w)")


# Inside raw <code>, Markdown still reads emphasis and escapes: those characters as entities.
_HTML_CODE = str.maketrans({c: f"&#{ord(c)};" for c in "|*_\\`"})


def code(text: str, *, table: bool = False) -> str:
    """``text`` as a code span. In a table a ``|`` would end the cell even inside backticks
    (GitHub's reading), and Python-Markdown prints ``\\|`` literally inside them, so such a
    span is written as HTML with the pipe as an entity, which both read the same."""
    if table and "|" in text:
        return "<code>" + html.escape(text, quote=False).translate(_HTML_CODE) + "</code>"
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def escape(text: str, *, table: bool = False) -> str:
    """Plain text as Markdown shows it literally; in a table, ``|`` as ``\\|``."""
    text = _SPECIAL.sub(lambda m: "\\" + m.group(0), text)
    text = text.replace("<", "&lt;")  # a ">" reads as a quote only where paragraph() escapes it
    return text.replace("|", "\\|") if table else text


def inline(text: str, *, table: bool = False) -> str:
    """Docstring or help text as Markdown: roles and literals become code spans, the rest
    is escaped. A role's ``~`` prefix keeps the last name, as Sphinx shows it."""
    out: list[str] = []
    pos = 0
    for m in _INLINE.finditer(text):
        out.append(escape(text[pos : m.start()], table=table))
        if m.group("role"):
            target = m.group("target")
            shown = target[1:].rsplit(".", 1)[-1] if target.startswith("~") else target
            out.append(code(shown, table=table))
        else:
            out.append(code(" ".join((m.group("literal") or m.group("code")).split()), table=table))
        pos = m.end()
    out.append(escape(text[pos:], table=table))
    return "".join(out)


def cell(text: str) -> str:
    """Markdown already made for a table cell, on one line."""
    return " ".join(text.split())


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines.extend("| " + " | ".join(cell(c) for c in row) + " |" for row in rows)
    return lines


def page(title: str, body: Iterable[str]) -> str:
    lines = [f"# {title}", "", NOTE, "", *body]
    # One blank line between blocks, none at the end: the page is compared byte for byte.
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


def paragraph(text: str) -> str:
    """Lines of one paragraph as one Markdown line; a start that Markdown would read as a
    list, a heading or a quote is escaped."""
    joined = inline(" ".join(line.strip() for line in text.splitlines()))
    return re.sub(r"^(\d+)\. ", r"\1\\. ", re.sub(r"^([-+#>]) ", r"\\\1 ", joined))


# ---- docstrings

_FIELD = re.compile(r":(?P<kind>param|parameter|arg|key|raises|raise|returns|return|yields)(?: (?P<name>[^:]+))?:\s*")
_FIELD_TITLES = {"param": "Parameters", "raises": "Raises", "returns": "Returns", "yields": "Yields"}
_FIELD_KINDS = {"parameter": "param", "arg": "param", "key": "param", "raise": "raises", "return": "returns"}


def docstring_markdown(doc: str) -> list[str]:
    """A cleaned docstring as Markdown blocks: paragraphs, ``*``/``-`` lists, ``::``
    literal blocks, and ``:param x:`` fields as a list under a bold title."""
    blocks: list[str] = []
    literal_next = False
    for block in re.split(r"\n\s*\n", doc.strip()):
        if literal_next:
            blocks.append("```text\n" + inspect.cleandoc(block) + "\n```")
            literal_next = False
            continue
        first = block.lstrip()
        if _FIELD.match(first):
            blocks.extend(_fields(block))
        elif first.startswith(("* ", "- ")):
            blocks.append(_bullets(block))
        else:
            literal_next = block.rstrip().endswith("::")
            text = block.rstrip()[:-1] if literal_next else block
            blocks.append(paragraph(text))
    return blocks


def _fields(block: str) -> list[str]:
    """``:param name: text`` lines (with indented continuations) grouped by kind."""
    items: list[tuple[str, str | None, list[str]]] = []
    for line in block.splitlines():
        m = _FIELD.match(line)
        if m:
            kind = _FIELD_KINDS.get(m.group("kind"), m.group("kind"))
            items.append((kind, m.group("name"), [line[m.end() :]]))
        elif items:
            items[-1][2].append(line.strip())
    out: list[str] = []
    for kind in dict.fromkeys(kind for kind, _, _ in items):
        out.append(f"**{_FIELD_TITLES.get(kind, kind.title())}**")
        entries = []
        for k, name, text in items:
            if k == kind:
                label = f"{code(name.split()[-1])}: " if name else ""
                entries.append(f"- {label}{paragraph(' '.join(text))}")
        out.append("\n".join(entries))
    return out


def _bullets(block: str) -> str:
    items: list[list[str]] = []
    for line in block.splitlines():
        stripped = line.strip()
        if stripped.startswith(("* ", "- ")):
            items.append([stripped[2:]])
        elif items:
            items[-1].append(stripped)
    return "\n".join(f"- {paragraph(' '.join(item))}" for item in items)


def click_help_markdown(text: str) -> list[str]:
    """A click command's help as Markdown: cut at ``\\f`` as click does, paragraphs
    reflowed, and a paragraph marked ``\\b`` kept line for line."""
    text = inspect.cleandoc(text).split("\f", 1)[0]
    blocks = []
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.splitlines()
        if lines and lines[0].strip() == "\b":
            blocks.append("<br>\n".join(inline(line.strip()) for line in lines[1:]))
        else:
            blocks.append(paragraph(block))
    return blocks


# ---- values


def duration_text(value: Any) -> str:
    return format_bound(parse_duration(value))


def default_text(o: Option) -> str:
    """An option's default as people write it; a secret's is never shown."""
    value = o.default
    if value is None or value == ():
        return DASH
    if o.secret:
        return "(hidden)"
    if isinstance(o, SizeOption):
        return code(format_size(int(value)))
    if o.kind == "duration":
        # Parsed first, so that a default that is no duration fails here rather than reach
        # the page; then shown as declared ("60s") when it is text.
        parsed = duration_text(value)
        return code(value.strip() if isinstance(value, str) else parsed)
    if o.kind == "bool":
        return code("true" if value else "false")
    if o.kind == "list":
        return ", ".join(code(str(v), table=True) for v in value)
    if o.kind == "float":
        return code(f"{value:g}")
    return code(str(value), table=True)


KIND_NAMES = {
    "str": "text",
    "int": "integer",
    "float": "number",
    "duration": "duration",
    "choice": "choice",
    "list": "list",
    "bool": "true/false",
}


def kind_text(o: Option) -> str:
    if isinstance(o, SizeOption):
        return "size"
    if isinstance(o, RoutesOption):
        return "routes"
    return KIND_NAMES.get(o.kind, o.kind)


def anchor(o: Option) -> str:
    return "opt-" + o.dest.replace("_", "-")


# ---- settings: every declared option, grouped by where it is declared


@dataclass(frozen=True)
class OptionGroup:
    """A table of the Settings section: the options one place in the code declares."""

    anchor: str
    title: str
    intro: str
    options: tuple[Option, ...]
    # Options declared in an earlier group that this broker takes too (the AWS region).
    shared: tuple[Option, ...] = ()
    # The broker whose adapter declares them; a command's section lists these by broker
    # rather than row by row (relay start and relay replay take all six brokers' options).
    broker: str | None = None


BROKER_TITLES = {
    "sqs": "Amazon SQS",
    "sns": "Amazon SNS",
    "rabbitmq": "RabbitMQ",
    "http": "HTTP",
    "kafka": "Kafka",
    "nats": "NATS JetStream",
    "log": "log",
}


def settings_groups() -> tuple[OptionGroup, ...]:
    """Every option the code declares, in the groups the Settings section shows. Raises
    when an option is declared that no group places, so a new declaration is documented
    (or this function taught where it belongs) before the pages can be written."""
    groups = [
        OptionGroup("settings-core", "The outbox", "Where the outbox is.", CORE_OPTIONS),
        OptionGroup(
            "settings-start",
            "Delivery (`relay start`)",
            "Where `relay start` delivers, and how: claims, retries, ordering, its PostgreSQL sessions.",
            START_OPTIONS,
        ),
        OptionGroup(
            "settings-routes", "Routes", "Event types delivered to destinations of their own.", (ROUTES_OPTION,)
        ),
        OptionGroup(
            "settings-operate",
            "Operating a relay",
            "The metrics and health endpoint, the scheduled prune, tracing.",
            OPERATE_OPTIONS,
        ),
        OptionGroup("settings-logging", "Logging", "What every command logs, and how.", LOG_OPTIONS),
        OptionGroup(
            "settings-grants",
            "Grants",
            "Roles `relay migrate` grants to, and `relay grants` prints the statements for.",
            GRANT_OPTIONS,
        ),
        OptionGroup(
            "settings-partitions",
            "Partitions",
            "A partitioned outbox, which `relay migrate` creates (docs/partitioning.md).",
            MIGRATE_PARTITION_OPTIONS,
        ),
        *_broker_groups(),
        *_operator_groups(),
    ]
    _check_every_option_placed(groups)
    return tuple(groups)


def _broker_groups() -> Iterator[OptionGroup]:
    placed: set[str] = set()
    for broker, options in options_by_broker().items():
        if not options:
            continue
        title = BROKER_TITLES.get(broker, broker)
        yield OptionGroup(
            f"settings-{broker}",
            f"Broker: {title}",
            f"Read when `--broker {broker}` is chosen.",
            tuple(o for o in options if o.dest not in placed),
            shared=tuple(o for o in options if o.dest in placed),
            broker=broker,
        )
        placed.update(o.dest for o in options)


def _operator_groups() -> Iterator[OptionGroup]:
    """The operator commands' own options (relay.operator_options), a group per command."""
    yield OptionGroup("settings-console", "The console (`relay console`)", "The operators' web page.", CONSOLE_OPTIONS)
    yield OptionGroup("settings-status", "`relay status`", "How `relay status` answers.", _own(STATUS_OPTIONS))
    yield OptionGroup(
        "settings-dead",
        "Dead messages (`relay dead`)",
        "Which dead messages `relay dead list`, `retry` and `skip` read or change, and how many are listed.",
        _own((*DEAD_FILTER_OPTIONS, *DEAD_LIST_OPTIONS, *DEAD_SELECT_OPTIONS)),
    )
    yield OptionGroup("settings-prune", "`relay prune`", "What a run of `relay prune` deletes.", _own(PRUNE_OPTIONS))
    yield OptionGroup(
        "settings-replay",
        "`relay replay`",
        "What one run of `relay replay` publishes again, and how; its broker and limits are `relay start`'s.",
        _own(REPLAY_RUN_OPTIONS),
    )
    yield OptionGroup(
        "settings-release", "`relay release`", "Whose leases `relay release` hands back.", _own(RELEASE_OWN_OPTIONS)
    )
    yield OptionGroup(
        "settings-shared-set",
        "`relay settings set`",
        "The shared settings a run of `relay settings set` changes: only those its flags name.",
        _own(SETTINGS_SET_OPTIONS),
    )
    yield OptionGroup(
        "settings-answers",
        "Answers and records of the operator commands",
        "How an operator command answers, and what an action records with the messages it changes.",
        (JSON, DRY_RUN, BY, REASON),
    )


def _own(options: Iterable[Option]) -> tuple[Option, ...]:
    """``options`` less those several commands share (--json, --dry-run, --by, --reason),
    which have a group of their own."""
    shared = {JSON.dest, DRY_RUN.dest, BY.dest, REASON.dest}
    return tuple(o for o in options if o.dest not in shared)


def _check_every_option_placed(groups: Sequence[OptionGroup]) -> None:
    placed = {o.dest for g in groups for o in g.options}
    missing = sorted({o.dest for o in (*ALL_OPTIONS, *declared_options())} - placed)
    if missing:
        raise SystemExit(
            f"scripts/docs_reference.py: options declared but in no group of settings_groups(): {', '.join(missing)}"
        )


def declared_options() -> tuple[Option, ...]:
    """Every Option held at module level (alone or in a tuple) by a loaded ``relay``
    module: what ALL_OPTIONS should hold, and what a command may declare beside it."""
    found: dict[str, Option] = {}
    for name, module in sorted(sys.modules.items()):
        if name != "relay" and not name.startswith("relay."):
            continue
        for value in vars(module).values():
            items = value if isinstance(value, tuple) else (value,)
            for item in items:
                if isinstance(item, Option):
                    found.setdefault(item.dest, item)
    return tuple(found[dest] for dest in sorted(found))


# ---- cli.md


@dataclass(frozen=True)
class CommandDoc:
    path: tuple[str, ...]
    command: click.Command
    ctx: click.Context

    @property
    def name(self) -> str:
        return " ".join(self.path)

    @property
    def anchor(self) -> str:
        return "-".join(self.path)


def walk_commands(group: click.Command, name: str = "relay") -> Iterator[CommandDoc]:
    """The group and every command under it, depth first, each group's commands in the
    order they were registered (relay.cli.main registers them in the order of a relay's
    life: migrate, start, then the operator commands)."""
    root = click.Context(group, info_name=name, terminal_width=USAGE_WIDTH, max_content_width=USAGE_WIDTH)
    yield from _walk(group, root, (name,))


def _walk(command: click.Command, ctx: click.Context, path: tuple[str, ...]) -> Iterator[CommandDoc]:
    if command.hidden:
        return
    yield CommandDoc(path, command, ctx)
    if isinstance(command, click.Group):
        for sub_name, sub in command.commands.items():
            sub_ctx = click.Context(
                sub, info_name=sub_name, parent=ctx, terminal_width=USAGE_WIDTH, max_content_width=USAGE_WIDTH
            )
            yield from _walk(sub, sub_ctx, (*path, sub_name))


def render_cli(group: click.Command, groups: Sequence[OptionGroup]) -> str:
    """docs/reference/cli.md from the click group and the declared options."""
    commands = list(walk_commands(group))
    body = [
        *_cli_intro(groups, commands),
        "## Commands",
        "",
        "Every command also takes `-h`/`--help`. A row whose option links to a setting reads"
        " it as the [Settings](#settings) section says: flag, variable, file, default.",
        "",
    ]
    for doc in commands:
        body.extend(_command_section(doc, groups))
    body.extend(_settings_section(groups, commands))
    return page("Command-line reference", body)


def _cli_intro(groups: Sequence[OptionGroup], commands: Sequence[CommandDoc]) -> list[str]:
    options = [o for g in groups for o in g.options]
    nonempty = ", ".join(code(o.env) for o in options if o.nonempty)
    shared = [o for o in options if o.also_in]
    shared_text = ", ".join(
        f"{code(o.toml_key)} in {' or '.join(code(f'[{s}]') for s in (o.section, *o.also_in))}" for o in shared
    )
    when_flags = sorted(
        {opt for d in commands for p in d.command.params for opt in _opts(p) if _metavar(p, d.ctx) == "WHEN"}
    )
    return [
        "## Where settings come from",
        "",
        "A setting is read from the first of these that sets it (`relay.options.source_of`):",
        "",
        "1. the command line: its flag, when given (a repeatable flag, when given at least once);",
        "2. its `RELAY_*` environment variable, when it holds anything but the empty string. An"
        f" empty variable counts as unset, except for the settings that must not be empty ({nonempty}):"
        " for those it is read, and refused;",
        "3. the TOML file named by `--config` or `RELAY_CONFIG`: the setting's key at the top level,"
        " or in its table (the *TOML key* column). A setting that may sit in either of two tables"
        f" ({shared_text}) is refused when both hold it;",
        "4. its default.",
        "",
        "A setting marked *command line only* has no variable and no key: what one run of a command acts on"
        " or how it answers (ids, filters, `--yes`, `--dry-run`, `--json`). One standing in the environment or"
        " a shared file would act on messages nobody named, or change every later answer.",
        "",
        "Whatever its source, a value goes through the same parser and bounds (the default too),"
        " so a bad value gets the same one-line error from a flag, a variable or the file."
        " The file may hold only keys that some setting declares: a misspelt key is an error, not"
        f" the default. A file over {format_size(MAX_CONFIG_BYTES)}, or with tables and arrays nested more"
        f" than {MAX_CONFIG_NESTING} deep, is refused.",
        "",
        "## Values",
        "",
        "- **Integers and numbers**: ASCII digits with an optional sign, a number with an optional"
        " decimal fraction; no exponent, `inf`, `nan` or `1_000`. In the file, an integer setting"
        " refuses a TOML float (`workers = 4.9`).",
        "- **true/false**: `--flag`/`--no-flag` on the command line; `1`, `true`, `yes`, `on` or"
        " `0`, `false`, `no`, `off` (any case) in a variable; a TOML boolean (or one of those words) in the file.",
        "- **Lists**: the flag repeated, one value each; comma-separated in a variable (routes: separated by `;`);"
        " an array of strings in the file (routes: `[[routes]]` tables).",
        "- **Durations** (`relay.durations`): a number of seconds (`90`, `1.5`), or numbers each"
        " followed by a unit, `ms`, `s`, `m`, `h` or `d`, written together: `250ms`, `30s`, `5m`,"
        " `1m30s`, `1.5h`, `7d`. Units in any case, spaces ignored, ASCII digits; no sign or exponent."
        " In the file a number is seconds. A negative duration is refused, and none may exceed"
        f" {code(format_bound(MAX_DURATION))}, whatever the setting's bounds.",
        "- **Sizes** (`relay.sizes`, settings of type *size*): a number of bytes, or a number and a"
        " unit: `KiB`, `MiB`, `GiB` (powers of 1024), `kB`, `MB`, `GB` (powers of 1000) or `B`, in any"
        " case, with at most one space between (`512KiB`, `8 MiB`, `10MB`). A fraction is taken when"
        " the result is a whole number of bytes (`1.5KiB`). In the file a number is bytes. Other byte"
        " counts (`--sqs-max-message-size`) are plain integers.",
        "- **WHEN** (" + ", ".join(code(f) for f in when_flags) + "): a duration before now (`2h`), or an"
        " ISO 8601 time (`2024-05-01T12:00+00:00`), local unless it carries an offset.",
        "",
        "Bounds are written as `--help` shows them: `1..1000`, `>= 1`, `1s..1d`, `64KiB..1GiB`.",
        "",
    ]


def _command_section(doc: CommandDoc, groups: Sequence[OptionGroup]) -> list[str]:
    level = "###" if len(doc.path) <= 2 else "####"
    cmd = doc.command
    lines = [f"{level} {doc.name} {{#{doc.anchor}}}", ""]
    if cmd.deprecated:
        lines += ["*Deprecated.*", ""]
    for block in click_help_markdown(cmd.help or cmd.short_help or ""):
        lines += [block, ""]
    lines += ["```text", cmd.get_usage(doc.ctx), "```", ""]
    if isinstance(cmd, click.Group):
        lines += _subcommand_list(doc)
    declared = {o.dest: (o, g) for g in groups for o in g.options}
    params = [p for p in cmd.params if not getattr(p, "hidden", False)]
    _check_every_parameter_declared(doc, params, declared)
    rows = [_param_row(p, doc.ctx, declared) for p in params if _broker_option(p, declared) is None]
    if rows:
        lines += [*table(("Option", "Default", "Bounds", "Environment", "TOML key", "Description"), rows), ""]
    lines += _broker_lists(params, declared)
    return lines


# An option's dest -> the Option declaring it, and the group it is in.
Declared = Mapping[str, tuple[Option, OptionGroup]]


def _declared(p: click.Parameter, declared: Declared) -> tuple[Option, OptionGroup] | None:
    """The declaration (as the groups hold it) a command's option was made from, or None for
    a plain click option (relay.cli.common.with_options makes a DeclaredOption of each)."""
    if not isinstance(p, DeclaredOption):
        return None
    return declared.get(p.declared.dest)


def _check_every_parameter_declared(doc: CommandDoc, params: Sequence[click.Parameter], declared: Declared) -> None:
    missing = [p.name for p in params if isinstance(p, DeclaredOption) and p.declared.dest not in declared]
    if missing:
        raise SystemExit(
            f"scripts/docs_reference.py: {doc.name} takes options in no group of settings_groups(): {missing}"
        )


def _broker_option(p: click.Parameter, declared: Declared) -> tuple[Option, OptionGroup] | None:
    found = _declared(p, declared)
    return found if found is not None and found[1].broker else None


def _broker_lists(params: Sequence[click.Parameter], declared: Declared) -> list[str]:
    """The brokers' options a command takes, one line per broker, linked to their settings."""
    by_group: dict[str, tuple[OptionGroup, list[Option]]] = {}
    for p in params:
        found = _broker_option(p, declared)
        if found is not None:
            o, g = found
            by_group.setdefault(g.anchor, (g, []))[1].append(o)
    if not by_group:
        return []
    lines = ["The options of the broker chosen with `--broker` (each one's row is in [Settings](#settings)):", ""]
    for g, options in by_group.values():
        flags = ", ".join(f"[{code(o.flag)}](#{anchor(o)})" for o in options)
        lines.append(f"- [{inline(g.title)}](#{g.anchor}): {flags}")
    return [*lines, ""]


def _subcommand_list(doc: CommandDoc) -> list[str]:
    assert isinstance(doc.command, click.Group)
    lines = []
    for name, sub in doc.command.commands.items():
        if not sub.hidden:
            summary = inline(sub.get_short_help_str(limit=200))
            lines.append(f"- [{doc.name} {name}](#{doc.anchor}-{name}): {summary}")
    return [*lines, ""]


def _opts(p: click.Parameter) -> list[str]:
    return [*p.opts, *p.secondary_opts]


def _metavar(p: click.Parameter, ctx: click.Context) -> str | None:
    if isinstance(p, click.Option) and (p.is_flag or p.count):
        return None
    return p.make_metavar(ctx)


def _param_row(p: click.Parameter, ctx: click.Context, declared: Declared) -> tuple[str, ...]:
    metavar = _metavar(p, ctx)
    if isinstance(p, click.Argument):
        return (code(metavar or p.human_readable_name, table=True), DASH, DASH, DASH, DASH, _argument_text(p))
    flags = " / ".join(code(o) for o in _opts(p))
    shown_metavar = " " + code(metavar, table=True) if metavar else ""
    found = _declared(p, declared)
    if found is not None:
        o = found[0]
        return (
            f"[{flags}](#{anchor(o)}){shown_metavar}",
            f"[setting](#{anchor(o)})",
            code(o.bounds) if o.bounds else DASH,
            code(o.env) if o.reads_env else COMMAND_LINE_ONLY,
            _toml_keys(o),
            inline(_declared_help(p), table=True),
        )
    return (flags + shown_metavar, _click_default(p, ctx), _click_bounds(p), _click_envvar(p), DASH, _click_help(p))


def _toml_keys(o: Option) -> str:
    """Where the config file sets ``o``: its key, in its table or either of them."""
    if not o.reads_env:
        return DASH
    return " or ".join(code(f"[{s}] {o.toml_key}" if s else o.toml_key) for s in (o.section, *o.also_in))


def _argument_text(p: click.Argument) -> str:
    many = p.nargs == -1
    need = "required" if p.required else "optional"
    return f"Argument ({need}{', any number' if many else ''})."


def _declared_help(p: click.Parameter) -> str:
    """The help a command gives a declared option (relay replay and the operator commands
    word some of them their own way), without the default, bounds and variable its other
    columns show."""
    assert isinstance(p, DeclaredOption)
    return p.declared.help


def _click_help(p: click.Parameter) -> str:
    text = getattr(p, "help", None) or ""
    for name in _envvars(p):  # "[env RELAY_CONFIG]" says again what the Environment column says
        text = text.removesuffix(f" [env {name}]")
    return inline(text, table=True) + (" Required." if p.required else "")


_UNSET = getattr(click.core, "UNSET", object())


def _click_default(p: click.Parameter, ctx: click.Context) -> str:
    value = p.get_default(ctx, call=False)
    if value is None or value is _UNSET or value == () or value == []:
        return DASH
    if callable(value):
        return "(computed)"
    if isinstance(value, bool):
        return "on" if value else "off"
    return code(str(value), table=True)


def _click_bounds(p: click.Parameter) -> str:
    t = p.type
    if isinstance(t, AsciiInt):
        return code(f"{t.low}..{t.high}")
    if isinstance(t, click.IntRange | click.FloatRange):
        if t.min is not None and t.max is not None:
            return code(f"{t.min}..{t.max}")
        if t.min is not None:
            return code(f"{'>' if t.min_open else '>='} {t.min}")
        if t.max is not None:
            return code(f"{'<' if t.max_open else '<='} {t.max}")
    return DASH


def _envvars(p: click.Parameter) -> list[str]:
    envvar = p.envvar
    if not envvar:
        return []
    return [envvar] if isinstance(envvar, str) else list(envvar)


def _click_envvar(p: click.Parameter) -> str:
    return ", ".join(code(n) for n in _envvars(p)) or DASH


def _settings_section(groups: Sequence[OptionGroup], commands: Sequence[CommandDoc]) -> list[str]:
    lines = [
        "## Settings {#settings}",
        "",
        "Every setting the code declares (`relay.options.Option`), by where it is declared."
        " Link to one as `reference/cli.md#opt-<name>`, the name with `-` for `_`"
        " (`#opt-batch-size`).",
        "",
    ]
    for g in groups:
        lines += [f"### {g.title} {{#{g.anchor}}}", "", inline(g.intro)]
        takers = _takers_text(g, commands)
        if takers:
            lines[-1] += f" Taken by {takers}."
        if g.shared:
            shared = ", ".join(f"[{code(o.flag)}](#{anchor(o)})" for o in g.shared)
            lines[-1] += f" Also reads {shared}, listed above."
        header = ("Flag", "Environment", "TOML key", "Type", "Default", "Bounds", "Description")
        lines += ["", *table(header, (_setting_row(o) for o in g.options)), ""]
    return lines


# A command that takes more of a group's flags than this, but not all, is said to take it
# "in part": its own section lists them.
MAX_LISTED_FLAGS = 4


def _takers_text(g: OptionGroup, commands: Sequence[CommandDoc]) -> str:
    """The commands that take the group's flags, each with the flags it takes when not all."""
    flagged = [o for o in (*g.options, *g.shared) if not o.env_only]
    parts = []
    for d in commands:
        names = {p.declared.dest for p in d.command.params if isinstance(p, DeclaredOption)}
        taken = [o for o in flagged if o.dest in names]
        if not taken:
            continue
        link = f"[{d.name}](#{d.anchor})"
        if len(taken) > MAX_LISTED_FLAGS and len(taken) < len(flagged):
            link += " (in part)"
        elif len(taken) < len(flagged):
            link += " (" + ", ".join(code(o.flag) for o in taken) + ")"
        parts.append(link)
    return "; ".join(parts)


def _setting_row(o: Option) -> tuple[str, ...]:
    target = f'<a id="{anchor(o)}"></a>'
    if o.env_only:
        flag = f"{DASH} (environment and file only)"
    elif o.kind == "bool" and not (o.cli_only and o.default is False):
        flag = f"{code(o.flag)} / {code('--no-' + o.flag[2:])}"
    else:
        flag = code(o.flag)
    return (
        target + flag,
        code(o.env) if o.reads_env else COMMAND_LINE_ONLY,
        _toml_keys(o),
        kind_text(o),
        default_text(o),
        code(o.bounds) if o.bounds else DASH,
        _setting_description(o),
    )


def _setting_description(o: Option) -> str:
    parts = [inline(o.help, table=True)]
    if o.choices:
        parts.append("One of " + ", ".join(code(c) for c in o.choices) + ".")
    if o.nonempty:
        parts.append("Must not be empty.")
    if o.secret:
        parts.append("Secret: its value is masked in the relay's logs and error lines.")
    return " ".join(parts)


# ---- metrics.md


@dataclass(frozen=True)
class Series:
    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def exposed(self) -> tuple[str, ...]:
        """The names a scrape shows (prometheus_client's text format)."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        if self.kind == "summary":
            return (f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def metric_series(metrics: RelayMetrics) -> list[Series]:
    """Every series on ``metrics``' registry, in the order RelayMetrics registers them.

    CollectorRegistry has no public way to list its collectors, and a labelled metric's
    label names (or a labelled histogram's buckets) are nowhere in what ``collect()``
    yields until a child exists; so this reads prometheus_client's ``_collector_to_names``,
    ``_labelnames`` and ``_upper_bounds``.
    """
    series = []
    for collector in metrics.registry._collector_to_names:
        describe: Callable[[], Iterable[Any]] = getattr(collector, "describe", collector.collect)
        for family in describe():
            labels = tuple(getattr(collector, "_labelnames", ()))
            buckets = tuple(getattr(collector, "_upper_bounds", ())) if isinstance(collector, Histogram) else ()
            series.append(Series(family.name, family.type, family.documentation, labels, buckets))
    return series


def _label_values(module: ModuleType) -> dict[str, str]:
    """What each label may hold, from the constants relay.metrics declares."""
    m = module
    return {
        "outcome": ", ".join(code(v) for v in m.OUTCOMES) + " (`OUTCOMES`).",
        "error_class": ", ".join(code(v) for v in m.FAILURE_CLASSES) + " (`FAILURE_CLASSES`).",
        "status": ", ".join(code(v) for v in m.QUEUE_STATUSES) + " (`QUEUE_STATUSES`).",
        "event_type": (
            f"The event type as the producer wrote it, for the first {m.MAX_EVENT_TYPES} distinct ones a"
            f" process sees (`MAX_EVENT_TYPES`); the rest are counted as {code(m.OTHER)}."
        ),
        "destination": (
            f"{code(m.ALL_DESTINATIONS)} for the process's own circuit breaker (the broker refuses"
            " everything), else a route's destination."
        ),
        "outbox": (
            "Only in a process serving several outboxes: each one's `name` in the config's `[[outboxes]]`"
            f" (at most {relay.outboxes.MAX_OUTBOXES} per process, `[a-z0-9_-]`, at most 63 characters)."
        ),
    }


def render_metrics(metrics: RelayMetrics, module: ModuleType) -> str:
    """docs/reference/metrics.md from a RelayMetrics and the module declaring its label values."""
    series = metric_series(metrics)
    doc = inspect.getdoc(module) or ""
    body = [*_blocks(docstring_markdown(doc))]
    body += ["## Series", ""]
    rows = []
    for s in series:
        names = "<br>".join(code(n) for n in s.exposed)
        labels = [code(label) for label in s.labels]
        if s.kind == "histogram":
            labels.append(f"{code('le')} (on {code(s.name + '_bucket')})")
        # Anchors for the family and each exposed name: links may use either.
        anchors = "".join(f'<a id="{n}"></a>' for n in dict.fromkeys((s.name, *s.exposed)))
        rows.append((anchors + names, s.kind, ", ".join(labels) or DASH, inline(s.help, table=True)))
    body += [*table(("Name", "Type", "Labels", "Description"), rows), ""]
    body += [
        "prometheus_client also exports a `_created` series (the time the series began) beside each"
        " counter and histogram, unless `PROMETHEUS_DISABLE_CREATED_SERIES=true` is set.",
        "",
    ]
    body += _label_section(series, module)
    body += _bucket_section(series)
    return page("Metrics reference", body)


def _label_section(series: Sequence[Series], module: ModuleType) -> list[str]:
    values = _label_values(module)
    used = list(dict.fromkeys(label for s in series for label in s.labels))
    rows = []
    for label in used:
        where = ", ".join(f"[{code(s.exposed[0])}](#{s.name})" for s in series if label in s.labels)
        rows.append((code(label), where, values.get(label, "Not bounded by the module.")))
    return ["## Label values", "", *table(("Label", "On", "Values"), rows), ""]


def _bucket_section(series: Sequence[Series]) -> list[str]:
    histograms = [s for s in series if s.kind == "histogram"]
    if not histograms:
        return []
    rows = [(code(s.name), ", ".join(_bound(b) for b in s.buckets)) for s in histograms]
    return [
        "## Histogram buckets",
        "",
        "The upper bound (`le`) of each bucket.",
        "",
        *table(("Histogram", "Buckets"), rows),
        "",
    ]


def _bound(value: float) -> str:
    return "`+Inf`" if value == float("inf") else code(f"{value:g}")


def _blocks(blocks: Iterable[str]) -> Iterator[str]:
    for block in blocks:
        yield block
        yield ""


# ---- python-api.md

API_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("writing", "Writing events", ("Outbox", "Event", "to_json", "NotInTransaction")),
    (
        "receiving",
        "Receiving events",
        ("Inbox", "Received", "OutOfOrder", "received_from_aio_pika", "received_from_sqs", "received_from_sns"),
    ),
    ("embedding", "Running the relay in an application", ("Relay",)),
    (
        "failures",
        "Failure classes, errors and OutboxMessage",
        (
            "RetryableError",
            "PermanentError",
            "NoRoomForReplayMarker",
            "Defer",
            "NotSent",
            "BrokerUnavailable",
            "ConfigError",
            "OutboxMessage",
        ),
    ),
    (
        "destinations",
        "Writing a destination",
        (
            "Publisher",
            "Outcome",
            "PublishLimits",
            "each_message",
            "publish_deadline",
            "ChecksDestinations",
            "DestinationCheck",
            "DestinationState",
            "WatchesDestinations",
            "ReportsUnroutable",
            "DestinationSpec",
            "DestinationSettings",
            "Option",
        ),
    ),
)


def render_python_api(module: ModuleType, missing: list[str] | None = None) -> str:
    """docs/reference/python-api.md from ``module.__all__``; names and public methods
    without a docstring are appended to ``missing``."""
    missing = [] if missing is None else missing
    names: list[str] = list(module.__all__)
    grouped = [(a, t, tuple(n for n in ns if n in names)) for a, t, ns in API_GROUPS]
    placed = {n for _, _, ns in grouped for n in ns}
    rest = tuple(sorted(n for n in names if n not in placed))
    if rest:
        grouped.append(("other", "Other", rest))
    body = [*_blocks(docstring_markdown(inspect.getdoc(module) or ""))]
    for group_anchor, title, members in grouped:
        if not members:
            continue
        body += [f"## {title} {{#{group_anchor}}}", ""]
        for name in members:
            body += _api_entry(name, getattr(module, name), missing)
    return page("Python API reference", body)


def _api_entry(name: str, obj: Any, missing: list[str]) -> list[str]:
    lines = [f"### {name} {{#{name}}}", "", "```python"]
    if not inspect.isclass(obj) and not callable(obj):  # a type alias (relay.Outcome)
        lines += [f"{name} = {_annotation_text(obj)}", "```", ""]
        doc = _attribute_doc(name)
        if doc is None:
            missing.append(name)
            return [*lines, "*No docstring.*", ""]
        return [*lines, *_blocks(docstring_markdown(doc))]
    if inspect.isclass(obj):
        lines += _class_header(name, obj)
    else:
        lines.append(_prefix(obj) + "def " + signature_text(name, inspect.signature(obj)))
    lines += ["```", ""]
    lines += _doc(name, obj, missing)
    if inspect.isclass(obj):
        lines += _class_body(name, obj, missing)
    return lines


def _attribute_doc(name: str) -> str | None:
    """The docstring written under ``name``'s assignment in the ``relay`` module it is
    imported from (the string literal after ``Outcome: TypeAlias = ...``, as Sphinx reads
    attribute docstrings): a type alias has no ``__doc__`` of its own."""
    source = inspect.getsource(relay)
    origin = next(
        (
            node.module
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names)
        ),
        None,
    )
    if origin is None:
        return None
    body = ast.parse(inspect.getsource(sys.modules[origin])).body
    for assignment, after in itertools.pairwise(body):
        target = assignment.target if isinstance(assignment, ast.AnnAssign) else None
        if isinstance(assignment, ast.Assign) and len(assignment.targets) == 1:
            target = assignment.targets[0]
        if isinstance(target, ast.Name) and target.id == name:
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                return inspect.cleandoc(str(after.value.value))
            return None
    return None


def _class_header(name: str, cls: type) -> list[str]:
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    lines = [f"class {name}" + (f"({', '.join(bases)})" if bases else "")]
    try:
        sig = inspect.signature(cls)
    except ValueError:  # an exception class that keeps BaseException's constructor
        return lines
    lines.append(signature_text(name, sig, returns=False))
    return lines


def _doc(name: str, obj: Any, missing: list[str]) -> list[str]:
    doc = inspect.getdoc(obj) if _own_doc(obj) else None
    if not doc:
        missing.append(name)
        return ["*No docstring.*", ""]
    return list(_blocks(docstring_markdown(doc)))


def _own_doc(obj: Any) -> bool:
    """Whether ``obj`` has a docstring of its own: inspect.getdoc falls back to a base
    class's (an exception would get Exception's "Common base class..."), and dataclasses
    write their signature as the docstring of a class without one."""
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        return (
            isinstance(doc, str)
            and bool(doc)
            and not (dataclasses.is_dataclass(obj) and doc.startswith(obj.__name__ + "("))
        )
    return bool(getattr(obj, "__doc__", None))


def _class_body(name: str, cls: type, missing: list[str]) -> list[str]:
    lines: list[str] = []
    if dataclasses.is_dataclass(cls):
        lines += _fields_table(cls)
    if any(hasattr(c, "__aenter__") for c in _own_classes(cls)):
        lines += ["Use it as an async context manager (`async with`) too.", ""]
    for member, value, owner in public_members(cls):
        lines += _member_entry(name, member, value, owner, missing)
    return lines


def _fields_table(cls: type) -> list[str]:
    rows = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default = code(_value_text(f.default), table=True)
        elif f.default_factory is not dataclasses.MISSING:
            default = code(_factory_text(f.default_factory), table=True)
        else:
            default = "required"
        rows.append((code(f.name), code(_annotation_text(f.type), table=True), default))
    return ["**Fields**", "", *table(("Field", "Type", "Default"), rows), ""]


def _factory_text(factory: Callable[[], Any]) -> str:
    qualname = getattr(factory, "__qualname__", repr(factory))
    if qualname == "<lambda>":
        return "(computed)"
    module = getattr(factory, "__module__", "builtins")
    return f"{qualname}()" if module == "builtins" else f"{module}.{qualname}()"


def _own_classes(cls: type) -> list[type]:
    """``cls`` and its bases except the builtins (object, Exception, BaseException)."""
    return [c for c in cls.__mro__ if c.__module__ != "builtins"]


def public_members(cls: type) -> list[tuple[str, Any, type]]:
    """Public methods, classmethods, staticmethods and properties of ``cls`` and its non-builtin
    bases, each once, in the order the classes define them (``cls``'s own first)."""
    members: list[tuple[str, Any, type]] = []
    seen: set[str] = set()
    for owner in _own_classes(cls):
        for member, value in vars(owner).items():
            if member.startswith("_") or member in seen:
                continue
            if inspect.isfunction(value) or isinstance(
                value, staticmethod | classmethod | property | functools.cached_property
            ):
                seen.add(member)
                members.append((member, value, owner))
    return members


def _member_entry(cls_name: str, member: str, value: Any, owner: type, missing: list[str]) -> list[str]:
    qualified = f"{cls_name}.{member}"
    is_property = isinstance(value, property | functools.cached_property)
    line, target = _property_line(member, value) if is_property else _method_line(member, value)
    lines = [f"#### {qualified} {{#{qualified}}}", "", "```python", line, "```", ""]
    if owner.__name__ != cls_name:
        lines += [f"Inherited from {code(owner.__name__)}.", ""]
    return lines + _doc(qualified, target, missing)


def _property_line(member: str, value: property | functools.cached_property[Any]) -> tuple[str, Any]:
    """``name: type  # property`` and the getter, whose docstring is the property's."""
    getter = value.fget if isinstance(value, property) else value.func
    kind = "property" if isinstance(value, property) else "cached_property"
    returns = inspect.signature(getter).return_annotation if getter is not None else inspect.Signature.empty
    annotation = "" if returns is inspect.Signature.empty else f": {_annotation_text(returns)}"
    return f"{member}{annotation}  # {kind}", getter


def _method_line(member: str, value: Any) -> tuple[str, Any]:
    """``def name(...)`` without ``self`` or ``cls``, decorated as the class declares it."""
    func = value.__func__ if isinstance(value, staticmethod | classmethod) else value
    sig = inspect.signature(func)
    decorator = ""
    if isinstance(value, staticmethod):
        decorator = "@staticmethod\n"
    else:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
        decorator = "@classmethod\n" if isinstance(value, classmethod) else ""
    return decorator + _prefix(func) + "def " + signature_text(member, sig), func


def _prefix(func: Any) -> str:
    return "async " if inspect.iscoroutinefunction(func) else ""


def signature_text(name: str, sig: inspect.Signature, *, returns: bool = True) -> str:
    """``name(params) -> returns`` with annotations as the source writes them (the modules
    use ``from __future__ import annotations``, so they are strings), one parameter per
    line when it would not fit on one."""
    params = _parameters(sig)
    tail = ""
    if returns and sig.return_annotation is not inspect.Signature.empty:
        tail = f" -> {_annotation_text(sig.return_annotation)}"
    one_line = f"{name}({', '.join(params)}){tail}"
    if len(one_line) <= SIGNATURE_WIDTH:
        return one_line
    inner = "".join(f"    {p},\n" for p in params)
    return f"{name}(\n{inner}){tail}"


def _parameters(sig: inspect.Signature) -> list[str]:
    P = inspect.Parameter
    out: list[str] = []
    values = list(sig.parameters.values())
    for i, p in enumerate(values):
        if p.kind is P.KEYWORD_ONLY and (i == 0 or values[i - 1].kind not in (P.KEYWORD_ONLY, P.VAR_POSITIONAL)):
            out.append("*")
        star = "*" if p.kind is P.VAR_POSITIONAL else "**" if p.kind is P.VAR_KEYWORD else ""
        text = star + p.name
        if p.annotation is not P.empty:
            text += f": {_annotation_text(p.annotation)}"
        if p.default is not P.empty:
            text += (" = " if p.annotation is not P.empty else "=") + _value_text(p.default)
        out.append(text)
        if p.kind is P.POSITIONAL_ONLY and (i + 1 == len(values) or values[i + 1].kind is not P.POSITIONAL_ONLY):
            out.append("/")
    return out


def _annotation_text(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _value_text(value: Any) -> str:
    text = repr(value)
    if re.search(r" at 0x[0-9a-fA-F]+", text):
        # An address changes from run to run: the page would never be current.
        raise ValueError(f"default {text} has no stable repr; give it one or a constant")
    return text


# ---- the pages


def build_pages(missing: list[str] | None = None) -> dict[str, str]:
    """Every page's path (relative to the checkout) and text, from the code as it is."""
    return {
        CLI_PAGE: render_cli(cli, settings_groups()),
        # Several outboxes' series: a single outbox's are the same without the outbox label.
        METRICS_PAGE: render_metrics(RelayMetrics(outboxes=True), relay.metrics),
        API_PAGE: render_python_api(relay, missing),
    }


def stale_messages(pages: Mapping[str, str], root: Path = ROOT) -> list[str]:
    """One line per page whose file under ``root`` is missing or differs from ``pages``."""
    lines = []
    for path, text in pages.items():
        file = root / path
        if not file.is_file():
            lines.append(f"{path} is missing: run {REGENERATE}")
        elif file.read_text(encoding="utf-8") != text:
            lines.append(f"{path} is stale: run {REGENERATE}")
    return lines


def _without_relay_variables() -> None:
    # Nothing here reads them, and nothing must: a page generated on a machine that sets
    # RELAY_BATCH_SIZE must equal one generated anywhere else.
    for name in [n for n in os.environ if n.startswith("RELAY_")]:
        del os.environ[name]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale or missing")
    args = parser.parse_args(argv)
    _without_relay_variables()
    missing: list[str] = []
    pages = build_pages(missing)
    if args.check:
        stale = stale_messages(pages)
        for line in stale:
            print(line, file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages.items():
        file = ROOT / path
        if file.is_file() and file.read_text(encoding="utf-8") == text:
            print(f"{path} is current")
            continue
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    if missing:
        print("no docstring: " + ", ".join(missing), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
