"""The public listener's TLS context from the operator's certificate and key.

Loaded by the daemon, and by ``berth daemon start`` before it spawns one, so that a missing
or broken file is one line naming the setting and the path, not a traceback in the log.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from berth.errors import ConfigError


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
