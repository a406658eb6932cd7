"""The berth CA: creation, fingerprint, server certificates over real TLS, CSR signing."""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import stat
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from berth.cluster.pki.ca import CertificateAuthority, fingerprint_of_pem
from berth.errors import ConfigError


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    return tmp_path / "ca"


@pytest.fixture
def ca(ca_dir: Path) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(ca_dir)


def read_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def make_csr(common_name: str = "agent-chosen-name", key_bits: int | None = None) -> bytes:
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
    if key_bits is None:
        key = ec.generate_private_key(ec.SECP256R1())
    else:
        key = rsa.generate_private_key(public_exponent=65537, key_size=key_bits)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def test_ca_files_are_created_private(ca: CertificateAuthority, ca_dir: Path) -> None:
    cert = read_cert(ca_dir / "ca.pem")
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value

    assert stat.S_IMODE((ca_dir / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(ca_dir.stat().st_mode) == 0o700
    assert constraints.ca
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    validity = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert timedelta(days=3649) < validity < timedelta(days=3652)
    assert ca.cert_path == ca_dir / "ca.pem"


def test_fingerprint_is_sha256_hex_and_stable_across_reload(
    ca: CertificateAuthority, ca_dir: Path
) -> None:
    reloaded = CertificateAuthority.load_or_create(ca_dir)

    assert re.fullmatch(r"sha256:[0-9a-f]{64}", ca.fingerprint_sha256)
    assert reloaded.fingerprint_sha256 == ca.fingerprint_sha256
    assert reloaded.cert_pem == ca.cert_pem
    assert fingerprint_of_pem((ca_dir / "ca.pem").read_bytes()) == ca.fingerprint_sha256


def test_two_cas_have_different_fingerprints(tmp_path: Path) -> None:
    one = CertificateAuthority.load_or_create(tmp_path / "one")
    two = CertificateAuthority.load_or_create(tmp_path / "two")

    assert one.fingerprint_sha256 != two.fingerprint_sha256


def test_interrupted_creation_gets_a_certificate_for_the_existing_key(
    ca: CertificateAuthority, ca_dir: Path
) -> None:
    key_pem = (ca_dir / "ca.key").read_bytes()
    (ca_dir / "ca.pem").unlink()

    recovered = CertificateAuthority.load_or_create(ca_dir)

    assert (ca_dir / "ca.key").read_bytes() == key_pem
    assert read_cert(ca_dir / "ca.pem").public_key() == ca.certificate.public_key()
    assert recovered.fingerprint_sha256 != ca.fingerprint_sha256


@pytest.mark.parametrize(
    ("file", "content"),
    [("ca.key", b"not a key"), ("ca.pem", b"not a certificate")],
)
def test_corrupt_ca_files_are_refused_naming_the_file(
    ca: CertificateAuthority, ca_dir: Path, file: str, content: bytes
) -> None:
    (ca_dir / file).write_bytes(content)

    with pytest.raises(ConfigError) as caught:
        CertificateAuthority.load_or_create(ca_dir)
    assert caught.value.path == ca_dir / file


def test_certificate_of_another_key_is_refused(tmp_path: Path, ca_dir: Path) -> None:
    CertificateAuthority.load_or_create(ca_dir)
    other = CertificateAuthority.load_or_create(tmp_path / "other")
    (ca_dir / "ca.pem").write_bytes(other.cert_pem)

    with pytest.raises(ConfigError, match="does not match"):
        CertificateAuthority.load_or_create(ca_dir)


def test_fingerprint_of_garbage_is_refused() -> None:
    with pytest.raises(ConfigError):
        fingerprint_of_pem(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")


def test_server_certificate_names_every_host(ca: CertificateAuthority, tmp_path: Path) -> None:
    cert_path, key_path = tmp_path / "tls" / "server.pem", tmp_path / "tls" / "server.key"

    ca.issue_server_certificate(
        ["localhost", "127.0.0.1", "::1", "Leader.Example"], cert_path, key_path
    )

    leaf = read_cert(cert_path)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    usage = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "leader.example"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    leaf.verify_directly_issued_by(ca.certificate)
    assert timedelta(days=364) < leaf.not_valid_after_utc - datetime.now(UTC) < timedelta(days=366)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("hosts", "covered"),
    [
        (["localhost"], True),
        (["127.0.0.1", "LOCALHOST"], True),
        (["localhost", "127.0.0.1"], True),
        (["localhost", "10.0.0.5"], False),
        (["gpu-box.lan"], False),
        (["::1"], False),
    ],
)
def test_server_certificate_covers(
    ca: CertificateAuthority, tmp_path: Path, hosts: list[str], covered: bool
) -> None:
    cert_path, key_path = tmp_path / "server.pem", tmp_path / "server.key"
    ca.issue_server_certificate(["localhost", "127.0.0.1"], cert_path, key_path)

    assert ca.server_certificate_covers(cert_path, hosts) is covered


def test_certificate_from_another_ca_or_missing_file_is_not_covering(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    other = CertificateAuthority.load_or_create(tmp_path / "other")
    cert_path, key_path = tmp_path / "server.pem", tmp_path / "server.key"
    other.issue_server_certificate(["localhost"], cert_path, key_path)

    assert not ca.server_certificate_covers(cert_path, ["localhost"])
    assert not ca.server_certificate_covers(tmp_path / "absent.pem", ["localhost"])


def test_short_lived_certificate_is_due_for_renewal(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    cert_path, key_path = tmp_path / "server.pem", tmp_path / "server.key"
    ca.issue_server_certificate(["localhost"], cert_path, key_path, days=10)

    assert not ca.server_certificate_covers(cert_path, ["localhost"])
    assert ca.server_certificate_covers(cert_path, ["localhost"], renew_before_days=5)


@pytest.mark.parametrize("hosts", [[], [""], ["bad host"]])
def test_unusable_hosts_are_refused(
    ca: CertificateAuthority, tmp_path: Path, hosts: list[str]
) -> None:
    with pytest.raises(ConfigError):
        ca.issue_server_certificate(hosts, tmp_path / "s.pem", tmp_path / "s.key")


def test_server_certificate_verifies_over_real_tls(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    cert_path, key_path = tmp_path / "server.pem", tmp_path / "server.key"
    ca.issue_server_certificate(["localhost", "127.0.0.1"], cert_path, key_path)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert_path, key_path)
    client_context = ssl.create_default_context(cafile=str(ca.cert_path))
    errors: list[BaseException] = []

    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        port = listener.getsockname()[1]

        def serve(connections: int) -> None:
            for _ in range(connections):
                raw, _address = listener.accept()
                try:
                    with server_context.wrap_socket(raw, server_side=True) as tls:
                        tls.sendall(b"hello over tls")
                except (ssl.SSLError, OSError) as exc:  # the rejected handshake lands here
                    errors.append(exc)

        server = threading.Thread(target=serve, args=(2,))
        server.start()
        try:
            with (
                socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
                client_context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                received = tls.recv(100)
                peer = tls.getpeercert()
            with (
                socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
                pytest.raises(ssl.SSLCertVerificationError, match="mismatch"),
            ):
                client_context.wrap_socket(raw, server_hostname="not-in-the-cert.example")
        finally:
            server.join(timeout=10)

    assert received == b"hello over tls"
    assert peer is not None
    assert ("IP Address", "127.0.0.1") in peer["subjectAltName"]
    assert len(errors) == 1


def test_signed_csr_carries_the_leader_chosen_name(ca: CertificateAuthority) -> None:
    pem = ca.sign_csr(make_csr("i-am-the-leader-now"), common_name="node-7f3a", days=30)

    cert = x509.load_pem_x509_certificate(pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert [n.value for n in names] == ["node-7f3a"]
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not constraints.ca
    cert.verify_directly_issued_by(ca.certificate)
    assert timedelta(days=29) < cert.not_valid_after_utc - datetime.now(UTC) < timedelta(days=31)
    assert fingerprint_of_pem(pem).startswith("sha256:")


@pytest.mark.parametrize(
    ("csr", "days", "message"),
    [
        (b"garbage", 30, "invalid certificate signing request"),
        (None, 0, "at least one day"),
        ("rsa1024", 30, "at least 2048 bits"),
    ],
)
def test_bad_csr_requests_are_refused(
    ca: CertificateAuthority, csr: bytes | str | None, days: int, message: str
) -> None:
    if csr is None:
        csr_pem = make_csr()
    elif csr == "rsa1024":
        csr_pem = make_csr(key_bits=1024)
    else:
        assert isinstance(csr, bytes)
        csr_pem = csr

    with pytest.raises(ConfigError, match=message):
        ca.sign_csr(csr_pem, common_name="node-1", days=days)
