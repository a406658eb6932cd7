"""The web console's parts that need no browser: sign-in sessions, the session cookie, the
ring of recent requests, and the proxy filling it. The console in a real browser against a
real leader: ``test_console_browser.py``."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from berth.admin.console import ConsoleGate
from berth.admission import Admission, UsageLedger
from berth.admission.errors import KeyExpiredError
from berth.auth.authenticator import Authenticator
from berth.config import TierTable
from berth.console import static_files
from berth.console.sessions import (
    COOKIE_NAME,
    SessionTable,
    clear_cookie,
    session_id_from_cookies,
    set_cookie,
)
from berth.errors import AuthError
from berth.keys import generate_secret, hash_secret, key_prefix
from berth.observability.metrics import ProxyMetrics
from berth.observability.request_log import RequestLog
from berth.store import Store
from support.proxy_fixtures import StaticResolver, running_proxy
from support.standin_engine import StandinEngine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_is_found_by_its_id_and_only_a_digest_is_kept() -> None:
    table = SessionTable(clock=Clock())
    session_id, session = table.create(key_id="k1", key_name="ops", key_hash="h")
    assert table.get(session_id) is session
    assert session_id not in repr(table.__dict__)
    assert table.get("not-a-session") is None
    assert table.get(None) is None


def test_a_session_ends_after_its_idle_timeout_and_its_max_age() -> None:
    clock = Clock()
    table = SessionTable(clock=clock, idle_timeout_s=60, max_age_s=300)
    session_id, _ = table.create(key_id="k1", key_name="ops", key_hash="h")
    for _ in range(4):  # used every 59 s: still alive at 236 s
        clock.now += 59
        assert table.get(session_id) is not None
    clock.now += 59 + 10  # 305 s after sign-in: past max age, though used recently
    assert table.get(session_id) is None
    idle_id, _ = table.create(key_id="k1", key_name="ops", key_hash="h")
    clock.now += 60
    assert table.get(idle_id) is None
    assert len(table) == 0


def test_revoking_a_key_drops_its_sessions_only() -> None:
    table = SessionTable(clock=Clock())
    first, _ = table.create(key_id="k1", key_name="a", key_hash="h1")
    second, _ = table.create(key_id="k1", key_name="a", key_hash="h1")
    other, _ = table.create(key_id="k2", key_name="b", key_hash="h2")
    assert table.drop_key("k1") == 2
    assert table.get(first) is None and table.get(second) is None
    assert table.get(other) is not None


def test_sign_out_drops_the_session() -> None:
    table = SessionTable(clock=Clock())
    session_id, _ = table.create(key_id="k1", key_name="a", key_hash="h")
    assert table.drop(session_id)
    assert not table.drop(session_id)
    assert table.get(session_id) is None


def test_the_table_is_bounded_and_drops_the_least_recently_used() -> None:
    clock = Clock()
    table = SessionTable(clock=clock, max_sessions=2)
    old, _ = table.create(key_id="k", key_name="a", key_hash="h")
    kept, _ = table.create(key_id="k", key_name="a", key_hash="h")
    assert table.get(old) is not None  # used: now the most recent
    table.create(key_id="k", key_name="a", key_hash="h")
    assert len(table) == 2
    assert table.get(old) is not None
    assert table.get(kept) is None


def test_the_csrf_token_must_match_exactly() -> None:
    _, session = SessionTable(clock=Clock()).create(key_id="k", key_name="a", key_hash="h")
    assert session.csrf_matches(session.csrf_token)
    assert not session.csrf_matches(None)
    assert not session.csrf_matches(session.csrf_token[:-1])
    assert not session.csrf_matches("")


def test_the_cookie_is_httponly_secure_and_strict() -> None:
    cookie = set_cookie("abc", 3600)
    assert cookie.startswith(f"{COOKIE_NAME}=abc;")
    for attribute in ("HttpOnly", "Secure", "SameSite=Strict", "Path=/", "Max-Age=3600"):
        assert attribute in cookie
    assert "Max-Age=0" in clear_cookie()


@pytest.mark.parametrize(
    ("headers", "found"),
    [
        ([(b"cookie", b"berth_session=abc")], "abc"),
        ([(b"cookie", b"theme=dark; berth_session=x-y_z; other=1")], "x-y_z"),
        ([(b"cookie", b"theme=dark"), (b"cookie", b"berth_session=late")], "late"),
        ([(b"cookie", b"berth_session=")], None),
        ([(b"cookie", b"not_berth_session=abc")], None),
        ([(b"authorization", b"Bearer sk")], None),
    ],
)
def test_the_session_cookie_is_read_among_others(
    headers: list[tuple[bytes, bytes]], found: str | None
) -> None:
    assert session_id_from_cookies(headers) == found


def test_the_console_files_ship_inside_the_package() -> None:
    names = {item.name for item in static_files().iterdir()}
    assert {"index.html", "app.js", "style.css"} <= names
    html = (static_files() / "index.html").read_text()
    # The strict CSP allows no inline code: every script and style is a file of ours.
    assert "<script>" not in html and "style=" not in html and "<style" not in html
    assert "http://" not in html and "https://" not in html  # nothing from elsewhere


def test_the_chart_library_is_vendored_with_its_licence_and_every_file_is_ours() -> None:
    """uPlot (from npm) ships beside the console with its MIT licence; every script and
    stylesheet the page names is a file the leader serves, and no script fetches anything
    from elsewhere."""
    folder = static_files()
    html = (folder / "index.html").read_text()
    named = re.findall(r'(?:src|href)="/ui/([^"]+)"', html)
    assert {"uPlot.iife.min.js", "uPlot.min.css", "charts.js", "overview.js", "app.js"} <= set(
        named
    )
    assert all((folder / name).is_file() for name in named), named
    assert named.index("uPlot.iife.min.js") < named.index("charts.js") < named.index("app.js")
    licence = (folder / "uPlot.LICENSE.txt").read_text()
    assert "MIT" in licence and "Leon Sorokin" in licence
    assert (
        (folder / "uPlot.iife.min.js")
        .read_text()
        .startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
    )
    for script in ("uPlot.iife.min.js", "charts.js", "overview.js", "app.js"):
        text = (folder / script).read_text()
        assert not re.search(r"fetch\(\s*[\"'`]https?:", text), script


# -- the ring of recent requests -------------------------------------------------------------


def _add(log: RequestLog, n: int) -> None:
    log.add(
        started_at=float(n), request_id=f"r{n}", key_name="k", model="m", status=200,
        duration_s=0.5,
    )  # fmt: skip


def test_the_ring_keeps_only_the_newest_entries() -> None:
    log = RequestLog(capacity=3)
    for n in range(5):
        _add(log, n)
    assert [e.request_id for e in log.after(0)] == ["r2", "r3", "r4"]
    assert log.last_seq == 5
    assert [e.request_id for e in log.after(3)] == ["r3", "r4"]
    assert log.after(5) == []
    assert [e.request_id for e in log.after(0, limit=1)] == ["r4"]
    assert log.after(0, limit=0) == []


def test_a_ring_holds_at_least_one_entry() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        RequestLog(capacity=0)


def test_times_are_kept_in_milliseconds() -> None:
    log = RequestLog()
    entry = log.add(
        started_at=1.0, request_id="r", key_name="", model="m", status=200,
        ttfb_s=0.0123, duration_s=0.5,
    )  # fmt: skip
    assert (entry.ttfb_ms, entry.duration_ms) == (12.3, 500.0)


async def test_the_proxy_logs_each_request_without_its_text(
    engine: StandinEngine, resolver: StaticResolver, metrics: ProxyMetrics
) -> None:
    log = RequestLog()
    async with (
        running_proxy(resolver, metrics, request_log=log) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        served = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "secret words"}]},
        )
        refused = await client.post("/v1/chat/completions", json={"model": "nope"})
    assert served.status_code == 200 and refused.status_code == 404
    first, second = log.after(0)
    assert (first.model, first.status, first.retries, first.error_reason) == ("m", 200, (), None)
    assert first.deployment_id and first.ttfb_ms is not None
    assert (second.model, second.status, second.node_id) == ("nope", 404, "")
    assert second.error_reason == "model_not_found"
    assert "secret words" not in repr(log.after(0))


# -- the gate: sign-in with a key from the store ---------------------------------------------

PEPPER = b"p" * 32


def _key(store: Store, name: str, tier: str) -> tuple[str, str]:
    secret = generate_secret()
    record = store.add_api_key(name, tier, hash_secret(secret, PEPPER), key_prefix(secret))
    return secret, record.id


def _gate(store: Store, authenticator: Authenticator | None = None) -> ConsoleGate:
    admission = Admission(TierTable({}), UsageLedger(store))
    authenticator = authenticator or Authenticator(store, PEPPER)
    return ConsoleGate(store, authenticator, PEPPER, check_expiry=admission.check_expiry)


async def test_an_admin_key_signs_in_and_its_revocation_ends_the_session(store: Store) -> None:
    gate = _gate(store)
    secret, key_id = _key(store, "ops", "admin")
    session_id, session = await gate.sign_in(secret)
    assert session.key_name == "ops" and secret not in repr(session)
    found = await gate.session(session_id)
    assert found is not None and found[1].id == key_id
    store.revoke_api_key(key_id)
    assert await gate.session(session_id) is None
    assert len(gate.sessions) == 0


async def test_an_expired_admin_key_cannot_sign_in_and_its_sessions_end(store: Store) -> None:
    authenticator = Authenticator(store, PEPPER)
    gate = _gate(store, authenticator)
    secret, key_id = _key(store, "ops", "admin")
    session_id, _ = await gate.sign_in(secret)
    past = datetime.now(UTC) - timedelta(seconds=1)
    store.update_api_key(key_id, expires_at=past)  # what the admin API does: change the key,
    authenticator.forget([key_id])  # then drop it (an expiry reached later needs neither)

    with pytest.raises(KeyExpiredError, match="expired") as refused:
        await gate.sign_in(secret)
    assert refused.value.http_status == 401
    assert await gate.session(session_id) is None  # the session it had before ends too
    assert len(gate.sessions) == 0


async def test_a_standard_or_unknown_key_cannot_sign_in(store: Store) -> None:
    gate = _gate(store)
    secret, _ = _key(store, "app", "standard")
    with pytest.raises(AuthError, match="standard key") as refused:
        await gate.sign_in(secret)
    assert refused.value.http_status == 403
    with pytest.raises(AuthError) as unknown:
        await gate.sign_in("sk-berth-not-a-key")
    assert unknown.value.http_status == 401
    assert len(gate.sessions) == 0
