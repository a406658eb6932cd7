"""The identities and TLS contexts of the direct data path: the leader dialing an agent's
ingress (``docs/protocol.md``, Direct data path).

Both ends are certified by the berth CA, under names no other certificate of that CA has:

* **the leader's client certificate** (``$BERTH_HOME/ca/leader-client.pem`` and ``.key``):
  clientAuth, ``CN=berth leader`` and the URI SAN :data:`LEADER_URI`.  The leader issues it
  at start and renews it :data:`~berth.cluster.pki.ca.RENEW_BEFORE_DAYS` days before it expires.
  Agents' certificates are issued from their CSRs with a common name only
  (:meth:`~berth.cluster.pki.ca.CertificateAuthority.sign_csr` ignores a CSR's extensions), so no
  agent certificate carries that URI.
* **an agent's ingress certificate**: serverAuth, ``CN=<node id>`` and the DNS SAN
  :func:`ingress_server_name` (``<node id>.node.berth.invalid``: ``.invalid`` is reserved by
  RFC 2606 section 2 and never resolves, so the name means only this).  The leader issues it
  for the public key of the client certificate the agent linked with, a key the agent proved
  it holds in that very TLS handshake, so the ingress serves with the agent's own
  ``agent.key``: no new key, no CSR.  It lasts :data:`INGRESS_CERT_DAYS` days and is issued
  again on every link and every half of that.

The leader dials with that server name, trusting only the berth CA, with host names checked
(:func:`leader_client_context`): only that node's agent can answer.  The ingress trusts one
certificate, the leader's client certificate it was sent over its link, once it has checked
that the berth CA issued it for the leader (:func:`check_leader_certificate`); OpenSSL's
partial-chain flag lets that leaf be the trust anchor (:func:`ingress_server_context`), so an
agent's certificate, another CA's, or none at all fails the TLS handshake itself.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from berth.atomic import write_atomic
from berth.cluster.pki.ca import RENEW_BEFORE_DAYS, CertificateAuthority
from berth.errors import AuthError, ConfigError

#: The URI SAN that marks the leader's client certificate.
LEADER_URI: Final = "urn:berth:leader"
LEADER_COMMON_NAME: Final = "berth leader"
LEADER_CERT_FILE: Final = "leader-client.pem"
LEADER_KEY_FILE: Final = "leader-client.key"
LEADER_CERT_DAYS: Final = 365
#: Validity of an agent's ingress certificate; the leader re-issues it every half of this.
INGRESS_CERT_DAYS: Final = 30
#: The DNS suffix of ingress server names (RFC 2606 reserves ``.invalid``).
INGRESS_NAME_SUFFIX: Final = ".node.berth.invalid"

_PEM = serialization.Encoding.PEM

#: The roots a check trusts: the berth CA's certificate, or every root of a trust bundle (old
#: and new CA during a rotation: a leaf under any of them passes, not only the first's).
TrustRoots = x509.Certificate | Sequence[x509.Certificate]


def ingress_server_name(node_id: str) -> str:
    """The TLS server name of node ``node_id``'s ingress: ``<node id>.node.berth.invalid``."""
    return f"{node_id}{INGRESS_NAME_SUFFIX}"


def ensure_leader_certificate(ca: CertificateAuthority, ca_dir: Path) -> tuple[Path, Path]:
    """The leader's client certificate and key under ``ca_dir``, issued (with a new EC P-256
    key, mode 0600) when missing, not this CA's, not the leader's, or within
    :data:`~berth.cluster.pki.ca.RENEW_BEFORE_DAYS` days of expiry."""
    cert_path, key_path = ca_dir / LEADER_CERT_FILE, ca_dir / LEADER_KEY_FILE
    if not _leader_certificate_current(ca, cert_path, key_path):
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = ca.issue_leaf(
            key.public_key(),
            common_name=LEADER_COMMON_NAME,
            usage=ExtendedKeyUsageOID.CLIENT_AUTH,
            sans=[x509.UniformResourceIdentifier(LEADER_URI)],
            days=LEADER_CERT_DAYS,
        )
        key_pem = key.private_bytes(
            _PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_atomic(key_path, key_pem, mode=0o600)
        write_atomic(cert_path, leaf.public_bytes(_PEM), mode=0o644)
    return cert_path, key_path


def _leader_certificate_current(ca: CertificateAuthority, cert_path: Path, key_path: Path) -> bool:
    try:
        leaf = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return False
    try:
        check_leader_certificate(leaf.public_bytes(_PEM), ca.certificate)
    except AuthError:
        return False
    renew_at = leaf.not_valid_after_utc - timedelta(days=RENEW_BEFORE_DAYS)
    return key.public_key() == leaf.public_key() and datetime.now(UTC) < renew_at


def issue_ingress_certificate(
    ca: CertificateAuthority, agent_certificate_der: bytes, node_id: str
) -> bytes:
    """The ingress certificate of node ``node_id`` (PEM: the leaf, then the CA), for the key
    of ``agent_certificate_der``, the client certificate the agent linked with.

    Raises :class:`ConfigError` when that certificate does not parse or has a key type the
    CA does not sign.
    """
    try:
        agent_cert = x509.load_der_x509_certificate(agent_certificate_der)
    except ValueError as exc:
        raise ConfigError(f"node {node_id}: its client certificate does not parse: {exc}") from None
    public_key = agent_cert.public_key()
    if not isinstance(
        public_key, ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey
    ):
        raise ConfigError(f"node {node_id}: its certificate's key type cannot serve TLS here")
    leaf = ca.issue_leaf(
        public_key,
        common_name=node_id,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=[x509.DNSName(ingress_server_name(node_id))],
        days=INGRESS_CERT_DAYS,
    )
    return leaf.public_bytes(_PEM) + ca.cert_pem


def leader_client_context(ca_pem: bytes, cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """The leader's TLS 1.2+ client context for agents' ingresses: its client certificate,
    the berth CA as the only trust root, host names checked (connect with
    ``server_hostname=ingress_server_name(node_id)``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cadata=ca_pem.decode())
    context.load_cert_chain(str(cert_path), str(key_path))
    return context


def check_leader_certificate(pem: bytes, ca_cert: TrustRoots) -> x509.Certificate:
    """The leader's client certificate in ``pem``, once checked: issued by ``ca_cert`` (one
    of them, for a bundle), valid now, clientAuth, with the URI SAN :data:`LEADER_URI`.

    Raises :class:`AuthError` saying which check failed.
    """
    leaf = _issued_leaf(pem, ca_cert, "the leader's certificate")
    if ExtendedKeyUsageOID.CLIENT_AUTH not in _usages(leaf):
        raise AuthError("the leader's certificate is not a client certificate")
    if LEADER_URI not in _sans(leaf, x509.UniformResourceIdentifier):
        raise AuthError(f"the certificate sent as the leader's does not name {LEADER_URI}")
    return leaf


def check_ingress_certificate(pem: bytes, ca_cert: TrustRoots, node_id: str) -> x509.Certificate:
    """This node's ingress certificate in ``pem`` (the leaf first), once checked: issued by
    ``ca_cert`` (one of them, for a bundle), valid now, serverAuth, naming
    :func:`ingress_server_name` of ``node_id``.

    Raises :class:`AuthError` saying which check failed.
    """
    leaf = _issued_leaf(pem, ca_cert, "the ingress certificate")
    if ExtendedKeyUsageOID.SERVER_AUTH not in _usages(leaf):
        raise AuthError("the ingress certificate is not a server certificate")
    if ingress_server_name(node_id) not in _sans(leaf, x509.DNSName):
        raise AuthError(f"the ingress certificate does not name node {node_id}")
    return leaf


def ingress_server_context(
    cert_path: Path, key_path: Path, leader_certificate_pem: bytes
) -> ssl.SSLContext:
    """The ingress's TLS 1.2+ server context: ``cert_path`` (the ingress certificate) with
    ``key_path`` (the agent's key), and a client certificate required that is exactly
    ``leader_certificate_pem`` (checked first with :func:`check_leader_certificate`).

    Raises :class:`ConfigError` when the certificate and key do not belong together.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert_path), str(key_path))
    except ssl.SSLError as exc:
        raise ConfigError(f"the ingress certificate does not fit {key_path}: {exc}") from None
    context.load_verify_locations(cadata=leader_certificate_pem.decode())
    # The leader's leaf is the one trust anchor: nothing else chains to it.
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _issued_leaf(pem: bytes, ca_cert: TrustRoots, what: str) -> x509.Certificate:
    try:
        leaf = x509.load_pem_x509_certificates(pem)[0]  # the leaf; its chain follows it
    except (ValueError, IndexError) as exc:
        raise AuthError(f"{what} is not a PEM certificate: {exc}") from None
    roots = [ca_cert] if isinstance(ca_cert, x509.Certificate) else list(ca_cert)
    if not any(_directly_issued(leaf, root) for root in roots):
        raise AuthError(f"{what} was not issued by the berth CA") from None
    now = datetime.now(UTC)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise AuthError(f"{what} is not valid now")
    return leaf


def _directly_issued(leaf: x509.Certificate, root: x509.Certificate) -> bool:
    try:
        leaf.verify_directly_issued_by(root)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _usages(leaf: x509.Certificate) -> list[x509.ObjectIdentifier]:
    try:
        return list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return []


def _sans(
    leaf: x509.Certificate, kind: type[x509.UniformResourceIdentifier] | type[x509.DNSName]
) -> list[str]:
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(value) for value in names.get_values_for_type(kind)]
