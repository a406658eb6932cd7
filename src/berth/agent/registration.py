"""``berth agent register``: enroll this host with a leader, from an enrollment URI.

Trust comes from the URI's CA fingerprint, not from any public CA:

1. fetch ``<leader>/admin/ca.pem`` *without* TLS verification (the only unverified request)
   and refuse unless its SHA-256 fingerprint equals the URI's ``ca_fp``;
2. from then on verify TLS against that CA alone: make an EC P-256 key here, send a CSR
   with the token to ``POST <leader>/admin/nodes/register``;
3. write the identity files (:mod:`berth.agent.identity`).  The private key never leaves
   the host.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from berth.agent.identity import AgentIdentity, pinned_certificate, save_agent_identity
from berth.agent.leaders import LEADERS_FILE, LeaderList
from berth.agent.spec_keys import save_spec_keys
from berth.cluster.pki.ca import fingerprint_of_pem
from berth.cluster.pki.enrollment import EnrollmentURI
from berth.errors import AuthError, BerthError, ConfigError, DaemonError, RateLimitError
from berth.paths import BerthHome

REGISTER_TIMEOUT_S = 30.0


def _utc_now() -> datetime:
    return datetime.now(UTC)


def fetch_pinned_ca(uri: EnrollmentURI, *, timeout_s: float = REGISTER_TIMEOUT_S) -> bytes:
    """Fetch the leader's CA certificate and return it if its fingerprint is the pinned one.

    Raises :class:`AuthError` on a mismatch (nothing else is sent to that leader),
    :class:`DaemonError` when the leader cannot be reached, :class:`ConfigError` when the
    answer is not a certificate.
    """
    url = f"{uri.leader_url}/admin/ca.pem"
    try:
        # verify=False for this one request only: the pinned fingerprint is the trust.
        response = httpx.get(url, verify=False, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise DaemonError(f"cannot reach the leader at {url}: {exc}") from None
    if response.status_code != 200:
        raise DaemonError(f"the leader answered {response.status_code} for {url}")
    return pinned_certificate(response.content, uri.ca_fingerprint)


def _new_key_and_csr(label: str) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        # The leader replaces the subject with the node id it chooses.
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)]))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, csr.public_bytes(serialization.Encoding.PEM)


def _refusal(response: httpx.Response) -> BerthError:
    message = response.text
    with contextlib.suppress(ValueError, KeyError, TypeError):
        message = response.json()["error"]["message"]
    text = f"the leader refused the registration: {message}"
    if response.status_code == 401:
        return AuthError(text)
    if response.status_code == 429:
        retry_after = float(response.headers.get("Retry-After", "60"))
        return RateLimitError(f"{text} (retry in {retry_after:.0f}s)", retry_after_s=retry_after)
    if response.status_code in (400, 409):
        return ConfigError(text)
    return DaemonError(f"{text} (HTTP {response.status_code})")


def register_agent(
    uri: EnrollmentURI,
    home: BerthHome,
    *,
    timeout_s: float = REGISTER_TIMEOUT_S,
    clock: Callable[[], datetime] = _utc_now,
) -> AgentIdentity:
    """Enroll this host with the leader named in ``uri`` and write its identity to ``home``.

    Raises :class:`AuthError` for a CA fingerprint mismatch (before any CSR is sent) or a
    refused token, :class:`RateLimitError` when the leader rate-limits this address,
    :class:`DaemonError` when the leader cannot be reached.
    """
    ca_pem = fetch_pinned_ca(uri, timeout_s=timeout_s)
    verify = ssl.create_default_context(cadata=ca_pem.decode())  # this CA only
    key_pem, csr_pem = _new_key_and_csr("berth-agent")
    url = f"{uri.leader_url}/admin/nodes/register"
    try:
        response = httpx.post(
            url,
            json={"token": uri.token, "csr_pem": csr_pem.decode()},
            verify=verify,
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        raise DaemonError(f"cannot register with the leader at {url}: {exc}") from None
    if response.status_code != 200:
        raise _refusal(response)
    answer = response.json()
    # The answer's trust bundle came over TLS verified against the pinned root: every root
    # in it is trusted (two during a CA rotation); it must hold the pinned one.
    bundle, pins = _trust_bundle(str(answer.get("ca_pem") or ""), ca_pem, uri.ca_fingerprint)
    identity = save_agent_identity(
        home,
        leader_url=uri.leader_url,  # the URL that just worked
        node_id=str(answer["node_id"]),
        label=str(answer["label"]),
        ca_fingerprint=uri.ca_fingerprint,
        key_pem=key_pem,
        cert_pem=str(answer["certificate_pem"]).encode(),
        ca_pem=bundle,
        enrolled_at=clock(),
        ca_fingerprints=pins,
    )
    # The spec signing keys came over the same verified TLS: a start they did not sign is
    # refused here from now on (berth.agent.spec_keys).
    try:
        save_spec_keys(home, str(answer.get("spec_keys_pem") or ""))
    except ConfigError as exc:
        raise DaemonError(f"the leader's spec signing keys do not parse: {exc}") from None
    # The leaders to fail over to, from the URI; every Welcome brings the list up to date.
    LeaderList(uri.leaders, uri.leader_url, home.root / LEADERS_FILE).save()
    return identity


def _trust_bundle(sent: str, pinned_pem: bytes, pin: str) -> tuple[bytes, list[str]]:
    """The roots to trust: those of the registration answer's bundle when it holds the
    pinned root (an older leader sends the one root), else the pinned root alone."""
    try:
        roots = x509.load_pem_x509_certificates(sent.encode())
    except ValueError:
        return pinned_pem, [pin]
    pems = [root.public_bytes(serialization.Encoding.PEM) for root in roots]
    fingerprints = [fingerprint_of_pem(pem) for pem in pems]
    if pin not in fingerprints:
        return pinned_pem, [pin]
    return b"".join(pems), fingerprints
