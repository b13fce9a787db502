"""The Prometheus alert rules in deploy/prometheus/alerts.yml: valid for promtool, unit-tested
by promtool on series named as the relay exports them, and over metrics a real relay serves."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.metric_names import (
    ALERT_RULES,
    ROOT,
    PromQLError,
    Query,
    alert_rules,
    parse_query,
    promtool,
    scrape_relay,
    unexported,
)

RULE_TESTS = ROOT / "tests" / "prometheus" / "alerts_test.yml"


def rule_queries() -> list[Query]:
    return [parse_query(rule["expr"]) for rule in alert_rules()]


def rule_tests() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(RULE_TESTS.read_text())
    return loaded


def input_series() -> list[Query]:
    """The unit tests' input series, read as selectors (``name{label="value"}``)."""
    return [parse_query(s["series"]) for case in rule_tests()["tests"] for s in case["input_series"]]


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_rules_accepts_the_file() -> None:
    proc = run_promtool("check", "rules", str(ALERT_RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout, proc.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for case in rule_tests()["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
    alerts = {rule["alert"] for rule in alert_rules()}
    assert len(alerts) == len(alert_rules()) == 10, "every rule is an alert, each named once"
    assert alerts - firing == set(), "alerts no unit test sees firing"
    assert alerts - silent == set(), "alerts no unit test sees silent"
    assert firing | silent == alerts, "unit tests of alerts the file does not have"


def test_promtool_unit_tests_pass() -> None:
    proc = run_promtool("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout, proc.stdout


@pytest.mark.parametrize("alert", [rule["alert"] for rule in alert_rules()])
def test_unit_tests_fail_when_an_alert_does_not_fire(alert: str, tmp_path: Path) -> None:
    # The unit tests can fail: expecting silence where an alert fires is caught, for each alert.
    doc = rule_tests()
    doc["rule_files"] = [str(ALERT_RULES)]
    changed = 0
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            if check["alertname"] == alert and check["exp_alerts"]:
                check["exp_alerts"] = []
                changed += 1
    assert changed
    mutated = tmp_path / "alerts_test.yml"
    mutated.write_text(yaml.safe_dump(doc))
    proc = run_promtool("test", "rules", str(mutated))
    assert proc.returncode != 0, proc.stdout
    assert f"alertname: {alert}" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_metric_names_are_read_out_of_promql() -> None:
    q = parse_query(
        'histogram_quantile(0.99, sum by (le, job) (rate(outbox_relay_publish_seconds_bucket{job=~"a|b"}[5m:1m])))'
        ' / on (job) group_left() max without (instance) (outbox_relay_queue_depth{status="pending"} offset 1h)'
        ' and {__name__="outbox_relay_dead_messages"} > bool 0 unless absent(up{job="x", instance!~"sum(x)"})'
    )
    assert q.metrics == {
        "outbox_relay_publish_seconds_bucket",
        "outbox_relay_queue_depth",
        "outbox_relay_dead_messages",
        "up",
    }
    assert q.grouping == {"le", "job", "instance"}
    depth = next(s for s in q.selectors if s.metric == "outbox_relay_queue_depth")
    assert [(m.label, m.op, m.value) for m in depth.matchers] == [("status", "=", "pending")]
    # Label names, ranges and strings are never metrics; an unknown call is an error, not a name.
    assert parse_query('label_replace(time(), "dst", "$1", "src", "(.*)")').metrics == set()
    with pytest.raises(PromQLError, match="rat"):
        parse_query("rat(outbox_relay_lost_leases_total[5m])")
    with pytest.raises(PromQLError):
        parse_query("sum(outbox_relay_queue_depth{status=})")


def test_rules_and_their_unit_tests_name_what_a_real_relay_exports(relay_dsn: str, names: OutboxNames, db: Db) -> None:
    queries = rule_queries()
    assert all(q.selectors for q in queries), "a rule that reads no series"
    exported = scrape_relay(relay_dsn, names, db)
    problems = unexported(queries, exported) + unexported(input_series(), exported)
    assert not problems, "\n".join(problems)
