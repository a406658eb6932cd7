"""Whether the leader's listeners could bind their configured ports.

A port is tried the way ``berth daemon start`` binds it
(:func:`berth.http_server.sockets.bind_tcp`: a TCP socket, ``SO_REUSEADDR``, the configured
address).  A port in use is the daemon of this very home when what answers there presents
the certificate this home serves on that listener; anything else holding it fails the check,
since the next start would fail the same way.
"""

from __future__ import annotations

import errno
import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from berth.config import WILDCARD_BINDS
from berth.doctor.check import Check
from berth.http_server.errors import BindError
from berth.http_server.sockets import bind_tcp


def port_check(
    name: str,
    bind: str,
    port: int,
    *,
    served_cert: Path | None,
    daemon_running: bool = True,
    timeout_s: float = 2.0,
) -> Check:
    """Whether the ``name`` listener (``public``, ``cluster``) can bind ``bind:port``.

    ``served_cert`` is the certificate file this home's daemon serves on that listener: a
    busy port whose TLS server presents it is that daemon (ok), if this home's daemon runs
    (``daemon_running``); else it is another home with the same certificates (restored from
    one backup, or sharing ``ca/`` for ``leader_ha``), and the next start would fail.
    ``timeout_s`` bounds the TLS probe of a busy port.
    """
    check = f"port {name}"
    where = f"{bind}:{port}"
    if port == 0:
        return Check(check, "ok", f"{bind}:0 (a free port is picked at each start)")
    error = bind_error(bind, port)
    if error is None:
        return Check(check, "ok", f"{where} is free")
    move = f"berth config set-{name} port=N (or berth daemon start --{name}-port N)"
    if error.errno == errno.EADDRINUSE:
        holder = _holder(bind, port, served_cert, timeout_s)
        if holder == "self" and daemon_running:
            return Check(check, "ok", f"{where} is in use by this home's daemon")
        if holder == "self":
            holder = (
                "held by a berth daemon of another home with this home's certificate "
                "(restored from the same backup, or sharing ca/)"
            )
        return Check(
            check,
            "fail",
            f"{name} listener {where}: address already in use, {holder}",
            f"see what holds it: ss -ltnp 'sport = :{port}'; or move berth: {move}",
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return Check(
            check,
            "fail",
            f"{name} listener {where}: {bind} is not an address of this host",
            f"berth config set-{name} bind=ADDRESS (an address of this host, or 0.0.0.0)",
        )
    if error.errno == errno.EACCES:
        return Check(
            check,
            "fail",
            f"{name} listener {where}: binding a port below 1024 needs privileges",
            f"{move}; let a reverse proxy (Caddyfile.example) hold the low port",
        )
    return Check(check, "fail", f"{name} listener {where}: {error.strerror}", move)


def bind_error(bind: str, port: int) -> OSError | None:
    """The error binding a listening TCP socket to ``bind:port`` raises, or ``None`` when it
    binds (the socket is closed again at once); bound as the daemon binds it
    (:func:`berth.http_server.sockets.bind_tcp`)."""
    try:
        sock = bind_tcp("probe", bind, port, backlog=1)
    except BindError as exc:
        return exc.os_error
    sock.close()
    return None


def _holder(bind: str, port: int, served_cert: Path | None, timeout_s: float) -> str:
    """``self`` when the server on the port presents ``served_cert``, else a few words on
    who holds it."""
    host = bind.strip("[]")
    if bind in WILDCARD_BINDS:
        host = "::1" if ":" in bind else "127.0.0.1"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only the certificate's bytes are compared
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
    except (OSError, ValueError):
        return "held by a program that does not speak TLS"
    if der is None:
        return "held by a program that does not speak TLS"
    if served_cert is not None:
        try:
            mine = x509.load_pem_x509_certificate(served_cert.read_bytes())
        except (OSError, ValueError):
            mine = None
        if mine is not None and mine.public_bytes(serialization.Encoding.DER) == der:
            return "self"
    try:
        issuer = x509.load_der_x509_certificate(der).issuer
        issuer_names = issuer.get_attributes_for_oid(NameOID.COMMON_NAME)
    except ValueError:
        issuer_names = []
    if any(str(attribute.value).startswith("berth CA") for attribute in issuer_names):
        return "held by the berth daemon of another home"
    return "held by another TLS server"
