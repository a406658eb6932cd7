"""The berth certificate authority (``$BERTH_HOME/ca``), built on ``cryptography``.

The leader owns one private CA: an EC P-256 key (``ca.key``, mode 0600) and a self-signed
certificate valid for ten years (``ca.pem``).  It issues

- the leader's **server certificates** (serverAuth, SANs for every host clients dial), and
- **client certificates** for enrolled agents (clientAuth, a common name the leader picks),
  and the direct data path's two identities (:mod:`berth.cluster.pki.direct_tls`): the
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
#: During a CA rotation (:mod:`berth.cluster.pki.ca_rotation`): the old root and its key, still
#: trusted for agents' leaves and still issuing the leader's own server certificates, so
#: that an agent which trusts only the old root verifies the leader.
PREVIOUS_CERT_FILE: Final = "ca-previous.pem"
PREVIOUS_KEY_FILE: Final = "ca-previous.key"
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
        #: the old root and its key during a rotation (else ``None``)
        self._previous: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None
        previous = ca_dir / PREVIOUS_CERT_FILE
        if previous.exists():
            self._previous = (_load_cert(previous), _load_ec_key(ca_dir / PREVIOUS_KEY_FILE))

    def reload(self) -> None:
        """Read the CA files again (after a rotation or a retirement changed them), in place:
        every holder of this object issues and trusts as the files now say.  Raises
        :class:`ConfigError` like :meth:`load_or_create`."""
        fresh = CertificateAuthority.load_or_create(self._ca_dir)
        self._cert, self._key, self._previous = fresh._cert, fresh._key, fresh._previous

    @property
    def ca_dir(self) -> Path:
        return self._ca_dir

    @property
    def previous(self) -> x509.Certificate | None:
        """The old root while a rotation is under way (``berth ca retire`` removes it)."""
        return None if self._previous is None else self._previous[0]

    @property
    def previous_fingerprint(self) -> str | None:
        """The old root's fingerprint while a rotation is under way."""
        return None if self._previous is None else _fingerprint(self._previous[0])

    def _server_issuer(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """Who issues the leader's own server certificates: the old root while a rotation
        is under way (agents that trust only it still verify the leader), else the CA."""
        return self._previous or (self._cert, self._key)

    @property
    def server_root_pem(self) -> bytes:
        """The root the leader's server certificates chain to (``/admin/ca.pem``)."""
        return self._server_issuer()[0].public_bytes(_PEM)

    @property
    def server_root_fingerprint(self) -> str:
        """The fingerprint enrollment URIs pin: that of :attr:`server_root_pem`."""
        return _fingerprint(self._server_issuer()[0])

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
            _settle_next_pair(key_path, cert_path)
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
        """Every root a peer of this cluster should trust, in PEM, the current CA first (and
        the old one during a rotation)."""
        previous = b"" if self._previous is None else self._previous[0].public_bytes(_PEM)
        return self.cert_pem + previous

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
        name.  The certificate file holds the leaf then its issuer (the old root during a
        rotation); the key file
        (EC P-256, PKCS#8) gets mode 0600.  Both are replaced atomically.  Raises
        :class:`ConfigError` for an empty ``hosts`` or an unusable host name.
        """
        names = [_general_name(host) for host in hosts]
        if not names:
            raise ConfigError("a server certificate needs at least one host")
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        issuer, issuer_key = self._server_issuer()
        builder = self._leaf_builder(
            issuer=issuer,
            common_name=hosts[0].strip(),
            public_key=leaf_key.public_key(),
            lifetime=timedelta(days=days),
            usage=ExtendedKeyUsageOID.SERVER_AUTH,
        ).add_extension(x509.SubjectAlternativeName(_dedupe(names)), critical=False)
        leaf = builder.sign(issuer_key, hashes.SHA256())
        _replace(key_path, _private_pem(leaf_key), 0o600)
        _replace(cert_path, leaf.public_bytes(_PEM) + issuer.public_bytes(_PEM), 0o644)

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
            leaf.verify_directly_issued_by(self._server_issuer()[0])
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

        For the direct data path's identities (:mod:`berth.cluster.pki.direct_tls`); the caller
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
        issuer: x509.Certificate | None = None,
        common_name: str,
        public_key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey,
        lifetime: timedelta,
        usage: x509.ObjectIdentifier,
    ) -> x509.CertificateBuilder:
        now = datetime.now(UTC)
        issuer = issuer or self._cert
        ca_ski = issuer.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(issuer.subject)
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


def next_path(path: Path) -> Path:
    """Where a replacement of ``path`` is written first (a CA rotation's new pair)."""
    return path.with_name(path.name + ".next")


def _settle_next_pair(key_path: Path, cert_path: Path) -> None:
    """Move a new CA pair written aside (``*.next``, by a rotation) into place, the key
    first; a lone new key (cut off before its certificate) is dropped."""
    key_next, cert_next = next_path(key_path), next_path(cert_path)
    if not cert_next.exists():
        key_next.unlink(missing_ok=True)
        return
    if key_next.exists():
        os.replace(key_next, key_path)
    os.replace(cert_next, cert_path)


def _replace(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` (its folder created when missing) atomically, with ``mode``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, mode=mode)
