"""The cluster listener (aiohttp) on real TLS keeps the listener bounds: a connection cap per
source address, a first head that must arrive in time, and aiohttp's own head-line limits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from berth.cluster.leader.listener import (
    ClusterListener,
    build_cluster_app,
    cluster_ssl_context,
    cluster_tls_files,
)
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.enrollment import AuditLog, EnrollmentService
from berth.http_server.limits import ListenerLimits
from berth.http_server.sockets import bind_tcp
from berth.paths import BerthHome
from berth.store import Store

LIMITS = ListenerLimits(head_timeout_s=0.3, max_connections_per_address=3, max_header_count=20)


async def _hello(_request: web.Request) -> web.StreamResponse:
    return web.json_response({"ok": True})


@pytest.fixture
async def bounded_cluster_listener(
    tmp_path: Path,
) -> AsyncIterator[tuple[int, ssl.SSLContext, ClusterListener]]:
    home = BerthHome(tmp_path / "leader")
    home.ensure()
    ca = CertificateAuthority.load_or_create(home.ca_dir)
    store = Store(f"sqlite:///{home.db_file}")
    store.migrate()
    sock = bind_tcp("cluster", "127.0.0.1", 0)
    port = sock.getsockname()[1]
    enrollment = EnrollmentService(
        store=store, ca=ca, pepper=b"p" * 32, cluster_url=f"https://127.0.0.1:{port}",
        audit=AuditLog(home.audit_log),
    )  # fmt: skip
    app = build_cluster_app(enrollment=enrollment, ca_pem=ca.cert_pem, agent_handler=_hello)
    tls = cluster_ssl_context(ca, *cluster_tls_files(ca, "127.0.0.1", home.ca_dir))
    cluster = ClusterListener(app, sock, tls, LIMITS)
    await cluster.start()
    client = ssl.create_default_context(cafile=str(ca.cert_path))
    try:
        yield port, client, cluster
    finally:
        await cluster.stop()
        store.close()


async def _open(
    port: int, tls: ssl.SSLContext
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, ssl=tls, server_hostname="127.0.0.1")


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        while chunk := await asyncio.wait_for(reader.read(65536), 10):
            data += chunk
    return data


async def test_a_connection_whose_first_head_never_comes_is_closed(
    bounded_cluster_listener: tuple[int, ssl.SSLContext, ClusterListener],
) -> None:
    port, tls, _ = bounded_cluster_listener
    reader, writer = await _open(port, tls)
    writer.write(b"GET /admin/ca.pem HTTP/1.1\r\n")  # and nothing more
    assert await _until_closed(reader) == b""
    writer.close()
    # a prompt client is served
    reader, writer = await _open(port, tls)
    writer.write(b"GET /admin/ca.pem HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert (await _until_closed(reader)).startswith(b"HTTP/1.1 200")
    writer.close()


async def test_connections_over_the_per_address_cap_are_refused(
    bounded_cluster_listener: tuple[int, ssl.SSLContext, ClusterListener],
) -> None:
    port, tls, cluster = bounded_cluster_listener
    held = [await _open(port, tls) for _ in range(LIMITS.max_connections_per_address)]
    reader, writer = await _open(port, tls)
    raw = await _until_closed(reader)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429")
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    for _, held_writer in held:
        held_writer.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while cluster.gate.open and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert cluster.gate.open == 0


async def test_too_many_header_lines_are_refused_by_aiohttp(
    bounded_cluster_listener: tuple[int, ssl.SSLContext, ClusterListener],
) -> None:
    port, tls, _ = bounded_cluster_listener
    reader, writer = await _open(port, tls)
    lines = b"".join(b"x-h%d: v\r\n" % i for i in range(LIMITS.max_header_count + 5))
    writer.write(b"GET /admin/ca.pem HTTP/1.1\r\nhost: x\r\n" + lines + b"\r\n")
    raw = await _until_closed(reader)
    writer.close()
    status_line = raw.split(b"\r\n", 1)[0]
    assert status_line.split()[1] == b"400", raw[:80]  # aiohttp's own refusal, in plain text
    assert b"Too many headers" in raw
