"""The documentation: the site builds in strict mode (a broken link, a missing anchor, a
page left out of the navigation or a stale include fails it), the README stays a front
page whose links resolve, and no page carries a hand-written table of options or metrics:
those live in docs/reference/, generated from the code (tests/test_docs_reference.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from relay.cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# A Markdown link's target, and where the README's must lead.
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A table row whose first cell is a flag, an environment variable of the relay's or a
# metric: the start of a table that repeats the option declarations or relay/metrics.py.
# A code block, and what in one of its lines is a synopsis rather than a command
# (`relay status [--json]`, `relay start ...`, `retry|skip`, `<schema>`).
# In other blocks (sample sessions), a line that starts with the prompt `$ ` is a command.
CODE_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)
SHELLS = {"sh", "bash", "shell"}
SYNOPSIS = re.compile(r"\[|\.\.\.|\||<")
HAND_WRITTEN_ROW = re.compile(r"^\|\s*(?:`--[a-z]|`?RELAY_[A-Z]|`?outbox_relay_[a-z]|\(no flag\))")


def hand_written_pages() -> list[Path]:
    return [README, *(p for p in sorted(DOCS.rglob("*.md")) if "reference" not in p.relative_to(DOCS).parts)]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    proc = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    # The quick start page includes the README's section: the include resolved.
    page = (tmp_path / "site" / "getting-started" / "index.html").read_text()
    assert "Five minutes" in page and "--8&lt;--" not in page


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move reference material to docs/"
    assert lines[0] == "# outbox-relay"
    head = "\n".join(lines[:8])
    assert "make demo" in head and "make test" in head


def test_every_relative_link_of_the_readme_resolves() -> None:
    # The README is not part of the site (mkdocs checks the pages' links); GitHub shows it.
    for target in LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links {target}, which does not exist"


@pytest.mark.parametrize("page", hand_written_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_hand_written_table_of_options_or_metrics(page: Path) -> None:
    rows = [line for line in page.read_text().splitlines() if HAND_WRITTEN_ROW.match(line)]
    assert not rows, (
        f"{page.relative_to(ROOT)} lists options or metrics by hand; link docs/reference/ instead: {rows[:3]}"
    )


def test_the_table_check_can_fail() -> None:
    assert HAND_WRITTEN_ROW.match("| `--batch-size` | `RELAY_BATCH_SIZE` | 100 | rows one claim leases |")
    assert HAND_WRITTEN_ROW.match("| `outbox_relay_lost_leases_total` | counter | ... |")
    assert HAND_WRITTEN_ROW.match("| (no flag) | `RELAY_WEBHOOK_SECRET` | none | ... |")
    assert not HAND_WRITTEN_ROW.match("| `relay prune --older-than` | deleted once `done_at` is older |")


def relay_command_lines() -> Iterator[tuple[str, str]]:
    """Every ``relay ...`` command in the code blocks of the README and the docs, as (page,
    command): continuation lines joined, comments, ``VAR=value`` prefixes, redirections and
    ``;``-separated neighbours taken apart; synopses left out."""
    for page in hand_written_pages():
        for lang, block in CODE_BLOCK.findall(page.read_text()):
            lines = block.replace("\\\n", " ").splitlines()
            if lang not in SHELLS:
                lines = [line[2:] for line in lines if line.startswith("$ ")]
            for line in lines:
                for command in re.split(r";|&&", line.split(" #", 1)[0]):
                    command = command.split(" >", 1)[0].strip()
                    words = command.split()
                    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                        words.pop(0)
                    if words[:1] == ["relay"] and not SYNOPSIS.search(command):
                        yield str(page.relative_to(ROOT)), " ".join(words)


def parse_command(command: str) -> None:
    """Parse ``command`` as `relay` would, down to its subcommand, running nothing: an
    unknown command or option, a missing value or a bad choice raises a click error."""
    args = shlex.split(command)[1:]
    command_obj: click.Command = cli
    ctx = cli.make_context("relay", args)
    while isinstance(command_obj, click.Group):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            return
        name, sub, sub_args = command_obj.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        command_obj, ctx = sub, sub.make_context(name, sub_args, parent=ctx)


def test_every_relay_command_in_the_docs_parses() -> None:
    commands = list(relay_command_lines())
    assert len(commands) >= 20, commands  # the pages hold more: the search must find them
    failures = []
    for page, command in commands:
        try:
            parse_command(command)
        except click.ClickException as exc:
            failures.append(f"{page}: {command}: {exc.format_message()}")
    assert not failures, "\n".join(failures)


def test_the_command_check_can_fail() -> None:
    with pytest.raises(click.ClickException):
        parse_command("relay start --broker sqs --queue-urll https://example.com/q")
    with pytest.raises(click.ClickException):
        parse_command("relay dead frobnicate 1")
    parse_command("relay dead list --limit 5")


PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
# `async with` and `await` at a snippet's top level read as inside a coroutine.
ALLOW_TOP_LEVEL_AWAIT = 0x2000


def python_blocks() -> Iterator[tuple[str, str]]:
    for page in hand_written_pages():
        for block in PYTHON_BLOCK.findall(page.read_text()):
            yield str(page.relative_to(ROOT)), block


def test_every_python_block_compiles_and_imports_what_relay_exports() -> None:
    # Snippets use names of the reader's (conn, message): compiled, not run; the README's
    # quick start runs whole in test_quickstart.py.
    import ast

    import relay

    blocks = list(python_blocks())
    assert len(blocks) >= 6, blocks
    for page, block in blocks:
        tree = compile(block, page, "exec", flags=ast.PyCF_ONLY_AST | ALLOW_TOP_LEVEL_AWAIT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "relay":
                for alias in node.names:
                    assert alias.name in relay.__all__, (
                        f"{page} imports {alias.name} from relay, which it does not export"
                    )
