"""The console's parts that need no database: tokens, sessions and the CSRF value; the
history window; the chart's scaling; the action form's parsing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from relay.console.auth import Guard, Token, parse_token
from relay.console.chart import HEIGHT, PAD, WIDTH, line_chart
from relay.console.history import History
from relay.console.hosts import allowed_hosts, answers_to, check_host_name, host_of
from relay.console.pages import ACTION_MAX, action_request, dead_filter
from relay.dsn import mask
from relay.errors import ConfigError
from relay.summary import StatusSummary

SECRET = "0123456789abcdef-secret"


def test_a_token_is_named_or_not_and_its_secret_is_masked_everywhere() -> None:
    assert parse_token(f"alice={SECRET}") == Token("alice", SECRET)
    assert parse_token(SECRET).name == "console"
    assert SECRET not in repr(parse_token(SECRET))
    assert mask(f"the header said {SECRET}") == "the header said ***"


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("short", "at least 16 printable characters"),
        ("alice=" + "x" * 15, "at least 16"),
        ("has space=" + "x" * 20, "the name before '='"),
        ("=" + "x" * 20, "the name before '='"),
        ("bob=" + "x" * 10 + " " + "y" * 10, "without spaces"),
    ],
)
def test_bad_tokens_are_refused_with_one_line(value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_token(value)


def test_the_guard_knows_its_tokens_sessions_and_csrf_values() -> None:
    alice, bob = Token("alice", "a" * 16), Token("bob", "b" * 16)
    guard = Guard((alice, bob))
    assert guard.check_token("b" * 16) == bob
    assert guard.check_token("b" * 15) is None and guard.check_token("") is None and guard.check_token(None) is None
    assert guard.check_token("\udcff" * 16) is None  # not UTF-8 from the form: no crash
    sid = guard.open_session(bob)
    assert guard.session_name(sid) == "bob" and guard.session_name("forged") is None
    assert guard.csrf_ok(sid, guard.csrf_for(sid))
    assert not guard.csrf_ok(sid, None) and not guard.csrf_ok(sid, guard.csrf_for(guard.open_session(alice)))
    # Characters beyond ASCII (compare_digest raises TypeError on such str) are a plain no.
    assert not guard.csrf_ok(sid, "\u00e9" * 64) and not guard.csrf_ok(sid, "\udcff")
    # Another console process (another key) cannot vouch for this one's sessions.
    assert Guard((bob,)).csrf_for(sid) != guard.csrf_for(sid)


def test_a_session_ends_after_its_ttl() -> None:
    guard = Guard((Token("a", "a" * 16),), ttl=timedelta(seconds=-1))
    assert guard.session_name(guard.open_session(guard.tokens[0])) is None


def summary(at: datetime, awaiting: int, age: float | None) -> StatusSummary:
    return StatusSummary(
        at=at, pending_unordered=awaiting, pending_ordered=0, processing=0, expired_leases=0, dead=0,
        oldest_waiting_age_s=age, oldest_dead_age_s=None, blocked_aggregates=0, oldest_blocked_age_s=None,
        waiting_behind_blocked=0, done_estimate=None, total_bytes=None,
    )  # fmt: skip


def test_the_history_keeps_its_window_only() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    history = History(timedelta(minutes=10))
    for minute in range(30):
        history.add(summary(t0 + timedelta(minutes=minute), minute, None))
    kept = history.samples()
    assert [s.awaiting for s in kept] == list(range(19, 30))
    assert kept[-1].oldest_waiting_age_s == 0.0


def test_the_chart_spans_the_box_from_first_sample_to_last() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    chart = line_chart([(t0, 0.0), (t0 + timedelta(seconds=30), 50.0), (t0 + timedelta(seconds=60), 100.0)])
    points = [tuple(map(float, p.split(","))) for p in chart.points.split()]
    assert points[0] == (PAD, HEIGHT - PAD) and points[-1] == (WIDTH - PAD, PAD)
    assert chart.top == 100.0 and chart.last == 100.0 and chart.span_s == 60.0
    assert line_chart([]).points == ""
    flat = line_chart([(t0, 0.0)])
    assert flat.top == 1.0 and flat.count == 1


def test_action_forms_are_checked_before_anything_is_read() -> None:
    req = action_request({"action": "retry", "ids": "4, 2 9", "event_type": "OrderPlaced"})
    assert (req.action, req.ids, req.flt.event_types) == ("retry", (4, 2, 9), ("OrderPlaced",))
    assert action_request({"action": "skip", "group": "0badf00d0badf00d", "reason": " refunded "}).reason == "refunded"
    for form, needle in [
        ({"action": "delete", "ids": "1"}, "invalid action"),
        ({"action": "retry", "ids": "1 x"}, "outbox ids are positive integers"),
        ({"action": "retry", "ids": "99999999999999999999"}, "outbox ids are positive integers"),
        ({"action": "retry", "group": "GROUP"}, "invalid group"),
        ({"action": "retry"}, "nothing to retry"),
        ({"action": "skip", "ids": "1", "reason": "x" * 501}, "invalid reason"),
        ({"action": "skip", "ids": "1", "reason": "a\x00b"}, "invalid reason: it contains a NUL"),
        ({"action": "retry", "ids": "1 2", "versions": "3"}, "one lease_version per id"),
        ({"action": "retry", "ids": "1", "versions": "-3"}, "invalid lease_version"),
        ({"action": "retry", "ids": "1", "versions": "\u0661"}, "invalid lease_version"),
        ({"action": "retry", "ids": " ".join(map(str, range(1, ACTION_MAX + 2)))}, "at most 10,000"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            action_request(form)
    # The confirm step's versions pair up with its ids; without them, no fence (as `relay dead`).
    assert action_request({"action": "retry", "ids": "7 5", "versions": "2 0"}).versions == {7: 2, 5: 0}
    assert action_request({"action": "retry", "ids": "7"}).versions is None
    assert (
        len(action_request({"action": "retry", "ids": " ".join(map(str, range(1, ACTION_MAX + 1)))}).ids) == ACTION_MAX
    )


def test_the_console_answers_to_loopback_names_its_address_and_allow_host_only() -> None:
    # Bound to loopback: loopback names, and what --allow-host adds (a proxy's name).
    assert allowed_hosts("127.0.0.1", ()) == frozenset()
    loopback_only = allowed_hosts("127.0.0.1", ())
    for header in ("127.0.0.1:8465", "localhost:8465", "LOCALHOST", "[::1]:8465", "127.0.0.2"):
        assert answers_to(header, loopback_only), header
    # What DNS rebinding sends: the attacker's own name, whatever it resolves to.
    for header in ("evil.example:8465", "127.0.0.1.evil.example", "", "[", "localhost.evil.example:8465"):
        assert not answers_to(header, loopback_only), header
    proxied = allowed_hosts("127.0.0.1", ("Relay.Example.com",))
    assert answers_to("relay.example.com", proxied) and answers_to("relay.example.com:443", proxied)
    assert not answers_to("evil.example", proxied)
    # Bound to one address: that address too; to a wildcard: any, unless --allow-host names them.
    assert allowed_hosts("10.1.2.3", ()) == frozenset({"10.1.2.3"})
    assert allowed_hosts("fd00::5", ("ops.example",)) == frozenset({"fd00::5", "ops.example"})
    assert answers_to("[fd00::5]:8465", allowed_hosts("fd00::5", ()))
    assert allowed_hosts("0.0.0.0", ()) is None and answers_to("anything.example", None)
    assert allowed_hosts("::", ("ops.example",)) == frozenset({"ops.example"})
    assert host_of("[::1]:8465") == "::1" and host_of("Relay.Example:1") == "relay.example"
    for bad in ("relay.example:8465", "", " ", "a b", "http://x", "x" * 254, "[::1]"):
        with pytest.raises(ConfigError, match="invalid --allow-host"):
            check_host_name(bad)
    with pytest.raises(ConfigError, match="NUL"):
        dead_filter({"error": "a\x00b"})
