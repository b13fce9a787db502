"""The HTTP destination's rules that need no server: Retry-After read safely whatever it
holds, the floors that keep an answer of "now" from looping, which redirects are followed,
credentials given one way only, producers kept from sending credentials, and every part
of a secret known to the log mask."""

from __future__ import annotations

import base64
import time
import uuid
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.adapters.http import redirects
from relay.adapters.http.classify import classify_status, retry_after
from relay.adapters.http.deferrals import TRACKED_MAX, Deferrals
from relay.adapters.http.publisher import HttpPublisher
from relay.adapters.http.settings import HttpSettings, credential_parts
from relay.backoff import Backoff
from relay.contract import PublishLimits
from relay.decide import Policy
from relay.dsn import mask
from relay.errors import BrokerUnavailable, ConfigError, Defer, NotSent, RetryableError
from relay.message import OutboxMessage
from tests.relay_process import assert_one_line_error, relay_env, run_relay

CAP = timedelta(minutes=10)
LIMITS = PublishLimits(publish_timeout=timedelta(seconds=10), workers=1, batch_size=10)


def message(n: int = 1, **fields: object) -> OutboxMessage:
    return OutboxMessage(
        id=n, aggregate_type="order", aggregate_id=f"a{n}", event_type="OrderPaid", body=b"{}", attempt=1,
        lease_version=1, ordered=False, event_id=f"evt-{n}", **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_retry_after_takes_ascii_digits_only_and_cuts_before_converting() -> None:
    assert retry_after("²", CAP) is None  # str.isdigit() takes it; int() and float() do not
    assert retry_after("١٢", CAP) is None  # Arabic-Indic digits
    assert retry_after("99999999999999999999", CAP) == CAP
    assert retry_after("9" * 100_000, CAP) == CAP
    assert retry_after("0009", CAP) == timedelta(seconds=9)
    assert retry_after(" 0 ", CAP) == timedelta(0)
    assert retry_after("-5", CAP) is None and retry_after("1.5", CAP) is None
    assert retry_after("Fri, 31 Dec 99999 23:59:59 GMT", CAP) is None
    assert retry_after("Mon, 99 Foo 2025 99:99:99 GMT", CAP) is None


# Any text, long runs of digits, and digits that are not ASCII (what str.isdigit() takes).
RETRY_AFTER_VALUES = st.one_of(
    st.text(max_size=60),
    st.from_regex(r"\s*[0-9]{1,40}\s*", fullmatch=True),
    st.text(alphabet=st.characters(whitelist_categories=("Nd", "No")), min_size=1, max_size=5),
)


@given(RETRY_AFTER_VALUES)
def test_retry_after_never_raises_and_stays_within_the_cap(value: str) -> None:
    wait = retry_after(value, CAP, now=time.time())
    assert wait is None or timedelta(0) <= wait <= CAP


@given(RETRY_AFTER_VALUES, st.integers(min_value=300, max_value=599))
def test_no_answer_makes_classify_raise(value: str, status: int) -> None:
    headers = {"Retry-After": value, "Location": value}
    outcome = classify_status(status, headers, value.encode(), where="http://x/y", cap=CAP, url="http://x/y")
    assert outcome is None or isinstance(outcome, Exception)


def test_every_defer_waits_at_least_the_backoff_base_but_not_sent_keeps_its_own_delay() -> None:
    policy = Policy(backoff=Backoff(base=timedelta(seconds=2)))
    now = policy.decide(message(), Defer(timedelta(0), "Retry-After: 0"))
    assert now.kind == "deferred" and now.delay_s == 2.0
    longer = policy.decide(message(), Defer(timedelta(seconds=30), "Retry-After: 30"))
    assert longer.delay_s == 30.0
    held = policy.decide(message(), NotSent(timedelta(milliseconds=200), "rate"))
    assert held.delay_s == 0.2


def test_retry_after_in_a_row_doubles_its_floor_up_to_the_cap_and_another_answer_ends_the_run() -> None:
    deferrals = Deferrals(timedelta(seconds=5))
    m, other = message(1), message(2)

    def wait(outcome: object) -> float:
        assert isinstance(outcome, Defer)
        return outcome.delay.total_seconds()

    asked = Defer(timedelta(0), "answered 503 with Retry-After 0")
    assert [wait(deferrals.paced(m, asked)) for _ in range(5)] == [1, 2, 4, 5, 5]
    assert wait(deferrals.paced(other, asked)) == 1  # each message its own run
    held = NotSent(timedelta(milliseconds=200), "rate")
    assert deferrals.paced(m, held) is held  # held back unsent: no answer, the run goes on
    assert wait(deferrals.paced(m, asked)) == 5
    failed = RetryableError("500")
    assert deferrals.paced(m, failed) is failed
    assert wait(deferrals.paced(m, asked)) == 1  # a new run
    longer = Defer(timedelta(seconds=30), "Retry-After 30")
    assert deferrals.paced(message(3), longer) is longer  # longer than the floor: as asked


def test_deferral_runs_are_bounded() -> None:
    deferrals = Deferrals(CAP)
    for n in range(TRACKED_MAX + 50):
        deferrals.paced(message(n), Defer(timedelta(0), "now"))
    assert len(deferrals._runs) == TRACKED_MAX


def test_only_307_and_308_to_the_same_origin_are_followed() -> None:
    home = "http://api.example.com/hooks?k=1"

    def hop(status: int, location: str, current: str = home) -> object:
        return redirects.next_hop(
            status, {"Location": location}, current, home=home, where="http://api.example.com/hooks"
        )

    assert hop(307, "/v2/hooks?k=1") == redirects.Redirect("http://api.example.com/v2/hooks?k=1")
    assert hop(308, "http://API.example.com:80/v2") == redirects.Redirect("http://API.example.com:80/v2")
    for status in (300, 301, 302, 303, 304):
        outcome = hop(status, "/get-only?key=secretish")
        assert isinstance(outcome, BrokerUnavailable) and "only 307 and 308" in str(outcome)
        assert "http://api.example.com/get-only" in str(outcome) and "secretish" not in str(outcome)
    for elsewhere in ("https://api.example.com/hooks", "http://api.example.com:8080/hooks", "http://evil.example/x"):
        outcome = hop(307, elsewhere)
        assert isinstance(outcome, BrokerUnavailable) and "another origin" in str(outcome), elsewhere
    assert isinstance(hop(307, "http://[::1/broken"), BrokerUnavailable)
    missing = redirects.next_hop(307, {}, home, home=home, where="w")
    assert isinstance(missing, BrokerUnavailable) and "without a Location" in str(missing)


def test_a_shown_url_has_no_user_info_query_or_fragment() -> None:
    assert redirects.shown_url("https://u:p@h.example:8443/a/b?key=zz#frag") == "https://h.example:8443/a/b"
    assert redirects.shown_url("http://h:notaport/x") == redirects.UNREADABLE
    assert redirects.shown_url("http://h/\x1b[31mred") == "http://h/\\x1b[31mred"
    assert len(redirects.shown_url("http://h/" + "x" * 10_000)) < 300


def test_url_credentials_become_one_basic_authorization_and_never_beside_a_static_one() -> None:
    password = "pw-" + uuid.uuid4().hex[:10]
    settings = HttpSettings.from_values({"url": f"https://relay:{password}@api.example.com/hooks"}, LIMITS)
    assert settings.url == "https://api.example.com/hooks"
    encoded = base64.b64encode(f"relay:{password}".encode()).decode()
    assert settings.headers == {"Authorization": f"Basic {encoded}"}
    assert password not in mask(f"echoed {password} and {encoded}")
    both = {"url": f"https://relay:{password}@api.example.com/hooks", "http_headers": "authorization: Bearer t-1234"}
    with pytest.raises(ConfigError, match="one way only") as refused:
        HttpSettings.from_values(both, LIMITS)
    assert password not in str(refused.value)


def test_producer_headers_never_carry_credentials() -> None:
    publisher = HttpPublisher(HttpSettings(url="https://api.example.com/hooks"))
    sent = publisher.headers(
        message(headers={"Authorization": "Bearer x", "PROXY-AUTHORIZATION": "Basic eA==", "cookie": "a=b", "t": "1"}),
        now=1_800_000_000,
    )
    assert {k.lower() for k in sent} & {"authorization", "proxy-authorization", "cookie"} == set()
    assert sent["t"] == "1"


def test_every_credential_part_of_a_static_header_is_known_to_the_mask() -> None:
    token = "tok" + uuid.uuid4().hex
    assert credential_parts("Authorization", f"Bearer {token}") >= {f"Bearer {token}", token}
    assert "Bearer" not in credential_parts("Authorization", f"Bearer {token}")
    basic = base64.b64encode(b"svc:pa55word-x").decode()
    assert credential_parts("Proxy-Authorization", f"Basic {basic}") >= {basic, "svc:pa55word-x", "pa55word-x"}
    assert credential_parts("Cookie", "session=abcdef123; theme=dark") >= {"abcdef123", "session=abcdef123"}
    assert credential_parts("X-Api-Key", "key with spaces") == {"key with spaces"}
    HttpSettings.from_values({"url": "https://x/y", "http_headers": f"Authorization: Bearer {token}"}, LIMITS)
    assert token not in mask(f'{{"error": "token {token} revoked"}}')


def test_every_query_value_of_the_url_is_known_to_the_mask() -> None:
    key, other = "k" + uuid.uuid4().hex, "s" + uuid.uuid4().hex[:8]
    settings = HttpSettings.from_values({"url": f"https://x.example/y?api_key={key}&sig={other}%2B"}, LIMITS)
    assert settings.where == "https://x.example/y"
    assert key not in mask(f"echo {key}") and f"{other}+" not in mask(f"echo {other}+")


@pytest.mark.parametrize(
    ("url", "headers", "needles"),
    [
        ("http://relay:pw-secret-9@x/y", "Authorization: Bearer secret-token-9", ("credentials", "one way only")),
        ("http://relay:pw-secret-9@x:port/y?k=secret-token-9", "", ("invalid --url", "port is malformed")),
    ],
)
def test_credentials_given_twice_or_a_malformed_url_are_refused_at_start(
    pg_dsn: str, url: str, headers: str, needles: tuple[str, ...]
) -> None:
    env = relay_env(RELAY_HTTP_HEADERS=headers) if headers else relay_env()
    proc = run_relay("start", "--dsn", pg_dsn, "--broker", "http", "--url", url, env=env)
    line = assert_one_line_error(proc, *needles)
    assert "secret-token-9" not in line and "pw-secret-9" not in line
