"""docs/reference/ is what scripts/docs_reference.py writes from the code as it is now,
and what it writes names every option, command, metric and public name."""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Iterator
from pathlib import Path

import click
import markdown  # MkDocs's own renderer (a dev dependency through mkdocs)
import pytest
from prometheus_client import Counter, generate_latest

import relay
from relay.cli.common import ALL_OPTIONS
from relay.cli.main import cli
from relay.metrics import RelayMetrics
from relay.options import Option
from scripts import docs_reference as ref

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "run `make docs-reference` (python scripts/docs_reference.py) and commit the result"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return ref.build_pages()


def _row(page: str, o: Option) -> str:
    """The one line of the Settings section that anchors ``o``."""
    rows = [line for line in page.splitlines() if f'<a id="{ref.anchor(o)}"></a>' in line]
    assert len(rows) == 1, f"{o.flag}: {len(rows)} rows in {ref.CLI_PAGE}"
    return rows[0]


# ---- the committed pages are current


def test_committed_pages_are_what_the_code_generates(pages: dict[str, str]) -> None:
    stale = ref.stale_messages(pages)
    assert not stale, "; ".join(stale) + f": {REGENERATE}"


def test_the_environment_changes_nothing(pages: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # A variable of a setting, and a terminal width click would otherwise wrap usage lines at.
    monkeypatch.setenv("RELAY_BATCH_SIZE", "7")
    monkeypatch.setenv("RELAY_CONFIG", "/nonexistent.toml")
    monkeypatch.setenv("COLUMNS", "20")
    assert ref.build_pages() == pages


def test_check_names_each_missing_or_stale_page(pages: dict[str, str], tmp_path: Path) -> None:
    assert ref.stale_messages(pages, tmp_path) == [
        f"{path} is missing: run python scripts/docs_reference.py" for path in pages
    ]
    for path, text in pages.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text, encoding="utf-8")
    assert ref.stale_messages(pages, tmp_path) == []
    (tmp_path / ref.CLI_PAGE).write_text(pages[ref.CLI_PAGE] + "edited by hand\n", encoding="utf-8")
    assert ref.stale_messages(pages, tmp_path) == [f"{ref.CLI_PAGE} is stale: run python scripts/docs_reference.py"]


# ---- what the pages hold


def test_every_option_has_a_row_with_its_variable_key_and_bounds(pages: dict[str, str]) -> None:
    page = pages[ref.CLI_PAGE]
    for o in ALL_OPTIONS:
        row = _row(page, o)
        if o.cli_only:
            # No variable and no key to show: the row says so, and names neither.
            assert "(command line only)" in row and "RELAY_" not in row.split("|")[2], (o.flag, row)
            assert f"`{o.flag}`" in row, (o.flag, row)
            continue
        assert f"`{o.env}`" in row, (o.flag, row)
        assert f"`{o.where}`" in row, (o.flag, o.where, row)
        if o.bounds:
            assert f"`{o.bounds}`" in row, (o.flag, o.bounds, row)
        flag = "(environment and file only)" if o.env_only else f"`{o.flag}`"
        assert flag in row, (o.flag, row)
        if o.secret and o.default is not None:
            assert str(o.default) not in row, o.flag


def test_every_declared_option_is_documented(pages: dict[str, str]) -> None:
    # The options of ALL_OPTIONS, and those a command declares beside them (relay grants').
    page = pages[ref.CLI_PAGE]
    for o in ref.declared_options():
        _row(page, o)
    # And the config file's key check knows each one (it reads ALL_OPTIONS): the grant
    # options were once missing from it, so a file that set them was refused.
    unknown = {o.dest for o in ref.declared_options()} - {o.dest for o in ALL_OPTIONS}
    assert not unknown, f"declared but not in relay.cli.common.ALL_OPTIONS: {sorted(unknown)}"


def _command_paths(command: click.Command, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    yield path
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _command_paths(sub, (*path, name))


def test_every_command_has_a_heading(pages: dict[str, str]) -> None:
    lines = pages[ref.CLI_PAGE].splitlines()
    paths = list(_command_paths(cli, ("relay",)))
    assert ("relay", "dead", "list") in paths and ("relay", "settings", "set") in paths
    for path in paths:
        heading = re.compile(rf"^#{{3,4}} {re.escape(' '.join(path))} \{{#{re.escape('-'.join(path))}\}}$")
        assert any(heading.match(line) for line in lines), f"no heading for {' '.join(path)}"


def _exported_names(metrics: RelayMetrics) -> set[str]:
    """Every name a scrape of ``metrics`` shows: the TYPE lines (a labelled series has no
    sample until it is used) and the samples, less prometheus_client's ``_created``."""
    names = set()
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return {n for n in names if not n.endswith("_created")}


def test_every_metric_is_in_the_metrics_page(pages: dict[str, str]) -> None:
    page = pages[ref.METRICS_PAGE]
    metrics = RelayMetrics(outboxes=True).for_outbox("billing")  # a superset of one outbox's series
    metrics.observe_claim(0.01)
    metrics.observe_publish(0.01)
    names = _exported_names(metrics)
    assert {"outbox_relay_messages_total", "outbox_relay_claim_seconds_bucket", "outbox_relay_outbox_held"} <= names
    for name in names:
        assert f"`{name}" in page, name
    assert "aggregate them with `max`" in page


def test_every_public_name_is_in_the_python_api_page(pages: dict[str, str]) -> None:
    page = pages[ref.API_PAGE]
    for name in relay.__all__:
        assert f"\n### {name} {{#{name}}}\n" in page, name


# ---- the pages follow the code, so the staleness test cannot pass vacuously


def test_a_changed_bound_changes_the_cli_page() -> None:
    groups = ref.settings_groups()
    before = ref.render_cli(cli, groups)
    target = next(o for g in groups for o in g.options if o.dest == "batch_size")
    changed = dataclasses.replace(target, maximum=999)
    assert changed.bounds == "1..999" != target.bounds
    groups = tuple(
        dataclasses.replace(g, options=tuple(changed if o is target else o for o in g.options)) for g in groups
    )
    after = ref.render_cli(cli, groups)
    assert after != before
    assert "`1..999`" in _row(after, changed)


def test_a_new_series_changes_the_metrics_page() -> None:
    before = ref.render_metrics(RelayMetrics(), relay.metrics)
    metrics = RelayMetrics()
    Counter("outbox_relay_test_things", "Things.", ["outcome"], registry=metrics.registry)
    after = ref.render_metrics(metrics, relay.metrics)
    assert after != before
    assert "`outbox_relay_test_things_total`" in after


def test_a_new_public_name_changes_the_python_api_page() -> None:
    def undocumented(x: int, *, y: str = "a") -> bool:
        return bool(x)

    module = types.ModuleType("fake", "A fake package.")
    module.__all__ = ["undocumented"]  # type: ignore[attr-defined]
    module.undocumented = undocumented  # type: ignore[attr-defined]
    missing: list[str] = []
    text = ref.render_python_api(module, missing)
    assert "### undocumented {#undocumented}" in text
    assert "def undocumented(x: int, *, y: str = 'a') -> bool" in text
    assert missing == ["undocumented"]


# ---- Markdown


def test_table_cells_keep_their_pipes() -> None:
    row = (ref.inline("a|b and `c|d` and ``e|f``", table=True), ref.code("[x|y]", table=True))
    html = markdown.markdown("\n".join(ref.table(("One", "Two"), [row])), extensions=["tables"])
    cells = re.findall(r"<td>(.*?)</td>", html)
    assert len(cells) == 2, html
    assert cells[0].startswith("a|b and <code>c&#124;d</code>"), html


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (":class:`Outbox` and :meth:`~relay.Inbox.receive`", "`Outbox` and `receive`"),
        ("``x_y`` and *star* and <tag>", "`x_y` and \\*star\\* and &lt;tag>"),
        ("AGGREGATE_ID and _private", "AGGREGATE_ID and \\_private"),
    ],
)
def test_docstring_text(doc: str, expected: str) -> None:
    assert ref.inline(doc) == expected


def test_docstring_fields_become_a_list() -> None:
    blocks = ref.docstring_markdown("Summary.\n\n:param a: first,\n    continued.\n:param b: second.\n\nAfter.")
    assert blocks == ["Summary.", "**Parameters**", "- `a`: first, continued.\n- `b`: second.", "After."]
