"""The agent trusts exactly the CA it pinned: one certificate, the pinned fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest

from berth.agent.identity import pinned_certificate
from berth.cluster.pki.ca import CertificateAuthority
from berth.errors import AuthError


def test_the_pinned_ca_alone_is_accepted(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    assert pinned_certificate(ca.cert_pem, ca.fingerprint_sha256).startswith(b"-----BEGIN")


def test_a_bundle_that_starts_with_the_pinned_ca_is_refused(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    other = CertificateAuthority.load_or_create(tmp_path / "other")
    with pytest.raises(AuthError, match="2 CA certificates"):
        pinned_certificate(ca.cert_pem + other.cert_pem, ca.fingerprint_sha256)


def test_another_ca_is_refused(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    other = CertificateAuthority.load_or_create(tmp_path / "other")
    with pytest.raises(AuthError, match="does not match"):
        pinned_certificate(other.cert_pem, ca.fingerprint_sha256)
