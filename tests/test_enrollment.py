"""Enrollment end to end on real TLS sockets: the cluster listener (aiohttp on loopback, a
temporary CA) and ``register_agent``, the code ``berth agent register`` runs."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sqlalchemy import text

from berth.agent.identity import client_ssl_context, load_agent_identity
from berth.agent.registration import register_agent
from berth.cluster.leader.listener import (
    ClusterListener,
    build_cluster_app,
    cluster_ssl_context,
    cluster_tls_files,
)
from berth.cluster.pki.ca import CertificateAuthority, fingerprint_of_der, fingerprint_of_pem
from berth.cluster.pki.enrollment import (
    TOKEN_VALIDITY_S,
    AuditLog,
    EnrollmentService,
    EnrollmentURI,
    RegistrationRateLimiter,
    audit_token_hash,
    validate_node_label,
)
from berth.cluster.pki.peer_identity import peer_certificate_der
from berth.errors import AuthError, ConfigError, RateLimitError
from berth.paths import BerthHome
from berth.store import Store
from support.leader_home import leader_home
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

PEPPER = b"p" * 32


class Clock:
    """Epoch seconds that only move when a test says so."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Leader:
    home: BerthHome
    ca: CertificateAuthority
    store: Store
    enrollment: EnrollmentService
    clock: Clock
    url: str

    def uri(self, label: str) -> EnrollmentURI:
        return self.enrollment.issue_token(label).uri

    def store_token_hashes(self) -> list[str]:
        with self.store.engine.connect() as db:
            return list(db.execute(text("SELECT token_hash FROM enrollment_tokens")).scalars())

    def audit_lines(self) -> list[dict[str, object]]:
        if not self.home.audit_log.exists():
            return []
        return [json.loads(line) for line in self.home.audit_log.read_text().splitlines()]


async def _whoami(request: web.Request) -> web.StreamResponse:
    """Stand-in for the hub: says which client certificate the TLS layer saw."""
    der = peer_certificate_der(request)
    return web.json_response({"fingerprint": fingerprint_of_der(der) if der else None})


@pytest.fixture
async def enrollment_leader(tmp_path: Path) -> AsyncIterator[Leader]:
    made = leader_home(tmp_path)
    home, ca, store, sock, url = made.home, made.ca, made.store, made.sock, made.url
    clock = Clock()
    enrollment = EnrollmentService(
        store=store,
        ca=ca,
        pepper=PEPPER,
        cluster_url=url,
        audit=AuditLog(home.audit_log),
        clock=clock,
    )
    app = build_cluster_app(
        enrollment=enrollment, ca_pem=ca.cert_pem, agent_handler=_whoami, monotonic=clock
    )
    tls = cluster_ssl_context(ca, *cluster_tls_files(ca, "127.0.0.1", home.ca_dir))
    listener = ClusterListener(app, sock, tls)
    await listener.start()
    try:
        yield Leader(home, ca, store, enrollment, clock, url)
    finally:
        await listener.stop()
        store.close()


def _agent_home(tmp_path: Path, name: str = "agent") -> BerthHome:
    return BerthHome(tmp_path / name)


async def test_registration_writes_a_private_identity_named_by_the_leader(
    enrollment_leader: Leader, tmp_path: Path
) -> None:
    home = _agent_home(tmp_path)
    uri = enrollment_leader.uri("gpu-1")

    identity = await asyncio.to_thread(register_agent, uri, home)

    assert stat.S_IMODE(home.agent_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.agent_config.stat().st_mode) == 0o600
    assert home.agent_ca.read_bytes() == enrollment_leader.ca.cert_pem
    assert load_agent_identity(home) == identity
    assert (identity.label, identity.leader_url) == ("gpu-1", enrollment_leader.url)
    cert = x509.load_pem_x509_certificate(home.agent_cert.read_bytes())
    (cn,) = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    node = enrollment_leader.store.get_node_by_label("gpu-1")
    assert cn.value == node.id == identity.node_id
    assert node.status == "unreachable"
    assert node.cert_fingerprint == fingerprint_of_pem(home.agent_cert.read_bytes())

    # The agent's mTLS context reaches the agent endpoint, which sees the same certificate.
    async with httpx.AsyncClient(verify=client_ssl_context(identity)) as client:
        seen = (await client.get(f"{enrollment_leader.url}/cluster/agent")).json()
    assert seen["fingerprint"] == node.cert_fingerprint
    (line,) = enrollment_leader.audit_lines()
    assert line["outcome"] == "enrolled" and line["node_id"] == node.id
    assert line["source_address"] == "127.0.0.1"
    assert line["token_hash"] == audit_token_hash(uri.token, PEPPER)
    assert line["token_hash"] == enrollment_leader.store_token_hashes()[0][:16]


async def test_a_token_works_once(enrollment_leader: Leader, tmp_path: Path) -> None:
    uri = enrollment_leader.uri("gpu-1")
    await asyncio.to_thread(register_agent, uri, _agent_home(tmp_path, "a"))

    with pytest.raises(AuthError, match="already used"):
        await asyncio.to_thread(register_agent, uri, _agent_home(tmp_path, "b"))

    assert not _agent_home(tmp_path, "b").agent_config.exists()
    lines = enrollment_leader.audit_lines()
    assert [line["outcome"] for line in lines] == ["enrolled", "refused"]
    assert lines[1]["reason"] == "used"
    assert lines[0]["token_hash"] == lines[1]["token_hash"]  # the same token, told apart


async def test_an_expired_token_is_refused(enrollment_leader: Leader, tmp_path: Path) -> None:
    uri = enrollment_leader.uri("gpu-1")
    enrollment_leader.clock.now += TOKEN_VALIDITY_S + 1

    with pytest.raises(AuthError, match="expired"):
        await asyncio.to_thread(register_agent, uri, _agent_home(tmp_path))

    assert [line["reason"] for line in enrollment_leader.audit_lines()] == ["expired"]


async def test_a_ca_fingerprint_mismatch_stops_before_any_csr(
    enrollment_leader: Leader, tmp_path: Path
) -> None:
    uri = enrollment_leader.uri("gpu-1")
    wrong = replace(uri, ca_fingerprint="sha256:" + "0" * 64)

    with pytest.raises(AuthError, match="does not match"):
        await asyncio.to_thread(register_agent, wrong, _agent_home(tmp_path, "a"))

    assert enrollment_leader.audit_lines() == [], "no registration attempt may reach the leader"
    assert not _agent_home(tmp_path, "a").root.exists()
    # The token was not spent.
    await asyncio.to_thread(register_agent, uri, _agent_home(tmp_path, "b"))


async def test_registration_is_rate_limited_per_address(
    enrollment_leader: Leader, tmp_path: Path
) -> None:
    uri = enrollment_leader.uri("gpu-1")
    bad = replace(uri, token="not-a-token-at-all")
    for _ in range(10):
        with pytest.raises(AuthError, match="unknown enrollment token"):
            await asyncio.to_thread(register_agent, bad, _agent_home(tmp_path))

    with pytest.raises(RateLimitError, match="too many"):
        await asyncio.to_thread(register_agent, uri, _agent_home(tmp_path))
    async with httpx.AsyncClient(verify=False) as client:
        response = await client.post(
            f"{enrollment_leader.url}/admin/nodes/register",
            json={"token": uri.token, "csr_pem": ""},
        )
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "60"
    assert response.json()["error"]["type"] == "rate_limit_error"

    lines = enrollment_leader.audit_lines()
    assert len(lines) == 12
    assert {line["source_address"] for line in lines} == {"127.0.0.1"}
    assert len({line["token_hash"] for line in lines[:10]}) == 1
    assert [line["outcome"] for line in lines[10:]] == ["rate_limited"] * 2

    enrollment_leader.clock.now += 61
    await asyncio.to_thread(register_agent, uri, _agent_home(tmp_path))


async def test_successful_registrations_do_not_count_against_the_address(
    enrollment_leader: Leader, tmp_path: Path
) -> None:
    # One provisioning host enrolls twelve nodes in a minute: none is refused.
    for index in range(12):
        uri = enrollment_leader.uri(f"gpu-{index}")
        await asyncio.to_thread(register_agent, uri, _agent_home(tmp_path, f"a{index}"))
    assert [line["outcome"] for line in enrollment_leader.audit_lines()] == ["enrolled"] * 12


async def test_failures_in_between_successes_still_reach_the_limit(
    enrollment_leader: Leader, tmp_path: Path
) -> None:
    bad = replace(enrollment_leader.uri("gpu-x"), token="not-a-token-at-all")
    for index in range(10):
        await asyncio.to_thread(register_agent, enrollment_leader.uri(f"gpu-{index}"),
                                _agent_home(tmp_path, f"a{index}"))  # fmt: skip
        with pytest.raises(AuthError, match="unknown enrollment token"):
            await asyncio.to_thread(register_agent, bad, _agent_home(tmp_path, "bad"))
    with pytest.raises(RateLimitError, match="too many"):
        await asyncio.to_thread(
            register_agent, enrollment_leader.uri("gpu-y"), _agent_home(tmp_path, "y")
        )


async def test_the_audit_log_keeps_nothing_of_any_token(
    enrollment_leader: Leader, tmp_path: Path
) -> None:
    good = enrollment_leader.uri("gpu-1")
    presented = [good.token, "sk-berth-pasted-by-mistake-0123456789ab", "not-a-token-at-all"]
    await asyncio.to_thread(register_agent, good, _agent_home(tmp_path, "a"))
    for token in presented[1:]:
        with pytest.raises(AuthError):
            await asyncio.to_thread(register_agent, replace(good, token=token),
                                    _agent_home(tmp_path, "b"))  # fmt: skip
    async with httpx.AsyncClient(verify=False) as client:  # malformed: no CSR
        await client.post(
            f"{enrollment_leader.url}/admin/nodes/register", json={"token": presented[2]}
        )
    log = enrollment_leader.home.audit_log.read_text()
    assert len(log.splitlines()) == 4
    for token in presented:  # no 8 characters of it (what the log used to keep) in a row
        for start in range(len(token) - 7):
            assert token[start : start + 8] not in log, token[start : start + 8]
    assert all("token_prefix" not in line for line in enrollment_leader.audit_lines())


async def test_reenrolling_a_label_keeps_the_id_and_replaces_the_fingerprint(
    enrollment_leader: Leader, tmp_path: Path
) -> None:
    first = await asyncio.to_thread(
        register_agent, enrollment_leader.uri("gpu-1"), _agent_home(tmp_path, "a")
    )
    before = enrollment_leader.store.get_node(first.node_id)
    enrollment_leader.store.remove_node(first.node_id)

    second = await asyncio.to_thread(
        register_agent, enrollment_leader.uri("gpu-1"), _agent_home(tmp_path, "b")
    )

    after = enrollment_leader.store.get_node(second.node_id)
    assert second.node_id == first.node_id
    assert after.status == "unreachable"
    assert after.cert_fingerprint != before.cert_fingerprint
    assert after.cert_fingerprint == fingerprint_of_pem(second.cert_path.read_bytes())


async def test_malformed_bodies_are_400_and_the_ca_is_served(enrollment_leader: Leader) -> None:
    async with httpx.AsyncClient(verify=False) as client:
        ca = await client.get(f"{enrollment_leader.url}/admin/ca.pem")
        not_json = await client.post(f"{enrollment_leader.url}/admin/nodes/register", content=b"{")
        no_csr = await client.post(
            f"{enrollment_leader.url}/admin/nodes/register",
            json={"token": enrollment_leader.uri("gpu-1").token},
        )
        bad_csr = await client.post(
            f"{enrollment_leader.url}/admin/nodes/register",
            json={"token": enrollment_leader.uri("gpu-2").token, "csr_pem": "nope"},
        )

    assert ca.content == enrollment_leader.ca.cert_pem
    assert ca.headers["content-type"] == "application/x-pem-file"
    for response in (not_json, no_csr, bad_csr):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert "certificate signing request" in bad_csr.json()["error"]["message"]


#: OpenSSL's X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY: the chain leads to no trusted CA.
UNKNOWN_ISSUER = 20


def _client_certificate(ca: CertificateAuthority, folder: Path, name: str) -> tuple[Path, Path]:
    """A clientAuth certificate from ``ca`` for a new key, as enrollment issues one; the
    certificate's and the key's paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(ca.sign_csr(csr.public_bytes(serialization.Encoding.PEM), name, 1))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def _ask_agent_endpoint(url: str, context: ssl.SSLContext) -> bytes:
    """Handshake with the cluster listener at ``url``, GET ``/cluster/agent`` and return what
    came back: ``b""`` when the leader closed the connection instead of answering. An error
    of the handshake itself propagates."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    with (
        socket.create_connection((parts.hostname, parts.port), timeout=30) as raw,
        context.wrap_socket(raw, server_hostname=parts.hostname) as tls,
    ):
        request = b"GET /cluster/agent HTTP/1.1\r\nHost: leader\r\nConnection: close\r\n\r\n"
        try:
            tls.sendall(request)
            return tls.recv(4096)
        except (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError):
            return b""


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
async def test_a_client_certificate_from_another_ca_fails_the_handshake(
    enrollment_leader: Leader,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    version: ssl.TLSVersion,
) -> None:
    def context_with(ca: CertificateAuthority, name: str) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=enrollment_leader.ca.cert_pem.decode())
        context.minimum_version = context.maximum_version = version
        context.load_cert_chain(*_client_certificate(ca, tmp_path, name))
        return context

    # The same client with a certificate from the leader's own CA is let in and seen.
    insider = context_with(enrollment_leader.ca, "insider")
    answer = await asyncio.to_thread(_ask_agent_endpoint, enrollment_leader.url, insider)
    assert answer.startswith(b"HTTP/1.1 200") and b'"fingerprint": "sha256:' in answer

    # One of another CA (another berth cluster's agent) is refused by the TLS handshake:
    # asyncio reports why only in debug mode, on its own logger.
    stranger = context_with(CertificateAuthority.load_or_create(tmp_path / "other-ca"), "intruder")
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    caplog.set_level(logging.DEBUG, logger="asyncio")
    try:
        if version is ssl.TLSVersion.TLSv1_2:
            # The client's certificate is checked before the client's side of the handshake ends.
            with pytest.raises((ssl.SSLError, ConnectionResetError)):
                await asyncio.to_thread(_ask_agent_endpoint, enrollment_leader.url, stranger)
        else:
            # TLS 1.3: the client's side ends first; the leader then closes without answering.
            answer = await asyncio.to_thread(_ask_agent_endpoint, enrollment_leader.url, stranger)
            assert answer == b"", f"the leader answered a foreign certificate: {answer!r}"

        def refusal() -> ssl.SSLCertVerificationError | None:
            for record in caplog.records:
                if record.exc_info and isinstance(record.exc_info[1], ssl.SSLCertVerificationError):
                    return record.exc_info[1]
            return None

        refused = await wait_for_async(
            refusal, EVENT_TIMEOUT_S, "the leader's TLS layer to refuse the certificate"
        )
    finally:
        loop.set_debug(False)
    assert refused.verify_code == UNKNOWN_ISSUER, refused.verify_message


# -- pure parts ----------------------------------------------------------------------------------


def test_enrollment_uri_round_trips() -> None:
    uri = EnrollmentURI("https://leader.example:11501", "t0k-en_", "sha256:" + "ab" * 32)

    # ':' and '/' stay readable in the query (RFC 3986 section 3.4), as the docs show it.
    assert str(uri) == (
        "berth://enroll?leader=https://leader.example:11501&token=t0k-en_&ca_fp=sha256:" + "ab" * 32
    )
    assert EnrollmentURI.parse(str(uri)) == uri


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("https://enroll?leader=x", "not an enrollment URI"),
        ("berth://enroll?leader=https://l:1&token=t", "ca_fp"),
        ("berth://enroll?leader=http://l:1&token=t&ca_fp=sha256:" + "a" * 64, "https://"),
        ("berth://enroll?leader=https://l:1&token=&ca_fp=sha256:" + "a" * 64, "token"),
        ("berth://enroll?leader=https://l:1&token=t&ca_fp=md5:aa", "sha256:<64 hex"),
    ],
)
def test_malformed_enrollment_uris_say_what_is_wrong(text: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint):
        EnrollmentURI.parse(text)


@pytest.mark.parametrize("label", ["gpu-1", "a", "0" * 63])
def test_valid_labels(label: str) -> None:
    assert validate_node_label(label) == label


@pytest.mark.parametrize(
    "label", ["", "-gpu", "gpu-", "GPU", "gpu_1", "a" * 64, "local", "a.b", "n-0123abcd"]
)
def test_invalid_labels(label: str) -> None:
    with pytest.raises(ConfigError):
        validate_node_label(label)


def test_rate_limiter_slides_its_window_per_address() -> None:
    limiter = RegistrationRateLimiter(max_attempts=3, window_s=60.0)

    assert [limiter.check("a", t) for t in (0.0, 10.0, 20.0)] == [None, None, None]
    assert limiter.check("a", 30.0) == pytest.approx(30.0)
    assert limiter.check("b", 30.0) is None
    assert limiter.check("a", 60.0) is None  # the attempt at 0 left the window
    assert limiter.check("a", 61.0) == pytest.approx(9.0)


def test_rate_limiter_counts_failed_and_unfinished_attempts_only() -> None:
    limiter = RegistrationRateLimiter(max_attempts=2, window_s=60.0)

    assert limiter.check("a", 0.0) is None
    limiter.succeeded("a", 0.0)  # enrolled: no longer counts
    assert limiter.check("a", 1.0) is None  # still in progress, or failed: counts
    assert limiter.check("a", 2.0) is None
    assert limiter.check("a", 3.0) == pytest.approx(58.0)  # two concurrent guesses at most
    limiter.succeeded("a", 1.0)
    assert limiter.check("a", 4.0) is None
    limiter.succeeded("a", 999.0)  # an attempt it does not know: nothing changes
    assert limiter.check("a", 5.0) == pytest.approx(57.0)
