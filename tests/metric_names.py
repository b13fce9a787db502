"""What PromQL queries name, checked against what a real relay exports.

The alert rules (deploy/prometheus/alerts.yml), their unit tests' input series and the
Grafana dashboard (deploy/grafana/outbox-relay.json) all name the relay's series; a name
or label spelled differently from the relay's own matches nothing in Prometheus, and an
alert over nothing never fires. This module holds what their tests share:

- :func:`parse_query`: the series selectors (metric name and label matchers) and the
  grouping labels (``by``, ``without``, ``on``, ``ignoring``, ``group_left/right``) of one
  PromQL expression, by a small tokenizer: strings, label-matcher blocks and ranges are
  read as units, so nothing inside them is mistaken for a name, and an identifier followed
  by ``(`` that is not a PromQL function or aggregation is an error, not a metric.
- :func:`scrape_relay`: a real ``relay start --broker log --metrics-port`` that has
  delivered a few messages, and its ``/metrics`` parsed into :class:`Exported`.
- :func:`unexported`: every selector or grouping label of some queries that the scrape
  does not back, as readable lines (empty when all are).
- :func:`alert_rules` and :func:`dashboard`: the two files, loaded.
- :func:`promtool`: the promtool binary, or a skip (a failure under
  ``RELAY_TEST_REQUIRE_SERVICES=1``) when it is not installed.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import tempfile
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from relay.db.names import OutboxNames
from relay.metrics import FAILURE_CLASSES, OUTCOMES, QUEUE_STATUSES
from tests.conftest import Db
from tests.relay_process import RelayProcess, relay_env, wait_until
from tests.services import require_services

ROOT = Path(__file__).resolve().parent.parent
ALERT_RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "outbox-relay.json"

SKIP_PROMTOOL = (
    "promtool not found: install Debian's `prometheus` package (apt-get install --no-install-recommends"
    " prometheus; bash .ci/run does this), which ships /usr/bin/promtool"
)

# Prometheus' own functions (2.42, the Debian 12 package, and a few newer ones): an
# identifier followed by "(" must be one of these or an aggregation below.
FUNCTIONS = frozenset(
    {
        "abs",
        "absent",
        "absent_over_time",
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atanh",
        "avg_over_time",
        "ceil",
        "changes",
        "clamp",
        "clamp_max",
        "clamp_min",
        "cos",
        "cosh",
        "count_over_time",
        "day_of_month",
        "day_of_week",
        "day_of_year",
        "days_in_month",
        "deg",
        "delta",
        "deriv",
        "exp",
        "floor",
        "histogram_count",
        "histogram_fraction",
        "histogram_quantile",
        "histogram_sum",
        "histogram_avg",
        "histogram_stddev",
        "histogram_stdvar",
        "holt_winters",
        "double_exponential_smoothing",
        "hour",
        "idelta",
        "increase",
        "irate",
        "label_join",
        "label_replace",
        "last_over_time",
        "ln",
        "log10",
        "log2",
        "mad_over_time",
        "max_over_time",
        "min_over_time",
        "minute",
        "month",
        "pi",
        "predict_linear",
        "present_over_time",
        "quantile_over_time",
        "rad",
        "rate",
        "resets",
        "round",
        "scalar",
        "sgn",
        "sin",
        "sinh",
        "sort",
        "sort_desc",
        "sort_by_label",
        "sort_by_label_desc",
        "sqrt",
        "stddev_over_time",
        "stdvar_over_time",
        "sum_over_time",
        "tan",
        "tanh",
        "time",
        "timestamp",
        "vector",
        "year",
    }
)
AGGREGATIONS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    }
)
# Binary operators spelled as words, modifiers, and the number literals that look like names.
KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "atan2",
        "bool",
        "offset",
        "inf",
        "nan",
    }
)
GROUPING = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    }
)
# `@ start()` and `@ end()`: modifiers that look like calls.
AT_FUNCTIONS = frozenset({"start", "end"})

# Labels Prometheus itself attaches to every scraped series, and the series it makes per target.
TARGET_LABELS = frozenset({"job", "instance"})
SYNTHETIC_SERIES = {"up": TARGET_LABELS, "scrape_duration_seconds": TARGET_LABELS}

# The relay's label vocabularies that are fixed sets (relay.metrics): a matcher on one of
# these labels must match a value the relay can export.
VOCABULARIES: dict[str, frozenset[str]] = {
    "outcome": frozenset(OUTCOMES),
    "status": frozenset(QUEUE_STATUSES),
    "error_class": frozenset(FAILURE_CLASSES),
}

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>0[xX][0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?(?:[a-zA-Z]+[0-9]*)*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<punct>[(){}\[\],@]|=~|!~|!=|==|<=|>=|[-+*/%^<>=])
    """,
    re.VERBOSE,
)


class PromQLError(ValueError):
    """An expression this reader cannot take apart (or that names an unknown function)."""


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # =, !=, =~, !~
    value: str


@dataclass(frozen=True)
class Selector:
    """One series selector: ``metric{label op "value", ...}``."""

    metric: str
    matchers: tuple[Matcher, ...] = ()


@dataclass(frozen=True)
class Query:
    """What one expression names: its selectors and the labels it groups or matches on."""

    expr: str
    selectors: tuple[Selector, ...]
    grouping: frozenset[str]

    @property
    def metrics(self) -> frozenset[str]:
        return frozenset(s.metric for s in self.selectors)


def _tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"cannot read {expr[pos : pos + 20]!r} at {pos} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        if kind != "space":
            out.append((kind, m.group()))
    return out


def _unquote(token: str) -> str:
    if token.startswith("`"):
        return token[1:-1]
    return re.sub(r"\\(.)", r"\1", token[1:-1])


def _matchers(tokens: list[tuple[str, str]], i: int, expr: str) -> tuple[tuple[Matcher, ...], int]:
    """The matchers of the ``{...}`` block opening at ``tokens[i]``, and the index after it."""
    found = []
    i += 1
    while tokens[i][1] != "}":
        if tokens[i][1] == ",":
            i += 1
            continue
        (lkind, label), (_, op), (vkind, value) = tokens[i : i + 3]
        if lkind not in ("ident", "string") or op not in ("=", "!=", "=~", "!~") or vkind != "string":
            raise PromQLError(f"cannot read the label matchers in {expr!r}")
        found.append(Matcher(_unquote(label) if lkind == "string" else label, op, _unquote(value)))
        i += 3
    return tuple(found), i + 1


def _group_labels(tokens: list[tuple[str, str]], i: int, expr: str) -> tuple[list[str], int]:
    """The labels of the ``(a, b)`` list at ``tokens[i]`` (none if there is no list)."""
    if i >= len(tokens) or tokens[i][1] != "(":
        return [], i  # group_left without labels
    labels = []
    i += 1
    while tokens[i][1] != ")":
        kind, text = tokens[i]
        if kind == "ident":
            labels.append(text)
        elif kind == "string":
            labels.append(_unquote(text))
        elif text != ",":
            raise PromQLError(f"cannot read a label list in {expr!r}")
        i += 1
    return labels, i + 1


def parse_query(expr: str) -> Query:
    """The selectors and grouping labels of the PromQL expression ``expr``."""
    try:
        return _parse(expr)
    except (IndexError, ValueError) as exc:
        if isinstance(exc, PromQLError):
            raise
        raise PromQLError(f"cannot read {expr!r}: {exc}") from None


def _parse(expr: str) -> Query:
    tokens = _tokens(expr)
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text == "[":  # a range or subquery: durations and Grafana's $__rate_interval
            i = next(j for j in range(i, len(tokens)) if tokens[j][1] == "]") + 1
        elif text == "{":  # a selector without a name outside: {__name__="..."}
            matchers, i = _matchers(tokens, i, expr)
            names = [m.value for m in matchers if m.label == "__name__" and m.op == "="]
            if len(names) != 1:
                raise PromQLError(f"a selector without one exact __name__ in {expr!r}")
            selectors.append(Selector(names[0], tuple(m for m in matchers if m.label != "__name__")))
        elif kind != "ident":
            i += 1
        elif text in GROUPING:
            labels, i = _group_labels(tokens, i + 1, expr)
            grouping.update(labels)
        elif text in KEYWORDS or text in AGGREGATIONS:
            i += 1
        elif following == "(":
            previous = tokens[i - 1][1] if i else ""
            if text not in FUNCTIONS and not (previous == "@" and text in AT_FUNCTIONS):
                raise PromQLError(f"{text}() is no PromQL function (in {expr!r})")
            i += 1
        elif following == "{":
            matchers, i = _matchers(tokens, i + 1, expr)
            selectors.append(Selector(text, matchers))
        else:
            selectors.append(Selector(text))
            i += 1
    return Query(expr, tuple(selectors), frozenset(grouping))


# Grafana's built-in interval variables, as a query would see them once Grafana expanded them.
GRAFANA_BUILTINS = {
    "$__rate_interval": "1m",
    "$__interval": "30s",
    "$__range": "6h",
    "${__rate_interval}": "1m",
    "${__interval}": "30s",
    "${__range}": "6h",
}


def grafana_expanded(expr: str) -> str:
    """``expr`` with Grafana's interval variables replaced as Grafana would; a dashboard
    variable left anywhere but inside a quoted matcher value is an error (Prometheus would
    not parse it)."""
    for var, value in GRAFANA_BUILTINS.items():
        expr = expr.replace(var, value)
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    if "$" in outside_strings:
        raise PromQLError(f"a Grafana variable outside a label value in {expr!r}")
    return expr


@dataclass
class Exported:
    """A relay's scrape: each sample name (``outbox_relay_messages_total``, ``..._bucket``)
    with the label names and values it carries."""

    labels: dict[str, set[str]] = field(default_factory=dict)
    values: dict[tuple[str, str], set[str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Exported:
        exported = cls()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                exported.labels.setdefault(sample.name, set()).update(sample.labels)
                for label, value in sample.labels.items():
                    exported.values.setdefault((sample.name, label), set()).add(value)
        return exported

    def labels_of(self, metric: str) -> set[str] | None:
        """The labels ``metric`` has once Prometheus scraped it (None when it is not exported)."""
        if metric in SYNTHETIC_SERIES:
            return set(SYNTHETIC_SERIES[metric])
        if metric not in self.labels:
            return None
        return self.labels[metric] | TARGET_LABELS


def _value_problem(metric: str, m: Matcher) -> str | None:
    """Why matcher ``m`` can never match a value of a fixed vocabulary (None if it can)."""
    known = VOCABULARIES.get(m.label)
    if known is None or "$" in m.value:  # free-form label, or a Grafana variable
        return None
    if m.op == "=" and m.value not in known:
        return f"{metric}: {m.label}={m.value!r} is none of {sorted(known)}"
    if m.op == "=~" and not any(re.fullmatch(m.value, v) for v in known):
        return f"{metric}: {m.label}=~{m.value!r} matches none of {sorted(known)}"
    return None


def unexported(queries: Iterable[Query], exported: Exported) -> list[str]:
    """One line for each metric, matcher label, matcher value or grouping label of
    ``queries`` that ``exported`` does not back."""
    problems = []
    for q in queries:
        available: set[str] = set()
        for s in q.selectors:
            labels = exported.labels_of(s.metric)
            if labels is None:
                problems.append(f"{s.metric} is not in the relay's /metrics (in {q.expr!r})")
                continue
            available |= labels
            for m in s.matchers:
                if m.label not in labels:
                    problems.append(f"{s.metric} has no label {m.label!r} (in {q.expr!r})")
                elif (problem := _value_problem(s.metric, m)) is not None:
                    problems.append(f"{problem} (in {q.expr!r})")
        # `by (le)` over a histogram's buckets, `by (destination)` over the breaker gauge:
        # a grouping label must be on some series the expression reads.
        missing = q.grouping - available
        if missing and q.selectors:
            problems.append(f"grouping on {sorted(missing)}, which none of its series carries (in {q.expr!r})")
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        body: bytes = r.read()
        return body.decode()


# Messages the relay delivers before the scrape, so the counters labelled by event type and
# outcome have series (a labelled counter has none until its first event).
DELIVERED = 5


def scrape_relay(relay_dsn: str, names: OutboxNames, db: Db) -> Exported:
    """Start a real relay with the log broker and a metrics port, let it deliver
    :data:`DELIVERED` messages and read its gauges once, and return its /metrics.

    The relay serves the outbox as the one entry of a config's ``[[outboxes]]``: a process
    serving several outboxes exports every series a process serving one does, with the
    ``outbox`` label on each and the held gauge besides (relay.metrics), so what the rules
    and the dashboard may name is all there."""
    port = free_port()
    config = Path(tempfile.mkdtemp(prefix="relay-scrape-")) / "relay.toml"
    config.write_text(
        f'broker = "log"\npoll_interval = "100ms"\nmetrics_port = {port}\nmetrics_host = "127.0.0.1"\n'
        f'\n[[outboxes]]\nname = "scrape"\ndsn = "{relay_dsn}"\nschema = "{names.schema}"\n'
    )
    args = ["start", "--config", str(config)]
    with RelayProcess(*args, env=relay_env()) as relay:
        db.insert((f"scrape-{i}", "OrderPaid", {"i": i}) for i in range(DELIVERED))
        url = f"http://127.0.0.1:{port}/metrics"
        text = ""

        def delivered_and_read() -> bool:
            nonlocal text
            assert relay.running(), relay.tail()
            try:
                text = _get(url)
            except OSError:
                return False  # not listening yet
            e = Exported.parse(text)
            published = e.values.get(("outbox_relay_messages_total", "outcome"), set())
            refreshed = [
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "outbox_relay_gauges_refreshed_timestamp_seconds"
            ]
            return "published" in published and bool(refreshed) and refreshed[0] > 0

        assert wait_until(delivered_and_read, timeout=30), f"no delivery in the scrape:\n{text}\n{relay.tail()}"
        assert relay.stop() == 0
        relay.assert_clean_exit()
    return Exported.parse(text)


def promtool() -> str:
    """The promtool binary; skip without it, fail without it in CI."""
    path = shutil.which("promtool")
    if path is None:
        if require_services():
            pytest.fail(SKIP_PROMTOOL)
        pytest.skip(SKIP_PROMTOOL)
    return path


def alert_rules() -> list[dict[str, Any]]:
    """Every rule of deploy/prometheus/alerts.yml, over all its groups."""
    doc = yaml.safe_load(ALERT_RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    """deploy/grafana/outbox-relay.json, parsed."""
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded
