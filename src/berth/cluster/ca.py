"""The berth certificate authority (``$BERTH_HOME/ca``), built on ``cryptography``.

The leader owns one private CA: an EC P-256 key (``ca.key``, mode 0600) and a self-signed
certificate valid for ten years (``ca.pem``).  It issues

- the leader's **server certificates** (serverAuth, SANs for every host clients dial), and
- **client certificates** for enrolled agents (clientAuth, a common name the leader picks),
  and the direct data path's two identities (:mod:`berth.cluster.direct_tls`): the
  leader's client certificate and each advertising agent's ingress certificate.

Clients pin the CA by its **fingerprint**, ``sha256:`` followed by the lowercase hex SHA-256
of the DER certificate.  Certificate profile per RFC 5280: CA has basicConstraints
``cA=TRUE, pathLen=0`` and keyUsage keyCertSign/cRLSign; leaves have ``cA=FALSE``,
digitalSignature and one extendedKeyUsage.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from berth.atomic import create_atomic, write_atomic
from berth.errors import ConfigError

CA_CERT_FILE: Final = "ca.pem"
CA_KEY_FILE: Final = "ca.key"
CA_VALIDITY_DAYS: Final = 3650
SERVER_CERT_VALIDITY_DAYS: Final = 365
#: A server certificate this close to expiry no longer "covers" its hosts, so it is renewed.
RENEW_BEFORE_DAYS: Final = 30
#: Backdating of notBefore, so a peer whose clock runs a little behind accepts a new cert.
CLOCK_SKEW: Final = timedelta(minutes=5)
#: The shortest lifetime of a client certificate, in seconds (tests use a few tens).
MIN_LEAF_LIFETIME_S: Final = 10.0
MIN_RSA_BITS: Final = 2048

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def fingerprint_of_pem(pem: bytes) -> str:
    """``sha256:<hex>`` of the DER form of the first certificate in ``pem``.

    Raises :class:`ConfigError` when ``pem`` holds no valid certificate.
    """
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise ConfigError(f"not a PEM certificate: {exc}") from None
    return _fingerprint(cert)


def fingerprint_of_der(der: bytes) -> str:
    """``sha256:<hex>`` of a DER certificate, as a TLS peer presents it (no parsing)."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _fingerprint(cert: x509.Certificate) -> str:
    return "sha256:" + cert.fingerprint(hashes.SHA256()).hex()


class CertificateAuthority:
    """The CA key and certificate; build it with :meth:`load_or_create`."""

    def __init__(
        self, certificate: x509.Certificate, private_key: ec.EllipticCurvePrivateKey, ca_dir: Path
    ) -> None:
        self._cert = certificate
        self._key = private_key
        self._ca_dir = ca_dir

    @classmethod
    def load_or_create(cls, ca_dir: Path) -> CertificateAuthority:
        """Load the CA from ``ca_dir``, creating the folder (0700), key and certificate first
        when absent.

        Creation is atomic per file (concurrent callers end up with one CA).  A key without a
        certificate (an interrupted creation) gets a fresh certificate.  Raises
        :class:`ConfigError` naming the file when a file is unreadable or corrupt, the key is
        not EC, or the certificate does not match the key, and naming ``ca_dir`` when the
        folder or a new file cannot be written.
        """
        key_path = ca_dir / CA_KEY_FILE
        cert_path = ca_dir / CA_CERT_FILE
        try:
            ca_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(ca_dir, 0o700)
            if not key_path.exists():
                new_key = ec.generate_private_key(ec.SECP256R1())
                create_atomic(key_path, _private_pem(new_key), mode=0o600)
            key = _load_ec_key(key_path)
            if not cert_path.exists():
                create_atomic(cert_path, _self_signed(key).public_bytes(_PEM), mode=0o644)
        except OSError as exc:
            raise ConfigError(f"cannot create the CA: {exc.strerror}", path=ca_dir) from None
        cert = _load_cert(cert_path)
        if cert.public_key() != key.public_key():
            raise ConfigError(f"the CA certificate does not match {key_path}", path=cert_path)
        return cls(cert, key, ca_dir)

    @property
    def cert_path(self) -> Path:
        """Where the CA certificate lives (``ca.pem``), for clients' trust stores."""
        return self._ca_dir / CA_CERT_FILE

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate in PEM form."""
        return self._cert.public_bytes(_PEM)

    @property
    def trust_bundle_pem(self) -> bytes:
        """Every root a peer of this cluster should trust, in PEM, the current CA first."""
        return self.cert_pem

    @property
    def certificate(self) -> x509.Certificate:
        """The CA certificate."""
        return self._cert

    @property
    def fingerprint_sha256(self) -> str:
        """``sha256:`` + lowercase hex SHA-256 of the DER CA certificate (no colons)."""
        return _fingerprint(self._cert)

    def issue_server_certificate(
        self,
        hosts: Sequence[str],
        cert_path: Path,
        key_path: Path,
        *,
        days: int = SERVER_CERT_VALIDITY_DAYS,
    ) -> None:
        """Issue a serverAuth certificate for ``hosts`` and write it and a new key.

        Each host becomes an IP-address SAN if it parses as an IP address, else a DNS-name
        SAN (internationalised names in their IDNA form); the first host is also the common
        name.  The certificate file holds the leaf then the CA certificate; the key file
        (EC P-256, PKCS#8) gets mode 0600.  Both are replaced atomically.  Raises
        :class:`ConfigError` for an empty ``hosts`` or an unusable host name.
        """
        names = [_general_name(host) for host in hosts]
        if not names:
            raise ConfigError("a server certificate needs at least one host")
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        builder = self._leaf_builder(
            common_name=hosts[0].strip(),
            public_key=leaf_key.public_key(),
            lifetime=timedelta(days=days),
            usage=ExtendedKeyUsageOID.SERVER_AUTH,
        ).add_extension(x509.SubjectAlternativeName(_dedupe(names)), critical=False)
        leaf = builder.sign(self._key, hashes.SHA256())
        _replace(key_path, _private_pem(leaf_key), 0o600)
        _replace(cert_path, leaf.public_bytes(_PEM) + self.cert_pem, 0o644)

    def ensure_server_certificate(
        self, hosts: Sequence[str], cert_path: Path, key_path: Path
    ) -> None:
        """Issue a server certificate for ``hosts`` into ``cert_path``/``key_path`` unless
        the one there already covers them (see :meth:`server_certificate_covers`)."""
        if not (
            cert_path.exists()
            and key_path.exists()
            and self.server_certificate_covers(cert_path, hosts)
        ):
            self.issue_server_certificate(hosts, cert_path, key_path)

    def server_certificate_covers(
        self, cert_path: Path, hosts: Sequence[str], *, renew_before_days: int = RENEW_BEFORE_DAYS
    ) -> bool:
        """Whether ``cert_path`` holds a certificate this CA issued that is valid now and for
        ``renew_before_days`` more days and names every one of ``hosts`` in its SANs.

        ``False`` (never an error) for a missing or unreadable file, so the caller re-issues.
        """
        try:
            leaf = x509.load_pem_x509_certificate(cert_path.read_bytes())
            leaf.verify_directly_issued_by(self._cert)
        except (OSError, ValueError, TypeError, InvalidSignature):
            return False
        now = datetime.now(UTC)
        if not leaf.not_valid_before_utc <= now:
            return False
        if leaf.not_valid_after_utc < now + timedelta(days=renew_before_days):
            return False
        try:
            sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return False
        present_ips = set(sans.get_values_for_type(x509.IPAddress))
        present_dns = {name.lower() for name in sans.get_values_for_type(x509.DNSName)}
        try:
            wanted = [_general_name(host) for host in hosts]
        except ConfigError:
            return False
        for name in wanted:
            if isinstance(name, x509.IPAddress):
                if name.value not in present_ips:
                    return False
            elif name.value.lower() not in present_dns:
                return False
        return True

    def sign_csr(
        self,
        csr_pem: bytes,
        common_name: str,
        days: int | None = None,
        *,
        lifetime_s: float | None = None,
    ) -> bytes:
        """Issue a clientAuth certificate for the key in ``csr_pem``; return it in PEM.

        Valid ``lifetime_s`` seconds (at least :data:`MIN_LEAF_LIFETIME_S`), else ``days``
        days, from now; notBefore is backdated by :data:`CLOCK_SKEW`.  The subject is
        ``CN=<common_name>`` as the leader chooses: the CSR's own subject and extensions
        are ignored, only its (self-signature-checked) public key is used: the signature
        proves the requester holds the key.  Raises :class:`ConfigError` when the CSR does
        not parse, its signature is invalid, its key is weak or of an unsupported type, or
        the lifetime is missing or too short.
        """
        if lifetime_s is None:
            if days is None or days <= 0:
                raise ConfigError(f"certificate validity must be at least one day, got {days}")
            lifetime_s = days * 86400.0
        if lifetime_s < MIN_LEAF_LIFETIME_S:
            raise ConfigError(
                f"a certificate's lifetime must be at least {MIN_LEAF_LIFETIME_S:g} s, "
                f"got {lifetime_s:g}"
            )
        if not common_name.strip():
            raise ConfigError("a client certificate needs a common name")
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise ConfigError(f"invalid certificate signing request: {exc}") from None
        if not csr.is_signature_valid:
            raise ConfigError("the certificate signing request's signature is invalid")
        public_key = csr.public_key()
        if isinstance(public_key, rsa.RSAPublicKey):
            if public_key.key_size < MIN_RSA_BITS:
                raise ConfigError(f"RSA keys need at least {MIN_RSA_BITS} bits")
        elif not isinstance(public_key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey):
            raise ConfigError("the CSR's key must be EC, Ed25519 or RSA")
        builder = self._leaf_builder(
            common_name=common_name,
            public_key=public_key,
            lifetime=timedelta(seconds=lifetime_s),
            usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        )
        return builder.sign(self._key, hashes.SHA256()).public_bytes(_PEM)

    def issue_leaf(
        self,
        public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey,
        *,
        common_name: str,
        usage: x509.ObjectIdentifier,
        sans: Sequence[x509.GeneralName],
        days: int,
    ) -> x509.Certificate:
        """Issue a leaf certificate for ``public_key``: ``CN=<common_name>``, one
        extendedKeyUsage (``usage``: serverAuth or clientAuth) and ``sans`` as its subject
        alternative names, valid ``days`` days from now (backdated by :data:`CLOCK_SKEW`).

        For the direct data path's identities (:mod:`berth.cluster.direct_tls`); the caller
        vouches that the key belongs to whom the names say.  Raises :class:`ConfigError`
        when ``days`` is not positive or ``sans`` is empty.
        """
        if days <= 0:
            raise ConfigError(f"certificate validity must be at least one day, got {days}")
        if not sans:
            raise ConfigError("a leaf certificate needs at least one subject alternative name")
        builder = self._leaf_builder(
            common_name=common_name,
            public_key=public_key,
            lifetime=timedelta(days=days),
            usage=usage,
        ).add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return builder.sign(self._key, hashes.SHA256())

    def _leaf_builder(
        self,
        *,
        common_name: str,
        public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey,
        lifetime: timedelta,
        usage: x509.ObjectIdentifier,
    ) -> x509.CertificateBuilder:
        now = datetime.now(UTC)
        ca_ski = self._cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                critical=False,
            )
        )


_PEM = serialization.Encoding.PEM


def _key_usage(*, digital_signature: bool = False, cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _self_signed(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    now = datetime.now(UTC)
    # A random suffix keeps two berth CAs apart in a trust store that lists them by name.
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "berth"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"berth CA {secrets.token_hex(4)}"),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + timedelta(days=CA_VALIDITY_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _general_name(host: str) -> x509.IPAddress | x509.DNSName:
    text = host.strip()
    if not text:
        raise ConfigError("empty host name for a certificate")
    try:
        return x509.IPAddress(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    try:
        ascii_name = text.rstrip(".").encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise ConfigError(f"invalid host name {host!r} for a certificate") from None
    if not ascii_name or any(c.isspace() or c in "/:@" for c in ascii_name):
        raise ConfigError(f"invalid host name {host!r} for a certificate")
    return x509.DNSName(ascii_name)


def _dedupe(names: list[x509.IPAddress | x509.DNSName]) -> list[x509.GeneralName]:
    unique: list[x509.GeneralName] = []
    for name in names:
        if name not in unique:
            unique.append(name)
    return unique


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_ec_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise ConfigError(f"cannot read the CA key: {exc.strerror}", path=path) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"the CA key is corrupt: {exc}", path=path) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError("the CA key is not an EC key", path=path)
    return key


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read the CA certificate: {exc.strerror}", path=path) from None
    except ValueError as exc:
        raise ConfigError(f"the CA certificate is corrupt: {exc}", path=path) from None


def _replace(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` (its folder created when missing) atomically, with ``mode``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, mode=mode)
