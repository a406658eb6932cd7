"""A Leader built, started and stopped in this process, over real sockets on loopback.

:class:`berth.daemon.server.Leader` is what ``berth daemon start`` runs; these tests build one
on a temporary home with free ports, ask it over HTTPS (the public listener, its CA trusted)
and over its Unix socket (the admin API, as the CLI does), stop it, and check it let go of
what it took: a second start on the very ports it had, and two Leaders side by side.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import pytest

from berth.config import Settings
from berth.daemon.server import Leader
from berth.errors import DaemonError, StoreError
from berth.http_server.errors import BindError
from berth.http_server.sockets import bind_tcp
from berth.paths import BerthHome
from support.waiting import EVENT_TIMEOUT_S, wait_for_async


def leader_settings(home: BerthHome, **flags: object) -> Settings:
    """Settings for a leader on ``home`` on loopback, any free ports unless ``flags`` say
    which; no warden (``orphan_grace_s`` 0), no drain (``drain_s`` 0), no environment."""
    given: dict[str, object] = {
        "drain_s": 0,
        "public_bind": "127.0.0.1",
        "public_host": "127.0.0.1",
        "cluster_bind": "127.0.0.1",
        "cluster_host": "127.0.0.1",
        "public_port": 0,
        "cluster_port": 0,
        "orphan_grace_s": 0,
    }
    given.update(flags)
    return Settings.load(home, flags=given, env={})


async def public_get(home: BerthHome, port: int, path: str) -> httpx.Response:
    """``GET path`` on the public listener over TLS, trusting the home's CA."""
    trust = ssl.create_default_context(cafile=str(home.ca_dir / "ca.pem"))
    async with httpx.AsyncClient(verify=trust, timeout=30) as client:
        return await client.get(f"https://127.0.0.1:{port}{path}")


async def socket_get(home: BerthHome, path: str) -> httpx.Response:
    """``GET path`` over the leader's Unix socket (no key: the socket's owner is trusted)."""
    transport = httpx.AsyncHTTPTransport(uds=str(home.socket_file))
    async with httpx.AsyncClient(transport=transport, timeout=30) as client:
        return await client.get(f"http://berth{path}")


def port_is_free(port: int) -> bool:
    """Whether a listener could bind 127.0.0.1:``port`` now."""
    try:
        sock = bind_tcp("probe", "127.0.0.1", port)
    except BindError:
        return False
    sock.close()
    return True


@pytest.fixture
def in_process_home(tmp_path: Path) -> BerthHome:
    """An empty home for one in-process Leader."""
    return BerthHome(tmp_path / "leader-home")


async def test_a_leader_starts_serves_stops_and_starts_again_on_its_ports(
    in_process_home: BerthHome,
) -> None:
    leader = Leader(in_process_home, leader_settings(in_process_home))
    await leader.start()
    try:
        public_port, cluster_port = leader.public_port, leader.cluster_port
        assert leader.graph.run.ready and leader.leading
        assert in_process_home.pid_file.exists() and in_process_home.socket_file.exists()
        healthz = await public_get(in_process_home, public_port, "/healthz")
        assert healthz.status_code == 200
        readyz = await public_get(in_process_home, public_port, "/readyz")
        assert readyz.status_code == 200
        info = await socket_get(in_process_home, "/admin/info")
        assert info.status_code == 200, info.text
        assert info.json()["pid"] == leader.graph.pid
        with pytest.raises(DaemonError, match="already runs"):
            await leader.start()
    finally:
        await leader.stop()

    assert not in_process_home.pid_file.exists()
    assert not in_process_home.socket_file.exists()
    assert port_is_free(public_port) and port_is_free(cluster_port)
    with pytest.raises(DaemonError, match="not been started"):
        _ = leader.graph
    await leader.stop()  # a second stop does nothing

    again = Leader(
        in_process_home,
        leader_settings(in_process_home, public_port=public_port, cluster_port=cluster_port),
    )
    await again.start()
    try:
        assert (again.public_port, again.cluster_port) == (public_port, cluster_port)
        healthz = await public_get(in_process_home, public_port, "/healthz")
        assert healthz.status_code == 200
    finally:
        await again.stop()
    assert port_is_free(public_port)


async def test_two_leaders_run_side_by_side_in_one_process(tmp_path: Path) -> None:
    homes = [BerthHome(tmp_path / "one"), BerthHome(tmp_path / "two")]
    leaders = [Leader(home, leader_settings(home, leader_only=True)) for home in homes]
    for leader in leaders:
        await leader.start()
    try:
        assert leaders[0].public_port != leaders[1].public_port
        for home, leader in zip(homes, leaders, strict=True):
            assert leader.graph.leader_only
            readyz = await public_get(home, leader.public_port, "/readyz")
            assert readyz.status_code == 200
            info = await socket_get(home, "/admin/info")
            assert info.json()["cluster_url"] == leader.graph.cluster_url
    finally:
        for leader in leaders:
            await leader.stop()
    for home in homes:
        assert not home.socket_file.exists()


async def test_a_port_in_use_fails_the_start_and_leaves_nothing_behind(
    in_process_home: BerthHome,
) -> None:
    taken = bind_tcp("squatter", "127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        leader = Leader(in_process_home, leader_settings(in_process_home, cluster_port=port))
        with pytest.raises(DaemonError, match=f"cluster listener 127.0.0.1:{port}"):
            await leader.start()
    finally:
        taken.close()
    assert not in_process_home.socket_file.exists()
    assert not in_process_home.pid_file.exists()


async def test_serve_runs_the_leader_until_asked_to_stop(in_process_home: BerthHome) -> None:
    leader = Leader(in_process_home, leader_settings(in_process_home, leader_only=True))
    serving = asyncio.create_task(leader.serve())
    try:
        await wait_for_async(
            lambda: serving.done() or (leader.started and leader.graph.run.ready),
            EVENT_TIMEOUT_S,
            "the leader to be ready",
        )
        assert not serving.done(), serving
        readyz = await public_get(in_process_home, leader.public_port, "/readyz")
        assert readyz.status_code == 200
    finally:
        leader.request_stop()
        await serving
    assert not leader.started
    assert not in_process_home.socket_file.exists()


async def test_a_piece_that_fails_to_stop_still_lets_the_leader_go(
    in_process_home: BerthHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As when the database is out of reach as the leader stops: the error is raised, but
    # the ports, the socket and pid files are released all the same (a leader that kept
    # them, with a key-sync thread alive, would never exit nor start again).
    leader = Leader(in_process_home, leader_settings(in_process_home, leader_only=True))
    await leader.start()
    public_port, cluster_port = leader.public_port, leader.cluster_port

    async def unreachable() -> None:
        raise StoreError("database error: connection failed: Connection refused")

    monkeypatch.setattr(leader.graph.lifecycle, "shutdown", unreachable)
    with pytest.raises(StoreError, match="Connection refused"):
        await leader.stop()

    assert not leader.started
    assert not in_process_home.pid_file.exists()
    assert not in_process_home.socket_file.exists()
    assert port_is_free(public_port) and port_is_free(cluster_port)
