"""The public listener's certificate files and TLS context: the operator's, or one the CA
issues.

Loaded by the daemon, and by ``berth daemon start`` before it spawns one, so that a missing
or broken file is one line naming the setting and the path, not a traceback in the log.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from berth.cluster.pki.ca import CertificateAuthority
from berth.config import Settings
from berth.errors import ConfigError
from berth.paths import BerthHome


def public_tls_files(
    settings: Settings, home: BerthHome, ca: CertificateAuthority
) -> tuple[Path, Path]:
    """The public listener's certificate and key: the operator's, or one issued by the CA.

    The issued certificate covers ``public_host``, ``localhost``, 127.0.0.1 and ::1, and is
    re-issued when the configured host is not among its SANs.
    """
    if settings.public_cert and settings.public_key:
        return Path(settings.public_cert), Path(settings.public_key)
    cert, key = home.ca_dir / "public.pem", home.ca_dir / "public.key"
    hosts = sorted({settings.public_host, "localhost", "127.0.0.1", "::1"})
    ca.ensure_server_certificate(hosts, cert, key)
    return cert, key


def public_ssl_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The public listener's TLS 1.2+ server context for ``cert`` and ``key`` (PEM).

    Raises :class:`ConfigError` naming the setting (``public_cert`` or ``public_key``) and
    its path when a file cannot be read, and both paths when OpenSSL refuses the pair (not
    PEM, or the key is not the certificate's).
    """
    for setting, path in (("public_cert", cert), ("public_key", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(
                f"{setting} {path}: {exc.strerror or exc} "
                "(set it with `berth config set-public-tls cert=PATH key=PATH`)"
            ) from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:
        raise ConfigError(
            f"public_cert {cert} and public_key {key} are not a PEM certificate and its "
            f"private key ({exc.reason or exc})"
        ) from None
    context.set_alpn_protocols(["http/1.1"])
    return context
