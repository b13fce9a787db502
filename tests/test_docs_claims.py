"""What the manual says that the code can check: the shared settings it names, the layout
and the services in docs/development.md, every flag and variable a page names and every
default it states, the AWS size limits, the README's benchmark figures, and pages that
stay readable (no table cell past 400 characters; no test names or issue numbers on the
pages users read). The reference pages are generated from the code and checked by
tests/test_docs_reference.py; this is for the pages written by hand."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from relay.adapters.sns.settings import SNS_MAX_MESSAGE_BYTES
from relay.adapters.sqs.settings import SQS_MAX_MESSAGE_BYTES
from relay.cli.main import cli
from relay.db.settings import SharedSettings
from relay.durations import parse_duration
from relay.errors import ConfigError
from relay.options import Option
from relay.sizes import parse_size
from scripts import docs_reference as ref

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
DEVELOPMENT = DOCS / "development.md"


def hand_written_pages() -> list[Path]:
    return [README, *(p for p in sorted(DOCS.rglob("*.md")) if "reference" not in p.relative_to(DOCS).parts)]


def nav_pages(nav: Any, section: str = "") -> Iterator[tuple[str, str]]:
    """(top-level section, page) for every page of mkdocs.yml's navigation."""
    for entry in nav:
        if isinstance(entry, str):
            yield section, entry
            continue
        for title, value in entry.items():
            if isinstance(value, str):
                yield section or title, value
            else:
                yield from nav_pages(value, section or title)


def user_pages() -> list[Path]:
    """The pages users read: the site's navigation but its Development section and the
    reference pages (generated from the code), and the README."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = [
        DOCS / page
        for section, page in nav_pages(config["nav"])
        if section != "Development" and not page.startswith("reference/")
    ]
    return [README, *pages]


# ---- the shared settings

# How the manual names each field of SharedSettings (a new field needs a name here, and a
# sentence in the manual).
SHARED_SETTING_NAMES = {"ordering": "the ordering map", "notify": "`notify`", "commit_order": "`commit_order`"}
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5}
SHARED_CLAIM = re.compile(r"\b([Tt]wo|[Tt]hree|[Ff]our|[Ff]ive) settings are \*\*shared\*\*")


def test_the_shared_settings_the_manual_names_are_the_ones_the_code_keeps() -> None:
    fields = [f.name for f in dataclasses.fields(SharedSettings) if f.name != "updated_at"]
    assert set(fields) == set(SHARED_SETTING_NAMES), f"name the new shared setting in SHARED_SETTING_NAMES: {fields}"
    claims = [(page, m) for page in hand_written_pages() for m in SHARED_CLAIM.finditer(page.read_text())]
    assert claims, "no page says how many settings are shared"
    for page, match in claims:
        assert NUMBERS[match.group(1).lower()] == len(fields), (str(page.relative_to(ROOT)), match.group(0))
        paragraph = page.read_text()[match.start() :].split("\n\n", 1)[0]
        for field, name in SHARED_SETTING_NAMES.items():
            assert name in paragraph, f"{page.relative_to(ROOT)} does not name {field} ({name}) among them"


# ---- docs/development.md


def layout_paragraph() -> str:
    text = DEVELOPMENT.read_text()
    start = text.index("\nLayout")
    return text[start : text.index("\n\n", start + 1)]


def test_the_layout_names_every_adapter_package_and_no_other() -> None:
    packages = {p.parent.name for p in (ROOT / "relay" / "adapters").glob("*/__init__.py")}
    assert {"rabbitmq", "sqs", "sns", "aws"} <= packages
    # The clause that starts there, up to the next one ("; `sql/` holds ...").
    adapters = layout_paragraph().split("`relay/adapters/` holds", 1)[1].split("; `", 1)[0]
    named = set(re.findall(r"`([a-z_]+)/`", adapters))
    assert named == packages, f"development.md names {sorted(named)}, relay/adapters/ holds {sorted(packages)}"


def test_the_make_test_line_names_every_service_ci_starts() -> None:
    started = re.findall(r'echo "\.ci/run: starting (\w+)', (ROOT / ".ci" / "run").read_text())
    assert {"PostgreSQL", "RabbitMQ"} <= set(started), started
    [line] = [line for line in DEVELOPMENT.read_text().splitlines() if line.startswith("make test ")]
    for service in started:
        assert service in line, f"development.md's make test line leaves out {service}: {line}"


# ---- flags, variables and defaults

FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(\*?)")
SPAN = re.compile(r"`([^`\n]+)`")
# Flags of other programs a page names on their own, outside a command line of theirs.
FOREIGN_FLAGS = {
    "--disable-triggers": "pg_dump and pg_restore",
    "--dupe-window": "the nats command",
    "--relay-dsn": "pytest, with relay.testing's plugin",
}


def relay_flags() -> dict[str, list[click.Parameter]]:
    """Every flag of every `relay` command, with the parameters that declare it."""
    found: dict[str, list[click.Parameter]] = {"--help": []}

    def walk(command: click.Command) -> None:
        for param in command.params:
            for opt in (*param.opts, *getattr(param, "secondary_opts", ())):
                found.setdefault(opt, []).append(param)
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                walk(sub)

    walk(cli)
    return found


def relay_variables() -> set[str]:
    """The variables the relay reads: its options' and click's, and any other the code
    names as a string of its own (the console's token)."""
    names = {o.env for o in ref.declared_options()}

    def walk(command: click.Command) -> None:
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            names.update([envvar] if isinstance(envvar, str) else envvar or ())
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                walk(sub)

    walk(cli)
    for module in (ROOT / "relay").rglob("*.py"):
        names.update(re.findall(r"[\"'](RELAY_[A-Z_]+)[\"']", module.read_text()))
    return names


def named_flags(text: str) -> Iterator[tuple[str, str]]:
    """(flag, the span it is in) for every flag in a code span that is a `relay` command
    line or starts with the flag; spans that run another program are left alone."""
    for span in SPAN.findall(text):
        words = span.split()
        if not words or not (words[0] == "relay" or words[0].startswith("--")):
            continue
        for flag, glob in FLAG.findall(span):
            yield (flag + glob, span)


def test_every_flag_and_variable_a_page_names_is_one_relay_has() -> None:
    flags = relay_flags()
    variables = relay_variables()
    unknown = []
    for page in hand_written_pages():
        text = page.read_text()
        where = str(page.relative_to(ROOT))
        for flag, span in named_flags(text):
            if flag.endswith("*"):
                if not any(f.startswith(flag[:-1]) for f in flags):
                    unknown.append(f"{where}: {flag} in `{span}`")
            elif flag not in flags and flag not in FOREIGN_FLAGS:
                unknown.append(f"{where}: {flag} in `{span}`")
        for span in SPAN.findall(text):
            variable = re.fullmatch(r"(RELAY_[A-Z_]+)(=.*)?", span)  # a name, or one set: not a message quoted
            if variable and variable.group(1) not in variables and not span.startswith("RELAY_TEST_"):
                unknown.append(f"{where}: variable {variable.group(1)}")
    assert not unknown, "\n".join(unknown)


# A default as the pages state it, after a flag or variable in a code span:
#   `--interval` (default 2s)      `--by`, default `user@host`      `--chunk-size`, default 5,000 ids
#   `RELAY_SHUTDOWN_GRACE` (10 s by default)      `--prune-interval`, 1h by default
#   `--shutdown-grace` (10 s)      (`--statement-timeout`, 30 s)      (`--unroutable wait`, the default)
NAME = r"`(--[a-z][a-z0-9-]*|RELAY_[A-Z_]+)( [^`]+)?`"
NUMBER = r"(\d+(?:,\d{3})*(?:\.\d+)?(?: ?[A-Za-z]+)?)"
VALUE = r"(`[^`]+`|\d+(?:,\d{3})*(?:\.\d+)?(?: ?[A-Za-z]+)?|[\w.-]+)"
DEFAULT_FORMS = (
    re.compile(NAME + r",? \(default " + VALUE),
    re.compile(NAME + r", default " + VALUE),
    re.compile(NAME + r",? \(?" + VALUE + r" by default"),
    re.compile(NAME + r" \(" + NUMBER + r"\)"),
    re.compile(NAME + r", " + NUMBER + r"\)"),
    re.compile(r"\(" + NAME + r", the default\)"),
)
DURATION_UNITS = ("ms", "s", "m", "h", "d")
SIZE_UNITS = ("KiB", "MiB", "GiB", "kB", "MB", "GB", "bytes")


@dataclasses.dataclass(frozen=True)
class StatedDefault:
    page: str
    name: str  # the flag or variable
    value: str  # as the page writes it

    def __str__(self) -> str:
        return f"{self.page}: {self.name} defaults to {self.value}"


def stated_defaults(page: str, text: str) -> Iterator[StatedDefault]:
    text = re.sub(r"\s*\n\s*", " ", text)  # a sentence may wrap
    for form in DEFAULT_FORMS:
        for match in form.finditer(text):
            name, inline = match.group(1), match.group(2)
            value = inline.strip() if form is DEFAULT_FORMS[-1] else match.group(3)
            if value:
                yield StatedDefault(page, name, value.strip("`"))


def plain(value: str) -> str:
    """A stated default as its option would read it: thousands separators gone, a size in
    bytes, a duration without its space, a count without its noun (5,000 ids)."""
    value = re.sub(r"(?<=\d),(?=\d{3})", "", value)
    number = re.fullmatch(r"(\d+(?:\.\d+)?) ?([A-Za-z]+)", value)
    if number:
        amount, unit = number.groups()
        if unit in SIZE_UNITS:
            return str(parse_size(amount if unit == "bytes" else amount + unit))
        if unit in DURATION_UNITS:
            return amount + unit
        return amount
    return value


def same(a: Any, b: Any) -> bool:
    if a == b or str(a) == str(b):
        return True
    try:
        return parse_duration(a) == parse_duration(b)
    except ConfigError:
        return False


def check_default(stated: StatedDefault, options: dict[str, Option], flags: dict[str, list[click.Parameter]]) -> str:
    """Why ``stated`` is wrong, or '' when it is the declared default."""
    value = plain(stated.value)
    option = options.get(stated.name)
    if option is not None and len(flags.get(stated.name, ())) > 1:
        option = None  # a flag several commands declare (--by): the page speaks of one of them
    if option is not None:
        try:
            parsed = option.parse(value, "the docs")
        except ConfigError as exc:
            return f"{stated}: not a value of {option.flag} ({exc})"
        if option.default is None and value in option.help:
            return ""  # a default worked out when the command runs: its help says what it is
        declared = option.default if option.default is None else option.parse(option.default, "the code")
        return "" if parsed == declared else f"{stated}, declared {option.default!r}"
    params = flags.get(stated.name)
    if not params:
        return f"{stated}: no such option"
    # A flag several commands declare: the page speaks of one of them.
    for param in params:
        if param.default is None:
            # A default worked out when the command runs: its help says what it is.
            if value in (getattr(param, "help", None) or ""):
                return ""
        elif same(param.default, value):
            return ""
    return f"{stated}, declared {sorted({repr(p.default) for p in params})}"


def declared_by_name() -> dict[str, Option]:
    options: dict[str, Option] = {}
    for o in ref.declared_options():
        options[o.env] = o
        if not o.env_only:
            options[o.flag] = o
    return options


def test_every_default_a_page_states_is_the_declared_one() -> None:
    options, flags = declared_by_name(), relay_flags()
    stated = [
        d for page in hand_written_pages() for d in stated_defaults(str(page.relative_to(ROOT)), page.read_text())
    ]
    assert len(stated) >= 8, [str(d) for d in stated]  # the pages state more: the search must find them
    wrong = [why for d in stated if (why := check_default(d, options, flags))]
    assert not wrong, "\n".join(wrong)


def test_the_default_check_can_fail() -> None:
    options, flags = declared_by_name(), relay_flags()
    text = (
        "`--batch-size` (default 100), `--lease`, default 60s, `--chunk-size`, default 5,000 ids,\n"
        "`RELAY_SHUTDOWN_GRACE` (10 s by default), `--statement-timeout` (30 s), (`--max-attempts`, 12)\n"
        "and (`--unroutable wait`, the default)"
    )
    found = list(stated_defaults("page", text))
    assert sorted((d.name, d.value) for d in found) == [
        ("--batch-size", "100"),
        ("--chunk-size", "5,000 ids"),
        ("--lease", "60s"),
        ("--max-attempts", "12"),
        ("--statement-timeout", "30 s"),
        ("--unroutable", "wait"),
        ("RELAY_SHUTDOWN_GRACE", "10 s"),
    ]
    assert [check_default(d, options, flags) for d in found] == [""] * 7
    wrong = list(stated_defaults("page", "`--batch-size` (default 101) and `--sqs-max-message-size` (default 256 KiB)"))
    assert [bool(check_default(d, options, flags)) for d in wrong] == [True, True]


def test_the_aws_size_limits_are_the_adapters() -> None:
    # SQS's limit is an option (its default checked above), SNS's is fixed.
    text = (DOCS / "destinations" / "message-limits.md").read_text()
    assert f"`--sqs-max-message-size`, default {SQS_MAX_MESSAGE_BYTES:,}" in text
    assert f"SNS: {SNS_MAX_MESSAGE_BYTES:,} bytes" in text
    assert "sns-max-message-size" not in text


# ---- the benchmarks

RATIO = re.compile(r"\d\.\d\d(?:-\d\.\d\d)?x")


def test_the_readmes_benchmark_figures_are_the_benchmarks_pages() -> None:
    readme = RATIO.findall(README.read_text())
    assert len(readme) >= 3, readme
    page = (DOCS / "benchmarks.md").read_text()
    missing = [figure for figure in readme if figure not in page]
    assert not missing, f"the README quotes {missing}, which docs/benchmarks.md does not show"


def test_the_lab_history_stays_out_of_the_site() -> None:
    page = (DOCS / "benchmarks.md").read_text()
    assert "--8<--" not in page, "docs/benchmarks.md includes a file (BENCHMARKS.md is the lab notebook)"
    assert len(page.splitlines()) < 200, "docs/benchmarks.md shows the current figures, not their history"


# ---- pages that stay readable


def table_cells(text: str) -> Iterator[str]:
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line):
            yield from (cell.strip() for cell in line.strip().strip("|").split(" | "))


@pytest.mark.parametrize("page", hand_written_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_table_cell_runs_past_400_characters(page: Path) -> None:
    long = [cell[:80] + "..." for cell in table_cells(page.read_text()) if len(cell) > 400]
    assert not long, f"{page.relative_to(ROOT)}: write these as prose or a list: {long}"


TEST_OR_ISSUE = re.compile(
    r"tests/[\w/]*\.py|\btest_\w+|\bissues? #?\d+|\(#\d+\)|\bfinding \d+|(?-i:BENCHMARKS\.md)", re.IGNORECASE
)


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_user_page_names_no_test_and_no_issue(page: Path) -> None:
    text = re.sub(r"<!--.*?-->", "", page.read_text(), flags=re.S)  # notes to the tests, unseen
    # A code block may show the reader's own tests (how to test a destination of theirs).
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found = sorted({m.group(0) for m in TEST_OR_ISSUE.finditer(text)})
    assert not found, f"{page.relative_to(ROOT)} names {found}: say what and why; the tests are in docs/development.md"


def test_the_page_checks_can_fail() -> None:
    assert list(table_cells("| a | " + "x" * 401 + " |")) == ["a", "x" * 401]
    assert not list(table_cells("| --- | --- |"))
    for text in ("`tests/test_faults.py`", "(issue 38)", "test_failover_to_a_standby", "BENCHMARKS.md, Soak"):
        assert TEST_OR_ISSUE.search(text), text
    assert not TEST_OR_ISSUE.search("make test-faults, a test of its own, the latest issue of the log")
