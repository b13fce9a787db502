"""The HTTP destination's settings and wire details that need no server: bad input is one
line and exit 2 (never a secret in it), Retry-After in both of its forms, header values
that are not plain ASCII, and the Standard Webhooks signature against the
`standardwebhooks` package's own verification."""

from __future__ import annotations

import base64
import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
from standardwebhooks.webhooks import Webhook

from relay.adapters.header_text import header_value
from relay.adapters.http.classify import classify_status, retry_after
from relay.adapters.http.signing import parse_secrets, signature
from relay.errors import BrokerUnavailable, ConfigError, Defer, PermanentError, RetryableError
from tests.relay_process import assert_one_line_error, relay_env, run_relay

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


def test_retry_after_in_seconds_and_as_a_date_capped() -> None:
    cap = timedelta(minutes=10)
    assert retry_after("120", cap) == timedelta(seconds=120)
    assert retry_after("86400", cap) == cap
    now = 1_800_000_000.0
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now + 30))
    assert retry_after(date, cap, now=now) == timedelta(seconds=30)
    assert retry_after(time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now - 30)), cap, now=now) == timedelta(0)
    assert retry_after("soon", cap) is None and retry_after(None, cap) is None


def test_statuses_sort_into_the_failure_classes() -> None:
    def outcome(status: int, **headers: str) -> type[BaseException] | None:
        result = classify_status(status, headers, b"body", where="https://x/y", cap=timedelta(minutes=1))
        return None if result is None else type(result)

    assert outcome(204) is None
    for status in (408, 409, 425, 429, 500, 502, 503, 504, 507):
        assert outcome(status) is RetryableError, status
    assert outcome(503, **{"Retry-After": "5"}) is Defer
    for status in (400, 403, 404, 410, 413, 422, 501, 505):
        assert outcome(status) is PermanentError, status
    assert outcome(401) is BrokerUnavailable and outcome(301, Location="https://elsewhere") is BrokerUnavailable


def test_an_error_body_is_cut_and_masked() -> None:
    body = ("password=hunter2hunter2 " + "y" * 5000).encode()
    error = str(classify_status(422, {}, body, where="https://x/y", cap=timedelta(minutes=1)))
    assert "hunter2hunter2" not in error and len(error) < 300 and error.endswith("...")


def test_header_values_outside_printable_ascii_are_percent_encoded() -> None:
    assert header_value("order-42") == "order-42"
    assert header_value("Ωmega\r\nInjected: yes") == "%CE%A9mega%0D%0AInjected: yes"
    assert header_value("50%") == "50%25"


def test_the_signature_verifies_with_the_standard_webhooks_package() -> None:
    keys = parse_secrets(f"{SECRET}\nwhsec_{base64.b64encode(b'n' * 24).decode()}", "test")
    body = json.dumps({"order_id": 42}).encode()
    now = int(time.time())
    headers = {
        "webhook-id": "evt-1",
        "webhook-timestamp": str(now),
        "webhook-signature": signature(keys, "evt-1", now, body),
    }
    assert Webhook(SECRET).verify(body, headers) == {"order_id": 42}
    with pytest.raises(ConfigError, match="secret 2 is not whsec_"):
        parse_secrets(f"{SECRET} whsec_!!!", "RELAY_WEBHOOK_SECRET")


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        ((), {}, "no destination URL"),
        (("--url", "ftp://x/y"), {}, "expected an http:// or https:// URL"),
        (
            ("--url", "https://x/y", "--webhook-secret-file", "/nonexistent/secrets"),
            {},
            "cannot read --webhook-secret-file",
        ),
        (("--url", "https://x/y"), {"RELAY_WEBHOOK_SECRET": "whsec_c2hvcnQ="}, "needs at least 16"),
        (("--url", "https://x/y", "--http-timeout", "30s"), {}, "must end inside --publish-timeout"),
        (
            ("--url", "https://x/y"),
            {"RELAY_HTTP_HEADERS": "Authorization Bearer secret-token-1"},
            "expected 'Name: value'",
        ),
        (("--url", "https://x/y"), {"RELAY_HTTP_HEADERS": "Idempotency-Key: mine"}, "written by the relay itself"),
        (("--url", "https://x/y", "--http-client-key", "/etc/hostname"), {}, "needs --http-client-cert"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(
    pg_dsn: str, args: tuple[str, ...], env: dict[str, str], needle: str
) -> None:
    proc = run_relay("start", "--dsn", pg_dsn, "--broker", "http", *args, env=relay_env(**env))
    line = assert_one_line_error(proc, needle)
    assert "secret-token-1" not in line


def test_a_header_file_line_is_named_without_its_value(pg_dsn: str, tmp_path: Path) -> None:
    headers = tmp_path / "headers"
    headers.write_text("X-Api-Key: fine\nAuthorization Bearer tok-abcdefgh\n")
    proc = run_relay(
        "start", "--dsn", pg_dsn, "--broker", "http", "--url", "https://x/y", "--http-header-file", str(headers)
    )
    line = assert_one_line_error(proc, "line 2")
    assert "tok-abcdefgh" not in line


def test_a_static_header_replaces_a_producer_header_of_the_same_name_in_any_case() -> None:
    from relay.adapters.http.publisher import HttpPublisher
    from relay.adapters.http.settings import HttpSettings
    from relay.message import OutboxMessage

    settings = HttpSettings(url="https://api.example.com/hooks", headers={"Authorization": "Bearer static-token"})
    message = OutboxMessage(
        id=7, aggregate_type="order", aggregate_id="Ωmega-1", event_type="OrderPaid", body=b"{}", attempt=1,
        lease_version=1, ordered=False, headers={"authorization": "Bearer producer", "tenant": "t-1"},
        event_id="0b7c8f2e-2f43-4c8e-9a51-5d1f0c3b9e10",
    )  # fmt: skip
    headers = HttpPublisher(settings).headers(message, now=1_800_000_000)
    assert [k for k in headers if k.lower() == "authorization"] == ["Authorization"]
    assert headers["Authorization"] == "Bearer static-token" and headers["tenant"] == "t-1"
    assert headers["Idempotency-Key"] == message.event_id and headers["Relay-Outbox-Id"] == "7"
    assert headers["Relay-Aggregate-Id"] == "%CE%A9mega-1"
