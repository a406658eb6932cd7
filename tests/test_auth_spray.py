"""A real leader (``berth daemon start``, a subprocess) on real TLS under a spray of bad keys:
past ``auth_failure_burst`` failures an address is refused 429 with ``Retry-After`` on
``/v1``, ``/admin``, ``/metrics`` and the console's sign-in, in the OpenAI error shape,
audited once; a key already used from the same address is still served, and so is one
created meanwhile; the Unix socket, which needs no key, is not limited."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from berth.keys import generate_secret
from berth.runtime.engines import find_free_port

pytestmark = pytest.mark.slow

BURST = 5
RATE_PER_S = 0.01  # one token back every 100 s: the lockout outlasts the test


@dataclass(frozen=True)
class Leader:
    home: Path
    port: int
    standard: str
    admin: str
    tls: ssl.SSLContext

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


def _berth(home: Path, *args: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "berth", "--home", str(home), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def spray_leader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Leader]:
    home = tmp_path_factory.mktemp("spray-leader")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    env.update(
        BERTH_DRAIN_S="0",  # the stop closes at once (no load balancer here)
        BERTH_AUTH_FAILURE_BURST=str(BURST),
        BERTH_AUTH_FAILURE_RATE_PER_S=str(RATE_PER_S),
        BERTH_LEADER_ONLY="1",  # no engines needed here
    )
    port = find_free_port()
    _berth(
        home,
        "daemon",
        "start",
        "--public-port",
        str(port),
        "--cluster-port",
        str(find_free_port()),
        env=env,
    )
    try:
        standard = json.loads(_berth(home, "key", "create", "app", "--json", env=env))
        admin = json.loads(
            _berth(home, "key", "create", "ops", "--tier", "admin", "--json", env=env)
        )
        tls = ssl.create_default_context(cafile=str(home / "ca" / "ca.pem"))
        yield Leader(home, port, standard["secret"], admin["secret"], tls)
    finally:
        subprocess.run(
            [sys.executable, "-m", "berth", "--home", str(home), "daemon", "stop"],
            capture_output=True,
            timeout=60,
            env=env,
        )


def _bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def _refused_429(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.headers.get("connection") != "close"  # an answer, not a failed connection
    assert 0 < int(response.headers["retry-after"]) <= 1 / RATE_PER_S
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error"
    assert error["message"] == "too many failed API key attempts from this address"


def test_a_spray_of_bad_keys_is_refused_while_good_keys_are_served(spray_leader: Leader) -> None:
    with httpx.Client(base_url=spray_leader.url, verify=spray_leader.tls, timeout=30.0) as http:
        # The good keys are used once before the spray: from then on they are known valid.
        assert http.get("/v1/models", headers=_bearer(spray_leader.standard)).status_code == 200
        assert http.get("/admin/keys", headers=_bearer(spray_leader.admin)).status_code == 200

        for _ in range(BURST):
            bad = http.get("/v1/models", headers=_bearer(generate_secret()))
            assert bad.status_code == 401 and bad.json()["error"]["message"] == "invalid API key"
        for path in ("/v1/models", "/admin/keys", "/metrics"):
            _refused_429(http.get(path, headers=_bearer(generate_secret())))
        _refused_429(http.post("/ui/session", json={"key": generate_secret()}))

        # The same address with a good key: served on every surface.
        assert http.get("/v1/models", headers=_bearer(spray_leader.standard)).status_code == 200
        metrics = http.get("/metrics", headers=_bearer(spray_leader.standard))
        assert metrics.status_code == 200
        assert 'berth_auth_refusals_total{reason="rate_limited"} 4.0' in metrics.text
        assert "berth_auth_key_reads_total" in metrics.text
        assert http.get("/admin/keys", headers=_bearer(spray_leader.admin)).status_code == 200
        # No key at all is a plain 401, as before: it costs no lookup and counts for nothing.
        assert http.get("/v1/models").status_code == 401
        signed_in = http.post("/ui/session", json={"key": spray_leader.admin})
        assert signed_in.status_code == 201, signed_in.text
        http.cookies.clear()

        # The Unix socket needs no key and is not limited; a key created there now is
        # served on its first use from the refused address.
        transport = httpx.HTTPTransport(uds=str(spray_leader.home / "berth.sock"))
        with httpx.Client(transport=transport, base_url="http://berth", timeout=30.0) as local:
            assert local.get("/admin/keys").status_code == 200
            created = local.post("/admin/keys", json={"name": "late"})
            assert created.status_code == 201, created.text
        late = http.get("/v1/models", headers=_bearer(created.json()["secret"]))
        assert late.status_code == 200, late.text

    audit_log = (spray_leader.home / "logs" / "audit.log").read_text().splitlines()
    lines = [json.loads(line) for line in audit_log]
    limited = [line for line in lines if line["event"] == "auth.rate_limited"]
    assert len(limited) == 1, limited  # one line per window, not one per refusal
    assert limited[0]["source_address"] == "127.0.0.1"
    assert limited[0]["surface"] == "v1" and limited[0]["burst"] == BURST
