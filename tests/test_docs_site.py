"""The documentation: the site builds in strict mode (a broken link, a missing anchor, a
page left out of the navigation or a stale include fails it), the README stays a front
page whose links resolve, and no page carries a hand-written table of options or metrics:
those live in docs/reference/, generated from the code (tests/test_docs_reference.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# A Markdown link's target, and where the README's must lead.
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A table row whose first cell is a flag, an environment variable of the relay's or a
# metric: the start of a table that repeats the option declarations or relay/metrics.py.
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
