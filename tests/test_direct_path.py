"""The leader's choice of data path, in one process: a leader's ``RemoteLink`` and an
agent's ``AgentService`` joined by an in-memory WebSocket pair (the tunnel), the agent's
ingress on real TLS on loopback behind a TCP relay the tests can black-hole, and the
leader's ``DataPaths`` in front of both."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from berth.cluster.leader.direct_path import RENEW_AFTER_S, DataPaths
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.remote_link import RemoteLink
from berth.cluster.link.connection import LinkConnection
from berth.cluster.protocol.direct import HEALTH_PATH
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.ops import INGRESS
from berth.cluster.protocol.session import Role
from berth.engine_http.answer import EngineAnswer, HttpOpener
from berth.engine_http.errors import UpstreamConnectError, UpstreamDisconnectError, UpstreamError
from berth.engine_http.request import EngineRequest
from support.direct import DEPLOYMENT, Ingress, Pki, Relay, running_ingress
from support.fakes import memory_socket_pair
from support.link_pair import LeaderSide
from support.standin_engine import Reply, Stall, chat_chunks, chat_completion, json_reply, sse_reply
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

BODY = b'{"model": "m"}'
CHAT_REQUEST = EngineRequest("/v1/chat/completions", b"", [], BODY)
RELAY_HOST = "127.0.0.2"  # the address the agent advertises; the relay forwards it
OTHER_NODE_ID = "n-0d1ec7a2"


class CountingTunnel:
    """The hub's ``open_http`` over one link, counting what went through it."""

    def __init__(self, link: RemoteLink) -> None:
        self.link = link
        self.opened = 0

    async def open_http(
        self, node_id: str, deployment_id: str, request: EngineRequest, read_timeout_s: float | None
    ) -> EngineAnswer:
        self.opened += 1
        return await self.link.open_http(deployment_id, request, read_timeout_s)


@dataclass
class Leader:
    paths: DataPaths
    tunnel: CountingTunnel
    relay: Relay
    side: Ingress
    node_id: str

    def path(self) -> str | None:
        found = self.paths.data_path(self.node_id)
        return None if found is None else found.path

    async def ask(self, deployment: str = DEPLOYMENT) -> tuple[int, bytes]:
        answer = await self.paths.open_http(self.node_id, deployment, CHAT_REQUEST, 10.0)
        try:
            return answer.status, await answer.read()
        finally:
            answer.close()


@contextlib.asynccontextmanager
async def _linked(
    side: Ingress, *, offers_ingress: bool = True, certificate: bool = True
) -> AsyncIterator[RemoteLink]:
    """The leader's ``RemoteLink`` to ``side``'s agent service over an in-memory tunnel.

    ``offers_ingress``: its Hello lists ``op.ingress``; ``certificate``: the leader saw its
    client certificate (not only a fingerprint forwarded by a proxy)."""
    pki = side.pki
    hello = side.service.hello()
    if not offers_ingress:
        offered = [c for c in hello.capabilities if c != INGRESS.capability]
        hello = msgspec.structs.replace(hello, capabilities=offered)
    agent_ws, leader_ws = memory_socket_pair()
    agent = LinkConnection(Role.AGENT, agent_ws, side.service, peer="leader")
    leader = LinkConnection(Role.LEADER, leader_ws, LeaderSide(), peer=pki.node_id)
    terms = WelcomeTerms(node_id=pki.node_id, leader_version="test")
    _welcome, hello = await asyncio.gather(
        agent.handshake(hello, timeout_s=5.0),
        leader.handshake(terms, timeout_s=5.0),
    )
    tasks = [asyncio.create_task(agent.run()), asyncio.create_task(leader.run())]
    try:
        yield RemoteLink(
            pki.node_id,
            leader,
            hello.inventory,
            hello.capabilities,
            advertise=hello.advertise,
            certificate_der=pki.agent_cert_der if certificate else None,
        )
    finally:
        await leader.close(1000, "test over")
        await asyncio.gather(*tasks)


def _data_paths(tunnel: HttpOpener, registry: LinkRegistry, pki: Pki, **options: Any) -> DataPaths:
    return DataPaths(
        tunnel,
        registry,
        pki.ca,
        pki.ca_dir,
        **{"probe_timeout_s": 0.5, "connect_timeout_s": 1.0, **options},
    )


async def _leader(
    pki: Pki,
    *,
    advertise: bool = True,
    offers_ingress: bool = True,
    certificate: bool = True,
    probe_interval_s: float = 0.05,
) -> AsyncIterator[Leader]:
    """The leader's data paths to one agent linked through an in-memory tunnel.

    ``advertise``: the agent was started with ``--advertise``; ``offers_ingress`` and
    ``certificate``: see :func:`_linked`."""
    async with running_ingress(
        pki, advertise_host=RELAY_HOST, configure=False, advertise=advertise
    ) as side:
        relay = Relay(("127.0.0.1", side.origin.port))
        await relay.start(RELAY_HOST, side.origin.port)
        async with _linked(side, offers_ingress=offers_ingress, certificate=certificate) as link:
            tunnel = CountingTunnel(link)
            registry = LinkRegistry()
            paths = _data_paths(tunnel, registry, pki, probe_interval_s=probe_interval_s)
            await paths.start()
            registry.attach(link)
            try:
                yield Leader(paths, tunnel, relay, side, pki.node_id)
            finally:
                await paths.close()
                await relay.close()


@pytest.fixture
async def leader(pki: Pki) -> AsyncIterator[Leader]:
    async for made in _leader(pki):
        yield made


async def test_a_reachable_agent_gets_its_requests_direct(leader: Leader) -> None:
    await wait_for_async(lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "the direct path")

    status, body = await leader.ask()

    assert status == 200
    assert json.loads(body) == chat_completion("hello")
    assert leader.tunnel.opened == 0
    found = leader.paths.data_path(leader.node_id)
    assert found is not None and "answers probes" in found.reason
    assert found.advertise == f"{RELAY_HOST}:{leader.side.origin.port}"


async def test_a_black_holed_ingress_moves_waiting_requests_to_the_tunnel_and_back(
    leader: Leader,
) -> None:
    await wait_for_async(lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "the direct path")
    leader.side.engine.script(Reply([Stall(2.0), *json_reply(chat_completion("late")).steps]))
    waiting = asyncio.create_task(leader.ask())
    await leader.side.engine.wait_for_request(timeout_s=10.0)

    leader.relay.blocked = True  # packets to the ingress are dropped from now on
    status, body = await asyncio.wait_for(waiting, 10.0)

    # The request waiting for its head on the dead path was answered through the tunnel.
    assert status == 200 and leader.tunnel.opened == 1
    assert json.loads(body) == chat_completion("hello")  # the tunnel's answer, not "late"
    assert leader.path() == "tunnel"
    found = leader.paths.data_path(leader.node_id)
    assert found is not None and "did not answer a probe" in found.reason

    leader.relay.blocked = False
    await wait_for_async(
        lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "the direct path again"
    )
    assert (await leader.ask())[0] == 200
    assert leader.tunnel.opened == 1


@pytest.fixture
async def rarely_probed(pki: Pki) -> AsyncIterator[Leader]:
    """A leader that probes once at the start and then not for an hour."""
    async for made in _leader(pki, probe_interval_s=3600.0):
        yield made


async def test_a_direct_attempt_refused_goes_through_the_tunnel_at_once(
    rarely_probed: Leader,
) -> None:
    leader = rarely_probed
    await wait_for_async(lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "the direct path")

    await leader.relay.close()  # nothing listens at the advertised address any more
    status, _body = await leader.ask()  # no probe will notice before it: the request must

    assert status == 200 and leader.tunnel.opened == 1
    found = leader.paths.data_path(leader.node_id)
    assert found is not None and found.path == "tunnel"
    assert "failed before its answer" in found.reason


async def test_an_engine_failure_on_the_direct_path_is_not_retried_through_the_tunnel(
    leader: Leader,
) -> None:
    await wait_for_async(lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "the direct path")

    with pytest.raises(UpstreamConnectError, match="d-ffffffff"):
        await leader.ask("d-ffffffff")

    assert leader.tunnel.opened == 0
    assert leader.path() == "direct"


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        # An agent started without --advertise, or one older than the direct path: its
        # Hello has neither the address nor op.ingress.
        ({"advertise": False}, "the agent advertises no address"),
        ({"offers_ingress": False}, "offers no op.ingress"),
        ({"certificate": False}, "did not see the agent's certificate"),
        ({"probe_interval_s": 0.0}, "the direct path is off on this leader"),
    ],
    ids=["no advertise", "no op.ingress", "fingerprint forwarded", "off on the leader"],
)
async def test_an_agent_without_a_usable_ingress_stays_on_the_tunnel_and_says_why(
    pki: Pki, agent: dict[str, Any], reason: str
) -> None:
    async for leader in _leader(pki, **agent):
        status, body = await leader.ask()

        assert status == 200 and json.loads(body) == chat_completion("hello")
        assert leader.tunnel.opened == 1
        found = leader.paths.data_path(leader.node_id)
        assert found is not None and found.path == "tunnel"
        assert reason in found.reason
        assert not leader.side.ingress.serving  # the leader never sent op.ingress


async def test_a_burst_spills_over_to_the_tunnel_instead_of_queueing_behind_handshakes(
    leader: Leader,
) -> None:
    await wait_for_async(lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "the direct path")

    answers = await asyncio.gather(*(leader.ask() for _ in range(40)))

    assert [status for status, _body in answers] == [200] * 40
    assert len(leader.side.engine.requests) == 40
    # At most MAX_CONNECTING handshakes at once: the rest went through the tunnel at once.
    assert 0 < leader.tunnel.opened < 40
    assert leader.path() == "direct"


async def test_a_stream_on_a_path_that_stays_dark_is_closed_not_left_hanging(
    leader: Leader,
) -> None:
    await wait_for_async(lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "the direct path")
    leader.side.engine.script(sse_reply(chat_chunks(["word "] * 600), pause_s=0.05))
    answer = await leader.paths.open_http(leader.node_id, DEPLOYMENT, CHAT_REQUEST, 600.0)
    assert await answer.read_chunk()

    leader.relay.blocked = True  # mid-stream, the path goes dark and stays dark
    with pytest.raises(UpstreamDisconnectError) as raised:
        async with asyncio.timeout(EVENT_TIMEOUT_S):
            while await answer.read_chunk():
                pass
    answer.close()

    assert raised.value.answered  # cut off after it began, as when a link dies
    assert leader.path() == "tunnel"


class ManualClock:
    """Epoch seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _direct(paths: DataPaths, side: Ingress) -> bool:
    """Whether the leader sends ``side``'s requests direct (so it has configured its
    ingress, and knows when)."""
    found = paths.data_path(side.pki.node_id)
    return found is not None and found.path == "direct"


async def _lets_in_the_leader(side: Ingress) -> bool:
    """Whether ``side``'s ingress answers a new connection that presents the leader
    certificate on disk now (as every new connection of the leader's does)."""
    try:
        pool = side.pki.pool()
    except FileNotFoundError:  # being renewed: not written yet
        return False
    try:
        response = await pool.request(side.origin, b"GET", HEALTH_PATH, [], b"")
        response.close()
        return response.status == 200
    except UpstreamError:
        return False
    finally:
        await pool.close()


async def test_a_leader_certificate_renewed_for_one_agent_is_sent_to_every_agent(
    pki: Pki, tmp_path: Path
) -> None:
    clock = ManualClock()
    other_pki = pki.another_agent(tmp_path / "other", OTHER_NODE_ID)
    async with (
        running_ingress(pki, configure=False) as first,
        running_ingress(other_pki, configure=False) as other,
        _linked(first) as first_link,
        _linked(other) as other_link,
    ):
        registry = LinkRegistry()
        paths = _data_paths(CountingTunnel(first_link), registry, pki, clock=clock)
        await paths.start()
        try:
            registry.attach(first_link)
            await wait_for_async(lambda: _direct(paths, first), EVENT_TIMEOUT_S, "first direct")
            # The other agent links later: its ingress certificate is younger.
            clock.now_s = 0.6 * RENEW_AFTER_S
            registry.attach(other_link)
            await wait_for_async(lambda: _direct(paths, other), EVENT_TIMEOUT_S, "other direct")

            # The first agent's certificate is due for renewal, the other's is not; the
            # leader's own certificate is renewed on the way (gone: issued anew).
            pki.leader_cert.unlink()
            clock.now_s = 1.1 * RENEW_AFTER_S
            await _wait_until_let_in(first)

            # Every new connection presents the renewed certificate, to the other agent
            # too: its ingress must have been told of it.
            await _wait_until_let_in(other)
        finally:
            await paths.close()


async def _wait_until_let_in(side: Ingress) -> None:
    deadline = asyncio.get_running_loop().time() + EVENT_TIMEOUT_S
    while not await _lets_in_the_leader(side):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(
                f"node {side.pki.node_id}'s ingress refuses the leader's renewed certificate"
            )
        await asyncio.sleep(0.05)


async def _stream(leader: Leader) -> bytes:
    """One streamed exchange over the leader's data paths, read to its end."""
    leader.side.engine.script(sse_reply(chat_chunks(["one ", "two ", "three"])))
    answer = await leader.paths.open_http(leader.node_id, DEPLOYMENT, CHAT_REQUEST, 10.0)
    try:
        assert answer.status == 200
        return await answer.read()
    finally:
        answer.close()


async def test_sequential_streams_over_the_direct_path_share_one_connection(
    rarely_probed: Leader,
) -> None:
    leader = rarely_probed
    await wait_for_async(lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "the direct path")

    bodies = [await _stream(leader) for _ in range(8)]

    assert all(b"three" in body and body.endswith(b"data: [DONE]\n\n") for body in bodies)
    assert leader.tunnel.opened == 0
    # The probe's connection carried every stream after it: one TLS handshake in all.
    assert leader.relay.accepted == 1


async def test_a_connection_broken_by_the_ingress_is_not_used_again(
    rarely_probed: Leader,
) -> None:
    leader = rarely_probed
    await wait_for_async(lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "the direct path")
    await _stream(leader)
    assert leader.relay.cut() == 1  # the idle connection, broken off by the peer

    body = await _stream(leader)

    assert b"three" in body
    assert leader.tunnel.opened == 0  # a new connection, not the tunnel
    assert leader.relay.accepted == 2
    assert leader.path() == "direct"


async def test_a_renewal_closes_the_idle_direct_connections_made_with_the_old_certificates(
    pki: Pki,
) -> None:
    clock = ManualClock()
    async with running_ingress(pki, advertise_host=RELAY_HOST, configure=False) as side:
        relay = Relay(("127.0.0.1", side.origin.port))
        await relay.start(RELAY_HOST, side.origin.port)
        async with _linked(side) as link:
            registry = LinkRegistry()
            tunnel = CountingTunnel(link)
            paths = _data_paths(tunnel, registry, pki, clock=clock, probe_interval_s=0.05)
            await paths.start()
            registry.attach(link)
            leader = Leader(paths, tunnel, relay, side, pki.node_id)
            try:
                await wait_for_async(lambda: leader.path() == "direct", EVENT_TIMEOUT_S, "direct")
                assert b"three" in await _stream(leader)
                made = relay.accepted  # one, or two if a probe was out as the stream began
                assert not any(ended.is_set() for ended in relay.ended)

                clock.now_s = 1.1 * RENEW_AFTER_S  # the node's certificates are renewed
                # The renewal runs between two probes: every connection is idle then.
                async with asyncio.timeout(EVENT_TIMEOUT_S):
                    await asyncio.gather(*(ended.wait() for ended in relay.ended[:made]))

                assert b"three" in await _stream(leader)  # on a new connection
                assert relay.accepted > made and tunnel.opened == 0
            finally:
                await paths.close()
                await relay.close()
