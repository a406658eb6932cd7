"""Listeners' certificates replaced while they serve (berth.http_server.tls_reload), on real TLS
sockets on loopback: a broken pair written over the served one is refused and logged while
new connections still get the old certificate; a good pair is served to new connections
without a restart, and connections already open go on."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509

from berth.cluster.leader.listener import ClusterListener, build_cluster_app, cluster_ssl_context
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.enrollment import AuditLog, EnrollmentService
from berth.daemon.public_tls import public_ssl_context
from berth.http_server.request import Request
from berth.http_server.server import HttpServer
from berth.http_server.sockets import bind_tcp
from berth.http_server.tls_reload import (
    CertificateReloads,
    PairRefused,
    PairStamp,
    ReloadingTLS,
    load_pair,
    poll_step,
)
from berth.http_server.writer import ResponseWriter
from berth.paths import BerthHome
from berth.runtime.engines import find_free_port
from berth.store import Store
from support.berth_cli import Berth
from support.cluster_harness import clean_env
from support.processes import alive
from support.waiting import wait_for, wait_for_async

# -- the pure poll decision -----------------------------------------------------------------

A: PairStamp = ((1, 10, 100), (1, 20, 200))
B: PairStamp = ((2, 11, 101), (1, 20, 200))  # the certificate rewritten
C: PairStamp = ((2, 11, 101), (3, 21, 201))  # then the key


@pytest.mark.parametrize(
    ("now", "previous", "served", "refused", "step"),
    [
        (A, A, A, None, "idle"),  # nothing changed
        (B, A, A, None, "settling"),  # the certificate written: the key may follow
        (C, B, A, None, "settling"),  # the key written too: wait one more interval
        (C, C, A, None, "read"),  # still for a whole interval: read it
        (C, C, A, C, "idle"),  # refused already: not read again until it changes
        ((None, A[1]), A, A, None, "settling"),  # the certificate gone for a moment
    ],
)
def test_a_change_is_read_once_it_held_still_for_an_interval(
    now: PairStamp, previous: PairStamp, served: PairStamp, refused: PairStamp | None, step: str
) -> None:
    assert poll_step(now, previous, served, refused) == step


# -- the checks on a pair ----------------------------------------------------------------------


@dataclass
class Pki:
    ca: CertificateAuthority
    cert: Path  # the files the listener serves
    key: Path
    spare: Path  # a folder for other pairs

    def issue(self, name: str, *, days: int = 365) -> tuple[Path, Path]:
        cert, key = self.spare / f"{name}.pem", self.spare / f"{name}.key"
        self.ca.issue_server_certificate(["127.0.0.1", "localhost"], cert, key, days=days)
        return cert, key

    def install(self, cert_pem: bytes, key_pem: bytes) -> None:
        """Write a pair over the served files, the way an operator's copy does."""
        self.cert.write_bytes(cert_pem)
        self.key.write_bytes(key_pem)


def _serial(pem_path: Path) -> int:
    return x509.load_pem_x509_certificate(pem_path.read_bytes()).serial_number


@pytest.fixture
def reload_pki(tmp_path: Path) -> Pki:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    spare = tmp_path / "spare"
    spare.mkdir()
    reload_pki = Pki(ca, tmp_path / "served.pem", tmp_path / "served.key", spare)
    cert, key = reload_pki.issue("first")
    reload_pki.install(cert.read_bytes(), key.read_bytes())
    return reload_pki


def _broken_pairs(reload_pki: Pki) -> dict[str, tuple[bytes, bytes, str]]:
    good_cert, good_key = reload_pki.issue("good")
    _, other_key = reload_pki.issue("other")
    cert_pem, key_pem = good_cert.read_bytes(), good_key.read_bytes()
    return {
        "chain cut off": (cert_pem[: len(cert_pem) - 40], key_pem, "cut off"),
        "leaf cut off": (cert_pem[:200], key_pem, "cut off"),
        "empty certificate": (b"", key_pem, "no PEM block"),
        "key cut off": (cert_pem, key_pem[:60], "the key does not parse"),
        "mismatched key": (cert_pem, other_key.read_bytes(), "the key is not the certificate's"),
        "not a certificate": (key_pem, key_pem, "holds no certificate"),
    }


@pytest.mark.parametrize(
    "case",
    ["chain cut off", "leaf cut off", "empty certificate", "key cut off", "mismatched key",
     "not a certificate"],
)  # fmt: skip
def test_a_pair_that_is_not_whole_and_right_is_refused_with_its_reason(
    reload_pki: Pki, case: str
) -> None:
    cert_pem, key_pem, reason = _broken_pairs(reload_pki)[case]
    reload_pki.install(cert_pem, key_pem)
    with pytest.raises(PairRefused, match=reason):
        load_pair(reload_pki.cert, reload_pki.key, public_ssl_context)


def test_an_expired_certificate_is_refused_on_reload_and_a_missing_key_named(
    reload_pki: Pki,
) -> None:
    cert, key = reload_pki.issue("good")
    reload_pki.install(cert.read_bytes(), key.read_bytes())
    later = datetime.now(UTC) + timedelta(days=400)
    with pytest.raises(PairRefused, match="expired at"):
        load_pair(reload_pki.cert, reload_pki.key, public_ssl_context, now=later)
    reload_pki.key.unlink()
    with pytest.raises(PairRefused, match="the key cannot be read"):
        load_pair(reload_pki.cert, reload_pki.key, public_ssl_context)


def test_a_certificate_not_valid_yet_is_refused_on_reload(reload_pki: Pki) -> None:
    # Served, it would fail every client's handshake until its notBefore.
    cert, key = reload_pki.issue("good")
    reload_pki.install(cert.read_bytes(), key.read_bytes())
    earlier = datetime.now(UTC) - timedelta(days=2)
    with pytest.raises(PairRefused, match="not valid until"):
        load_pair(reload_pki.cert, reload_pki.key, public_ssl_context, now=earlier)
    assert load_pair(reload_pki.cert, reload_pki.key, public_ssl_context).serial == _serial(cert)


def test_a_certificate_file_that_holds_its_key_too_is_accepted(reload_pki: Pki) -> None:
    cert, key = reload_pki.issue("good")
    reload_pki.install(key.read_bytes() + cert.read_bytes(), key.read_bytes())
    assert load_pair(reload_pki.cert, reload_pki.key, public_ssl_context).serial == _serial(cert)


# -- the public listener (berth's HTTP server) on real TLS ------------------------------------


async def _hello(_request: Request, reply: ResponseWriter) -> None:
    await reply.start(200, [(b"content-length", b"2")])
    await reply.end(b"ok")


CLIENT = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
CLIENT.check_hostname = False
CLIENT.verify_mode = ssl.CERT_NONE  # only the presented serial is looked at


async def _presented_serial(port: int) -> int:
    """The serial of the certificate a new connection to ``port`` is shown."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=CLIENT)
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()
        await writer.wait_closed()


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    return head + await reader.readexactly(2)


@pytest.fixture
async def public_listener(reload_pki: Pki) -> AsyncIterator[tuple[int, ReloadingTLS]]:
    tls = ReloadingTLS.load("public", reload_pki.cert, reload_pki.key, public_ssl_context)
    sock = bind_tcp("public", "127.0.0.1", 0)
    server = HttpServer("public", _hello, ssl_context=tls.context)
    await server.start(sock)
    try:
        yield sock.getsockname()[1], tls
    finally:
        await server.close(0.0)


async def test_the_public_listener_keeps_its_pair_over_a_broken_one_and_takes_a_good_one(
    reload_pki: Pki, public_listener: tuple[int, ReloadingTLS], caplog: pytest.LogCaptureFixture
) -> None:
    port, tls = public_listener
    first = _serial(reload_pki.cert)
    assert await _presented_serial(port) == first
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=CLIENT)
    assert (await _get(reader, writer)).endswith(b"ok")  # open before any reload

    broken = _broken_pairs(reload_pki)
    for case in ("chain cut off", "mismatched key"):
        cert_pem, key_pem, reason = broken[case]
        reload_pki.install(cert_pem, key_pem)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="berth.http_server.tls_reload"):
            assert await tls.reload() == "kept"
        [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert str(reload_pki.cert) in line and str(reload_pki.key) in line and reason in line, line
        assert f"still serving serial {first:X}" in line
        assert await _presented_serial(port) == first  # new connections: the old pair

    good_cert, good_key = reload_pki.issue("second")
    reload_pki.install(good_cert.read_bytes(), good_key.read_bytes())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="berth.http_server.tls_reload"):
        assert await tls.poll() == "unchanged"  # just changed: it may still be being written
        assert await tls.poll() == "reloaded"  # held still for an interval: read
    second = _serial(good_cert)
    assert await _presented_serial(port) == second
    assert tls.served.serial == second
    [line] = [r.getMessage() for r in caplog.records]
    assert f"new certificate serial {second:X}" in line and "notAfter 20" in line, line
    assert (await _get(reader, writer)).endswith(b"ok")  # the open connection went on
    assert writer.get_extra_info("ssl_object").getpeercert(binary_form=True) is not None
    writer.close()
    await writer.wait_closed()


async def test_a_pair_refused_by_the_watch_is_logged_once_and_the_next_good_one_served(
    reload_pki: Pki, public_listener: tuple[int, ReloadingTLS], caplog: pytest.LogCaptureFixture
) -> None:
    port, tls = public_listener
    first = _serial(reload_pki.cert)
    reloads = CertificateReloads([tls], interval_s=0.05)
    reloads.start()
    try:
        cert_pem, key_pem, _ = _broken_pairs(reload_pki)["key cut off"]
        with caplog.at_level(logging.WARNING, logger="berth.http_server.tls_reload"):
            reload_pki.install(cert_pem, key_pem)
            await wait_for_async(lambda: caplog.records, 10, "the refusal's warning")
            await asyncio.sleep(0.3)  # several more polls: the same pair is not read again
        assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
        assert await _presented_serial(port) == first

        good_cert, good_key = reload_pki.issue("second")
        reload_pki.install(good_cert.read_bytes(), good_key.read_bytes())
        await wait_for_async(lambda: tls.served.serial == _serial(good_cert), 10, "the reload")
        assert await _presented_serial(port) == _serial(good_cert)
    finally:
        await reloads.close()


# -- the cluster listener (aiohttp, client certificates optional) ------------------------------


async def _agent_handler(_request: web.Request) -> web.StreamResponse:
    return web.json_response({"ok": True})


async def test_the_cluster_listener_keeps_its_pair_over_a_broken_one_and_takes_a_good_one(
    tmp_path: Path, reload_pki: Pki
) -> None:
    home = BerthHome(tmp_path / "leader")
    home.ensure()
    store = Store(f"sqlite:///{home.db_file}")
    store.migrate()
    sock = bind_tcp("cluster", "127.0.0.1", 0)
    port = sock.getsockname()[1]
    enrollment = EnrollmentService(
        store=store, ca=reload_pki.ca, pepper=b"p" * 32, cluster_url=f"https://127.0.0.1:{port}",
        audit=AuditLog(home.audit_log),
    )  # fmt: skip
    app = build_cluster_app(
        enrollment=enrollment, ca_pem=reload_pki.ca.cert_pem, agent_handler=_agent_handler
    )
    tls = ReloadingTLS.load(
        "cluster",
        reload_pki.cert,
        reload_pki.key,
        lambda c, k: cluster_ssl_context(reload_pki.ca, c, k),
    )
    listener = ClusterListener(app, sock, tls.context)
    await listener.start()
    trusting = ssl.create_default_context(cafile=str(reload_pki.ca.cert_path))
    try:
        first = _serial(reload_pki.cert)
        assert await _presented_serial(port) == first
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=trusting, server_hostname="127.0.0.1"
        )
        cert_pem, key_pem, _ = _broken_pairs(reload_pki)["mismatched key"]
        reload_pki.install(cert_pem, key_pem)
        assert await tls.reload() == "kept"
        assert await _presented_serial(port) == first

        good_cert, good_key = reload_pki.issue("second")
        reload_pki.install(good_cert.read_bytes(), good_key.read_bytes())
        assert await tls.reload() == "reloaded"
        assert await _presented_serial(port) == _serial(good_cert)
        # A new connection verifies the new pair against the berth CA, by host name.
        _, verified = await asyncio.open_connection(
            "127.0.0.1", port, ssl=trusting, server_hostname="127.0.0.1"
        )
        verified.close()
        await verified.wait_closed()
        writer.write(b"GET /admin/ca.pem HTTP/1.1\r\nhost: x\r\n\r\n")  # the old connection
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        writer.close()
        await writer.wait_closed()
    finally:
        await listener.stop()
        store.close()


# -- a real leader process: SIGHUP --------------------------------------------------------------


def _served_serial_sync(port: int) -> int:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        CLIENT.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


@pytest.mark.slow
def test_sighup_reloads_a_real_leaders_certificates_and_the_leader_stays_up(
    tmp_path: Path, reload_pki: Pki
) -> None:
    home = tmp_path / "home"
    # The watch looks only once an hour: what this test sees is SIGHUP's doing.
    berth = Berth(home, env=clean_env({"BERTH_TLS_RELOAD_INTERVAL_S": "3600"}), cwd=tmp_path)
    port, cluster_port = find_free_port(), find_free_port()
    first = _serial(reload_pki.cert)
    try:
        berth("daemon", "start", "--public-port", str(port), "--cluster-port",
              str(cluster_port), "--public-cert", str(reload_pki.cert), "--public-key",
              str(reload_pki.key))  # fmt: skip
        pid = int(BerthHome(home).pid_file.read_text())
        log_file = BerthHome(home).daemon_log
        assert _served_serial_sync(port) == first
        cluster_cert = BerthHome(home).ca_dir / "cluster.pem"
        cluster_first = _serial(cluster_cert)
        assert _served_serial_sync(cluster_port) == cluster_first

        cert_pem, key_pem, _ = _broken_pairs(reload_pki)["mismatched key"]
        reload_pki.install(cert_pem, key_pem)
        os.kill(pid, signal.SIGHUP)
        wait_for(lambda: "refused, still serving" in log_file.read_text(), 30, "the refusal")
        assert _served_serial_sync(port) == first
        assert "cluster listener: SIGHUP: certificate unchanged" in log_file.read_text()

        good_cert, good_key = reload_pki.issue("second")
        reload_pki.install(good_cert.read_bytes(), good_key.read_bytes())
        # The cluster listener's own certificate, issued again by the leader's CA.
        leader_ca = CertificateAuthority.load_or_create(BerthHome(home).ca_dir)
        leader_ca.issue_server_certificate(
            ["127.0.0.1", "localhost", "::1"], cluster_cert, cluster_cert.with_suffix(".key")
        )
        os.kill(pid, signal.SIGHUP)
        second, cluster_second = _serial(good_cert), _serial(cluster_cert)
        wait_for(lambda: _served_serial_sync(port) == second, 30, "the new certificate")
        wait_for(lambda: _served_serial_sync(cluster_port) == cluster_second, 30, "the cluster's")
        assert alive(pid)
        log_text = log_file.read_text()
        assert f"public listener: SIGHUP: new certificate serial {second:X}" in log_text
        assert f"cluster listener: SIGHUP: new certificate serial {cluster_second:X}" in log_text
        listeners = {x["name"]: x for x in berth.admin("GET", "/admin/info")["listeners"]}
        assert listeners["public"]["certificate_serial"] == f"{second:X}"
        assert listeners["cluster"]["certificate_serial"] == f"{cluster_second:X}"
        not_after = x509.load_pem_x509_certificate(good_cert.read_bytes()).not_valid_after_utc
        status = berth("daemon", "status").stdout
        assert "running" in status
        assert f"(certificate until {not_after:%Y-%m-%d %H:%M} UTC)" in status, status
    finally:
        berth("daemon", "stop", check=False)
