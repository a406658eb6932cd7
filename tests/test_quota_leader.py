"""Quotas on a real leader: the real CLI and daemon, real TLS, the official OpenAI SDK, and
``tests/fake_llama_server.py`` as the engine (it reports usage ``USAGE`` on every answer, and
in a stream only when ``stream_options.include_usage`` asks, as llama-server does).

It shows what issue 15 asks: a key limited to 3 requests per minute gets ``RateLimitError``
on the fourth, with OpenAI's rate-limit headers, and the SDK's retry waits as told; a token
budget stops a key once spent; a key limited to one model gets 403 for another; an expired
key gets 401; the usage ledger's totals equal the usage the engine reported, streamed or
not, asked for or not, and survive a restart; ``berth usage --csv`` parses; bad input is
refused with its reason.
"""

from __future__ import annotations

import csv
import io
import re
import ssl
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from berth.runtime.engines import find_free_port
from support.berth_cli import Berth, running_daemon
from support.cluster_harness import TINY_GGUF_BYTES, clean_env, fake_engine_wrapper
from support.fake_llama_server import USAGE, stream_events

openai = pytest.importorskip("openai")

MODEL = "m"
PER_REQUEST = USAGE[0] + USAGE[1]
TIERS = """
[tiers.three]
priority = 20
rpm = 3
"""
#: Exit code of a refusal of bad input (ConfigError).
EXIT_CONFIG = 2


@pytest.fixture(scope="module")
def quota_leader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Berth, int]]:
    """One daemon for the module, with the tier ``three`` (3 requests per minute) in its
    config.toml and the fake engine serving ``m``."""
    work = tmp_path_factory.mktemp("quota")
    model = work / "tiny.gguf"
    model.write_bytes(TINY_GGUF_BYTES)
    env = clean_env(
        {
            "BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(work)),
            "BERTH_HEALTH_TIMEOUT_S": "30",
            "COLUMNS": "200",
        }
    )
    berth = Berth(work / "home", env=env, cwd=work)
    berth.home.mkdir()
    (berth.home / "config.toml").write_text(TIERS)
    with running_daemon(berth) as port:
        berth("models", "add", MODEL, "--path", str(model))
        berth("run", MODEL)
        yield berth, port


class Clients:
    """OpenAI SDK clients for the leader, trusting its CA; all closed at the test's end."""

    def __init__(self) -> None:
        self.opened: list[Any] = []

    def __call__(self, berth: Berth, port: int, secret: str, *, max_retries: int = 0) -> Any:
        tls = ssl.create_default_context(cafile=str(berth.home / "ca" / "ca.pem"))
        client = openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1",
            api_key=secret,
            http_client=openai.DefaultHttpxClient(verify=tls),
            max_retries=max_retries,
        )
        self.opened.append(client)
        return client


@pytest.fixture
def sdk() -> Iterator[Clients]:
    clients = Clients()
    try:
        yield clients
    finally:
        for client in clients.opened:
            client.close()


def create_key(berth: Berth, name: str, *flags: str) -> str:
    secret: str = berth.json("key", "create", name, *flags)["secret"]
    return secret


def chat(client: Any, model: str = MODEL, **extra: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], **extra
    )


def test_the_fourth_request_in_a_minute_gets_rate_limit_error_with_openais_headers(
    quota_leader: tuple[Berth, int], sdk: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    berth, port = quota_leader
    client = sdk(berth, port, create_key(berth, "three-a-minute", "--tier", "three"))
    answers = [chat(client) for _ in range(3)]

    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    assert answers[0].headers["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-limit-tokens" not in answers[0].headers  # no tokens-per-minute limit
    with pytest.raises(openai.RateLimitError) as caught:
        chat(client)
    refused = caught.value
    assert (refused.status_code, refused.code, refused.type) == (
        429,
        "rpm_exceeded",
        "rate_limit_error",
    )
    headers = refused.response.headers
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert 18 <= int(headers["retry-after"]) <= 20  # one request flows back every 20 s
    assert re.fullmatch(r"\d+(\.\d+)?s|1m0s", headers["x-ratelimit-reset-requests"])

    # The SDK's own retry waits as told (its sleep recorded, not slept).
    waits: list[float] = []
    clock = SimpleNamespace(sleep=waits.append, time=time.time)
    monkeypatch.setattr(openai._base_client, "time", clock)
    with pytest.raises(openai.RateLimitError):
        chat(sdk(berth, port, client.api_key, max_retries=1))
    assert len(waits) == 1 and 17 < waits[0] <= 20


def test_a_token_budget_stops_the_key_once_spent(
    quota_leader: tuple[Berth, int], sdk: Clients
) -> None:
    berth, port = quota_leader
    client = sdk(berth, port, create_key(berth, "budget", "--daily-tokens", str(PER_REQUEST + 1)))
    chat(client)  # under the budget before, over it after
    chat(client)
    with pytest.raises(openai.RateLimitError) as caught:
        chat(client)

    assert caught.value.code == "daily_tokens_exceeded"
    assert "today (UTC)" in caught.value.message
    seconds_to_midnight = 86400 - time.time() % 86400
    assert abs(int(caught.value.response.headers["retry-after"]) - seconds_to_midnight) < 60
    (listed,) = [k for k in berth.json("key", "ls") if k["name"] == "budget"]
    assert listed["use"]["day_tokens"] == 2 * PER_REQUEST
    assert listed["limits"]["daily_tokens"] == PER_REQUEST + 1
    assert listed["overridden"] == ["daily_tokens"]


def test_a_key_limited_to_one_model_gets_403_for_another(
    quota_leader: tuple[Berth, int], sdk: Clients
) -> None:
    berth, port = quota_leader
    client = sdk(berth, port, create_key(berth, "one-model", "--models", MODEL))
    chat(client)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        chat(client, model="other-model")

    assert caught.value.code == "model_not_allowed"
    assert "may not use the model 'other-model'" in caught.value.message


def test_an_expired_key_gets_401(quota_leader: tuple[Berth, int], sdk: Clients) -> None:
    berth, port = quota_leader
    secret = create_key(berth, "short-lived")
    soon = datetime.now(UTC) + timedelta(seconds=2)
    berth.admin("PATCH", "/admin/keys/short-lived", json={"expires_at": soon.isoformat()})
    client = sdk(berth, port, secret)
    while datetime.now(UTC) <= soon:
        time.sleep(0.2)
    with pytest.raises(openai.AuthenticationError) as caught:
        chat(client)
    assert caught.value.code == "key_expired"


def test_the_ledger_equals_the_engines_usage_and_survives_a_restart(
    quota_leader: tuple[Berth, int], sdk: Clients
) -> None:
    berth, port = quota_leader
    secret = create_key(berth, "ledger")
    client = sdk(berth, port, secret)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    tls = ssl.create_default_context(cafile=str(berth.home / "ca" / "ca.pem"))
    with httpx.Client(verify=tls, timeout=10) as http:
        # A stream that did not ask for usage: berth asked the engine, and kept the extra
        # event to itself; the rest is the engine's answer byte for byte.
        relayed = http.post(
            f"https://127.0.0.1:{port}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {secret}"},
        ).content
    assert relayed == b"".join(stream_events(MODEL, include_usage=False))
    assert b'"usage"' not in relayed

    seen = []
    for _ in range(2):
        seen.append(chat(client).parse().usage)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    seen += [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(seen) == 3
    prompt = sum(u.prompt_tokens for u in seen) + USAGE[0]  # + the stream that did not ask
    completion = sum(u.completion_tokens for u in seen) + USAGE[1]

    report = berth.json("usage", "--key", "ledger", "--by", "key")
    (row,) = report["rows"]
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
        4,
        prompt,
        completion,
    )
    assert (row["errors"], row["estimated_requests"], row["key"]) == (0, 0, "ledger")

    berth("daemon", "stop")
    berth("daemon", "start", "--public-port", str(port), "--cluster-port", str(find_free_port()))
    after = berth.json("usage", "--key", "ledger", "--by", "key")  # read from the store
    assert after["rows"] == report["rows"]
    berth("run", MODEL)  # a clean stop stopped the engine; the next tests need it

    lines = list(csv.reader(io.StringIO(berth("usage", "--by", "model", "--csv").stdout)))
    header, *rows = lines
    assert header[:3] == ["model", "requests", "errors"]
    assert [r[0] for r in rows] == [MODEL]
    assert int(rows[0][header.index("total_tokens")]) >= (prompt + completion)


def test_an_engine_without_usage_is_counted_as_an_estimate(
    quota_leader: tuple[Berth, int], sdk: Clients
) -> None:
    berth, port = quota_leader
    client = sdk(berth, port, create_key(berth, "estimated"))
    chat(client, extra_body={"x_no_usage": True})
    list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"x_no_usage": True},
        )
    )
    (row,) = berth.json("usage", "--key", "estimated", "--by", "key")["rows"]

    assert (row["requests"], row["estimated_requests"]) == (2, 2)
    assert row["estimated_tokens"] == row["total_tokens"] > 0


def metric(berth: Berth, port: int, secret: str, line_start: str) -> float | None:
    """The sum of the ``/metrics`` samples whose line starts with ``line_start`` (``None``
    when there is none)."""
    answer = httpx.get(
        f"https://127.0.0.1:{port}/metrics",
        headers={"authorization": f"Bearer {secret}"},
        verify=ssl.create_default_context(cafile=str(berth.home / "ca" / "ca.pem")),
    )
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in answer.text.splitlines()
        if line.startswith(line_start)
    ]
    return sum(values) if values else None


def test_a_request_beyond_the_deployments_slots_waits_at_the_leader_for_its_turn(
    quota_leader: tuple[Berth, int], sdk: Clients
) -> None:
    berth, port = quota_leader
    berth("models", "add", "one-slot", "--path", "tiny.gguf")
    berth("run", "one-slot", "--extra-arg=--parallel", "--extra-arg=1")  # 1 engine slot
    secret = create_key(berth, "queued")
    client = sdk(berth, port, secret)
    depth = 'berth_admission_queue_depth{model="one-slot"}'
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(chat, client, "one-slot", extra_body={"x_head_delay_s": 2})
        busy = "berth_proxy_in_flight_requests{"
        deadline = time.monotonic() + 30
        while not (metric(berth, port, secret, busy) or 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        second = pool.submit(chat, client, "one-slot")
        while metric(berth, port, secret, depth) != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(berth, port, secret, depth) == 1  # the second waits at the leader
        assert first.result().http_response.status_code == 200
        assert second.result().http_response.status_code == 200
    assert metric(berth, port, secret, depth) is None
    waited = 'berth_admission_queue_wait_seconds_count{model="one-slot"}'
    assert metric(berth, port, secret, waited) == 1


@pytest.mark.slow
def test_a_services_capacity_holds_its_replicas_and_a_larger_one_lets_a_waiter_in_at_once(
    quota_leader: tuple[Berth, int], sdk: Clients, tmp_path: Path
) -> None:
    berth, port = quota_leader
    # llama.cpp's default is 4 slots; the service's setting holds each replica to 1.
    berth("service", "create", "held", "--model", MODEL, "--capacity", "1")
    berth("route", "create", "held-route", "--service", "held")
    berth("service", "deploy", "held")
    secret = create_key(berth, "held-key")
    client = sdk(berth, port, secret)
    depth = 'berth_admission_queue_depth{model="held-route"}'
    release = tmp_path / "release-the-first"  # the engine holds the first until it exists
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(chat, client, "held-route", extra_body={"x_hold_file": str(release)})
        try:
            deadline = time.monotonic() + 30
            busy = "berth_proxy_in_flight_requests{"
            while not (metric(berth, port, secret, busy) or 0) and time.monotonic() < deadline:
                time.sleep(0.02)
            second = pool.submit(chat, client, "held-route")
            while metric(berth, port, secret, depth) != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert metric(berth, port, secret, depth) == 1  # held to the service's capacity
            berth("service", "scale", "held", "--capacity", "2")  # no restart
            assert second.result().http_response.status_code == 200
            assert not first.done()  # the second went in beside it, not after it
        finally:
            release.touch()
        assert first.result().http_response.status_code == 200


def test_malformed_bodies_are_refused_and_leave_a_one_at_a_time_key_free(
    quota_leader: tuple[Berth, int], sdk: Clients
) -> None:
    # Issue 38: a streamed chat holding a lone surrogate failed with a 500 after admission
    # (the usage rewrite could not encode it) and kept a key of --max-concurrency 1 refused
    # with 429 until the leader restarted.
    berth, port = quota_leader
    secret = create_key(berth, "one-at-a-time", "--max-concurrency", "1")
    tls = ssl.create_default_context(cafile=str(berth.home / "ca" / "ca.pem"))
    flood = b'{"model":"m","messages":[' + b"[]," * 500_000 + b"[]]}"
    bodies = {
        b'{"model":"m","stream":true,"stream_options":{"include_usage":false},'
        b'"messages":[{"role":"user","content":"\\ud800"}]}': (400, "invalid_json"),
        b'{"model":"m","stream":"true","messages":[]}': (400, "invalid_type"),
        b'{"model":"m","temperature":1e400,"messages":[]}': (400, "invalid_json"),
        flood: (413, "too_many_elements"),
    }
    with httpx.Client(
        base_url=f"https://127.0.0.1:{port}",
        verify=tls,
        headers={"authorization": f"Bearer {secret}"},
    ) as http:
        for body, (status, code) in bodies.items():
            answer = http.post("/v1/chat/completions", content=body)
            assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
    served = chat(sdk(berth, port, secret), stream=True)  # at once: nothing kept its place
    assert served.status_code == 200


def test_keys_are_changed_listed_and_revoked_by_name(quota_leader: tuple[Berth, int]) -> None:
    berth, _ = quota_leader
    create_key(berth, "changing", "--tier", "three", "--tpm", "50k")
    changed = berth.json("key", "set", "changing", "--rpm", "unlimited", "--clear", "tpm")
    assert changed["limits"]["rpm"] is None and changed["limits"]["tpm"] is None
    assert changed["overridden"] == ["rpm"]
    back = berth.json("key", "set", "changing", "--clear", "all", "--tier", "standard")
    assert back["overridden"] == [] and back["tier"] == "standard"

    create_key(berth, "listed-three", "--tier", "three")  # its own: no other test's key
    listed = berth("key", "ls").stdout
    rows = [line for line in listed.splitlines() if "listed-three" in line]
    assert len(rows) == 1, listed
    (row,) = rows
    cells = row.split()  # ID NAME TIER PREFIX RPM ...: none of these is empty or has a space
    assert cells[2:5] == ["three", cells[3], "3"]  # its tier's rpm, not its own (no *)
    revoked = berth("key", "revoke", "changing").stdout
    assert "revoked k-" in revoked and "(changing)" in revoked
    error = berth.fails("key", "set", "changing", "--rpm", "5")
    assert "revoked" in error


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("key", "create", "x", "--tier", "gold"), "unknown tier 'gold'; tiers: admin, standard"),
        (("key", "create", "x", "--rpm", "-1"), "--rpm: rpm must not be negative"),
        (("key", "create", "x", "--tpm", "lots"), "--tpm: tpm must be a whole number"),
        (("key", "create", "x", "--expires", "2020-01-01"), "--expires: 2020-01-01T00:00:00+00"),
        (("key", "set", "nobody", "--rpm", "5"), "API key 'nobody' not found"),
        (("key", "set", "three-a-minute"), "nothing to change"),
        (("usage", "--since", "yesterday"), "--since: 'yesterday' is neither"),
        (("usage", "--by", "week"), "--by: 'week': use one of day, key, model, node"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_with_the_reason(
    quota_leader: tuple[Berth, int], args: tuple[str, ...], reason: str
) -> None:
    berth, _ = quota_leader
    assert reason in berth.fails(*args, exit_code=EXIT_CONFIG)


def test_a_malformed_tier_stops_the_start_naming_the_file_and_line(tmp_path: Path) -> None:
    berth = Berth(tmp_path / "home", env=clean_env({}), cwd=tmp_path)
    berth.home.mkdir()
    config = berth.home / "config.toml"
    config.write_text("[tiers.free]\nrpm = 3\ntpm = -5\n")

    error = berth.fails(
        "daemon", "start", "--public-port", "0", "--cluster-port", "0", exit_code=EXIT_CONFIG
    )
    assert f"{config}:3: [tiers.free]: tpm must not be negative" in error
