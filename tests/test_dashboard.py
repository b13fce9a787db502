"""The Grafana dashboard deploy/grafana/outbox-relay.json: the structure Grafana imports, queries
Prometheus parses, and over series a real relay exports (the alert rules' series among them)."""

from __future__ import annotations

import re
import subprocess
from itertools import combinations
from pathlib import Path
from typing import Any

import yaml

from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.metric_names import (
    Query,
    alert_rules,
    dashboard,
    grafana_expanded,
    parse_query,
    promtool,
    scrape_relay,
    unexported,
)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PANEL_TYPES = {"timeseries", "stat", "state-timeline", "gauge", "bargauge", "table"}
# What an operator opens the dashboard for (issue 16): a panel whose title names each.
EXPECTED_PANELS = (
    "Throughput by outcome",
    "Publish latency",
    "Oldest pending age",
    "Depth by status",
    "Dead",
    "Blocked aggregates",
    "Expired leases",
    "Expired and lost leases",
    "Circuit breakers",
    "Relays up",
)
# Grafana's `label_values(selector, label)` variable query.
LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$")


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def variable_queries() -> list[tuple[Query, str]]:
    """Each query variable's selector and the label it lists values of."""
    found = []
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = LABEL_VALUES.match(query)
            assert m, f"variable {var['name']}: not a label_values() query: {query!r}"
            found.append((parse_query(m["selector"]), m["label"]))
    return found


def queries() -> list[Query]:
    return [parse_query(grafana_expanded(e)) for e in exprs()] + [q for q, _ in variable_queries()]


def test_dashboard_has_the_structure_grafana_imports() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"] and d["id"] is None
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), ids
    boxes = []
    for p in d["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert g["h"] > 0 and g["w"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        boxes.append((p["title"], g))
    for (a, ga), (b, gb) in combinations(boxes, 2):
        apart = (
            ga["x"] + ga["w"] <= gb["x"]
            or gb["x"] + gb["w"] <= ga["x"]
            or ga["y"] + ga["h"] <= gb["y"]
            or gb["y"] + gb["h"] <= ga["y"]
        )
        assert apart, f"panels {a!r} and {b!r} overlap"
    for p in panels():
        assert p["type"] in PANEL_TYPES, p["type"]
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"].strip(), p["title"]
    titles = {p["title"] for p in panels()}
    assert set(EXPECTED_PANELS) <= titles, set(EXPECTED_PANELS) - titles


def test_every_query_parses_in_prometheus(tmp_path: Path) -> None:
    # Each query as a recording rule: promtool parses it with Prometheus' own PromQL parser.
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_expanded(e)} for i, e in enumerate(exprs())]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout, proc.stdout


def test_dashboard_shows_every_series_the_alerts_use() -> None:
    alerting = set().union(*(parse_query(r["expr"]).metrics for r in alert_rules()))
    shown = set().union(*(q.metrics for q in queries()))
    assert alerting - shown == set()


def test_dashboard_queries_name_what_a_real_relay_exports(relay_dsn: str, names: OutboxNames, db: Db) -> None:
    exported = scrape_relay(relay_dsn, names, db)
    problems = unexported(queries(), exported)
    for query, label in variable_queries():
        for s in query.selectors:
            if label not in (exported.labels_of(s.metric) or set()):
                problems.append(f"variable lists {label!r}, which {s.metric} does not carry")
    assert not problems, "\n".join(problems)
