"""``berth deploy bootstrap`` through the real CLI, and ``Caddyfile.example`` checked by the
real Caddy: ``caddy validate``, then Caddy in front of a real leader, serving its public API
and carrying an agent's link in the reverse-proxy fingerprint mode."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import ssl
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from berth.cluster.pki.ca import CertificateAuthority
from berth.config import SETTINGS_BY_NAME, read_config_file
from berth.keys import hash_secret
from berth.runtime.engines import find_free_port
from berth.store import Store
from support.cluster_harness import Cluster, clean_env, cli, fake_engine_wrapper
from support.fake_llama_server import ANSWER

CADDYFILE = Path(__file__).resolve().parents[1] / "Caddyfile.example"
CADDY = shutil.which("caddy")
needs_caddy = pytest.mark.needs("caddy")  # skipped where missing; a failure under CI=true


def bootstrap(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return cli(home, "deploy", "bootstrap", *args, env=clean_env({}), check=check)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- bootstrap -------------------------------------------------------------------------------


@pytest.mark.slow
def test_bootstrap_writes_a_public_leader_and_prints_its_admin_key_once(tmp_path: Path) -> None:
    home = tmp_path / "leader"

    done = bootstrap(home, "--domain", "API.Example.com", "--cluster-domain",
                     "cluster.example.com", "--leader-only")  # fmt: skip

    values = {k: v.raw for k, v in read_config_file(home / "config.toml").items()}
    expected: dict[str, object] = {
        "public_host": "api.example.com",
        "public_bind": "127.0.0.1",
        "cluster_host": "cluster.example.com",
        "cluster_bind": "0.0.0.0",
    }
    if "leader_only" in SETTINGS_BY_NAME:
        expected["leader_only"] = True
    assert values == expected
    assert _mode(home / "config.toml") == 0o600 and _mode(home / "ca" / "ca.key") == 0o600
    secrets = re.findall(r"sk-berth-\S+", done.stdout)
    assert len(secrets) == 1  # printed once, never again
    with Store(f"sqlite:///{home / 'berth.db'}") as store:
        key = store.find_api_key(hash_secret(secrets[0], (home / "key_pepper").read_bytes()))
        assert key is not None and key.tier == "admin" and key.name == "admin"
    assert "daemon start" in done.stdout and "Caddyfile.example" in done.stdout
    assert "nodes enroll" in done.stdout and "11501" in done.stdout
    # The server certificates exist already and name the new hosts.
    for name, host in (("public.pem", "api.example.com"), ("cluster.pem", "cluster.example.com")):
        ca = CertificateAuthority.load_or_create(home / "ca")
        assert ca.server_certificate_covers(home / "ca" / name, [host])


@pytest.mark.slow
def test_bootstrap_refuses_an_existing_home_and_force_keeps_its_state(tmp_path: Path) -> None:
    home = tmp_path / "leader"
    first = json.loads(bootstrap(home, "--domain", "api.example.com", "--json").stdout)

    again = bootstrap(home, "--domain", "other.example.com", check=False)
    assert again.returncode == 2
    assert "already has" in again.stderr and "--force" in again.stderr
    assert "api.example.com" in (home / "config.toml").read_text()

    forced = json.loads(
        bootstrap(home, "--domain", "other.example.com", "--force", "--json").stdout
    )
    assert forced["ca_fingerprint"] == first["ca_fingerprint"]  # the same CA: agents stay
    assert forced["settings"]["public_host"] == "other.example.com"
    with Store(f"sqlite:///{home / 'berth.db'}") as store:
        assert [k.id for k in store.list_api_keys()] == [
            first["admin_key"]["id"], forced["admin_key"]["id"]
        ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--domain", "https://api.example.com/"], "bare domain"),
        (["--domain", "api.example.com:8443"], "without a port"),
        (["--domain", "203.0.113.7"], "needs a domain name"),
        (["--domain", "-bad-.example.com"], "not a valid domain name"),
        (["--domain", "api.example.com", "--cluster-domain", "a b"], "not a valid domain"),
        ([], "Missing option '--domain'"),
    ],
)
def test_bootstrap_refuses_bad_domains_and_writes_nothing(
    tmp_path: Path, args: list[str], complaint: str
) -> None:
    home = tmp_path / "leader"
    result = bootstrap(home, *args, check=False)
    assert result.returncode == 2
    assert complaint in result.stderr
    assert not (home / "config.toml").exists() and not (home / "berth.db").exists()


# -- Caddyfile.example -----------------------------------------------------------------------


def _fingerprint_block() -> str:
    """The commented-out fingerprint-mode site block of the example, uncommented."""
    lines = CADDYFILE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# cluster.example.com"))
    return "\n".join(line.removeprefix("# ") for line in lines[start:]) + "\n"


def _public_block() -> str:
    """The example's site block for the public API (from its address to its closing brace)."""
    text = CADDYFILE.read_text()
    start = text.index("api.example.com {")
    return text[start : text.index("\n}\n", start) + 3]


def _validate(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert CADDY is not None
    return subprocess.run(
        [CADDY, "validate", "--config", str(config), "--adapter", "caddyfile"],
        capture_output=True, text=True, timeout=60, env=clean_env(env), cwd=config.parent,
    )  # fmt: skip


@needs_caddy
def test_caddy_validates_the_example(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")

    result = _validate(CADDYFILE, {"BERTH_CA_FILE": str(ca.cert_path)})

    assert result.returncode == 0, result.stderr
    assert "Valid configuration" in result.stdout + result.stderr


@needs_caddy
def test_caddy_validates_the_fingerprint_mode_block(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    cert, key = tmp_path / "ca" / "cluster.pem", tmp_path / "ca" / "cluster.key"
    ca.ensure_server_certificate(["cluster.example.com"], cert, key)
    block = _fingerprint_block()
    block = block.replace("/etc/caddy/berth-cluster.pem", str(cert))
    block = block.replace("/etc/caddy/berth-cluster.key", str(key))
    config = tmp_path / "Caddyfile"
    config.write_text(block)

    result = _validate(config, {"BERTH_CA_FILE": str(ca.cert_path)})

    assert result.returncode == 0, result.stderr


# -- Caddy in front of a real leader ---------------------------------------------------------


def _wait_port(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on port {port}")
        time.sleep(0.1)


@contextlib.contextmanager
def running_caddy(root: Path, config: str, env: dict[str, str], port: int) -> Iterator[None]:
    assert CADDY is not None
    path = root / "Caddyfile"
    path.write_text(config)
    log = (root / "caddy.log").open("wb")
    process = subprocess.Popen(
        [CADDY, "run", "--config", str(path), "--adapter", "caddyfile"],
        stdout=log, stderr=subprocess.STDOUT, env=clean_env({**env, "HOME": str(root)}),
        cwd=root,
    )  # fmt: skip
    try:
        _wait_port(port)
        yield
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _local_globals(root: Path) -> str:
    """Caddy's global options for a test: no admin API, no port 80, no system trust store."""
    return (
        "{\n\tadmin off\n\tauto_https disable_redirects\n\tskip_install_trust\n"
        f"\tstorage file_system {root / 'caddy-data'}\n}}\n"
    )


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[Cluster, int]]:
    """A leader in the fingerprint mode, with Caddy in front of both its listeners as the
    example sets it up: ``https://127.0.0.1:PUBLIC`` (a certificate from Caddy's internal
    CA instead of Let's Encrypt) and ``https://127.0.0.1:CLUSTER`` (berth's cluster
    certificate), the leader's own listeners on other loopback ports."""
    wrapper = fake_engine_wrapper(tmp_path)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF" + bytes(60))
    caddy_public, caddy_cluster = find_free_port(), find_free_port()
    env = clean_env(
        {
            "BERTH_LLAMA_SERVER_BIN": str(wrapper),
            "BERTH_STOP_GRACE_S": "5",
            "BERTH_TRUST_FORWARDED_FP": "1",
            # Agents are told to dial Caddy, which forwards to the leader's cluster port.  By
            # name: with client_auth, Caddy wants the TLS server name (SNI, never an IP
            # address) to match the Host header, as it does for cluster.example.com.
            "BERTH_LEADER_URL": f"https://localhost:{caddy_cluster}",
        }
    )
    cluster = Cluster(tmp_path, env)
    cluster.start()
    ca_dir = cluster.leader_home / "ca"
    public = _public_block()
    public = public.replace(
        "api.example.com {", f"https://127.0.0.1:{caddy_public} {{\n\ttls internal"
    )
    public = public.replace("127.0.0.1:11500", f"127.0.0.1:{cluster.public_port}")
    fingerprint = _fingerprint_block()
    fingerprint = fingerprint.replace(
        "cluster.example.com:11501", f"https://localhost:{caddy_cluster}"
    )
    # A cluster certificate from berth's CA for the name agents dial, and no more: berth's own
    # also names 127.0.0.1, which a client without SNI would get from the public site too.
    cert, key = tmp_path / "caddy-cluster.pem", tmp_path / "caddy-cluster.key"
    CertificateAuthority.load_or_create(ca_dir).issue_server_certificate(["localhost"], cert, key)
    fingerprint = fingerprint.replace("/etc/caddy/berth-cluster.pem", str(cert))
    fingerprint = fingerprint.replace("/etc/caddy/berth-cluster.key", str(key))
    fingerprint = fingerprint.replace("127.0.0.1:11502", f"127.0.0.1:{cluster.cluster_port}")
    config = _local_globals(tmp_path) + public + fingerprint
    try:
        with running_caddy(
            tmp_path, config, {"BERTH_CA_FILE": str(ca_dir / "ca.pem")}, caddy_cluster
        ):
            _wait_port(caddy_public)
            yield cluster, caddy_public
    finally:
        cluster.close()


@pytest.mark.slow
@needs_caddy
def test_caddy_fronts_the_api_and_carries_an_agent_by_its_fingerprint(
    proxied: tuple[Cluster, int],
) -> None:
    cluster, caddy_public = proxied
    agent = cluster.add_agent("gpu-a")  # registers and dials through Caddy
    cluster.deploy("tiny", cluster.root / "tiny.gguf", agent)

    # Caddy's certificate comes from its own CA here (Let's Encrypt in production).
    caddy_root = cluster.root / "caddy-data" / "pki" / "authorities" / "local" / "root.crt"
    tls = ssl.create_default_context(cafile=str(caddy_root))
    with httpx.Client(verify=tls, timeout=60) as client:
        answer = client.post(
            f"https://127.0.0.1:{caddy_public}/v1/chat/completions",
            headers={"Authorization": f"Bearer {cluster.api_key}"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == ANSWER
    log = (cluster.leader_home / "logs" / "daemon.log").read_text()
    assert f"node {agent.node_id}: fingerprint forwarded by 127.0.0.1" in log
    assert "trusting x-berth-client-fingerprint from 127.0.0.1/32" in log
