"""The hub's two parts in a change of active leader (docs/ha.md), on real TLS sockets: the
cluster listener and the real hub on loopback, two enrolled nodes whose agents are played
by raw WebSocket clients with their real certificates.

- A new active marks ``unreachable``, after a wait, every node the store says is ``ready``
  that has no link to it (bug C: links that died with the last active), and leaves a node
  whose agent re-attached meanwhile ``ready``.
- A leader that stands down closes its links with ``NOT_LEADER`` naming the active, and
  does not mark those nodes unreachable (their status is the active's to write).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from berth.agent.identity import AgentIdentity
from berth.agent.registration import register_agent
from berth.cluster.leader.hub import NodeHub
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.listener import (
    ClusterListener,
    build_cluster_app,
    cluster_ssl_context,
    cluster_tls_files,
)
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.enrollment import AuditLog, EnrollmentService
from berth.cluster.protocol.errors import CloseCode
from berth.cluster.protocol.frames import (
    PROTOCOL_MAX,
    PROTOCOL_MIN,
    Hello,
    Inventory,
    Welcome,
    decode_frame,
    encode_frame,
)
from berth.errors import StoreError
from berth.paths import BerthHome
from berth.store import Store
from support.leader_home import leader_home
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

#: The new active's wait before it marks detached nodes (``node_timeout_s`` in a leader).
SWEEP_AFTER_S = 3.0


@dataclass
class HubLeader:
    url: str
    ca: CertificateAuthority
    store: Store
    hub: NodeHub
    agents: dict[str, AgentIdentity]

    def agent_tls(self, label: str) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=self.ca.cert_pem.decode())
        identity = self.agents[label]
        context.load_cert_chain(str(identity.cert_path), str(identity.key_path))
        return context


@contextlib.asynccontextmanager
async def hub_leader(tmp_path: Path) -> AsyncIterator[HubLeader]:
    """The cluster listener and hub on loopback, nodes ``gpu-a`` and ``gpu-b`` enrolled and,
    as the last active left them, ``ready`` in the store."""
    made = leader_home(tmp_path)
    home, ca, store, sock, url = made.home, made.ca, made.store, made.sock, made.url
    enrollment = EnrollmentService(
        store=store, ca=ca, pepper=b"p" * 32, cluster_url=url, audit=AuditLog(home.audit_log)
    )
    hub = NodeHub(store, LinkRegistry(), node_timeout_s=60.0)
    app = build_cluster_app(
        enrollment=enrollment, ca_pem=ca.cert_pem, agent_handler=hub.handle_agent
    )
    tls = cluster_ssl_context(ca, *cluster_tls_files(ca, "127.0.0.1", home.ca_dir))
    listener = ClusterListener(app, sock, tls)
    await listener.start()
    try:
        agents = {}
        for label in ("gpu-a", "gpu-b"):
            uri = enrollment.issue_token(label).uri
            identity = await asyncio.to_thread(register_agent, uri, BerthHome(tmp_path / label))
            store.set_node_status(identity.node_id, "ready")
            agents[label] = identity
        yield HubLeader(url, ca, store, hub, agents)
    finally:
        await hub.shutdown()
        await listener.stop()
        store.close()


@contextlib.asynccontextmanager
async def attached(leader: HubLeader, label: str) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
    """``label``'s agent dialled and welcomed; the link stays open inside the block."""
    hello = Hello(
        protocol_min=PROTOCOL_MIN,
        protocol_max=PROTOCOL_MAX,
        agent_version="0-test",
        inventory=Inventory(hostname=label),
    )
    url = leader.url.replace("https://", "wss://") + "/cluster/agent"
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(url, ssl=leader.agent_tls(label), max_msg_size=0) as ws,
    ):
        await ws.send_bytes(encode_frame(hello))
        message = await ws.receive(timeout=15)
        assert message.type is aiohttp.WSMsgType.BINARY, message
        assert isinstance(decode_frame(message.data), Welcome)
        yield ws
    await asyncio.sleep(0.1)  # aiohttp's advice: let SSL transports shut down


async def test_a_new_active_marks_only_the_nodes_that_did_not_reattach(tmp_path: Path) -> None:
    async with hub_leader(tmp_path) as leader:
        a, b = leader.agents["gpu-a"].node_id, leader.agents["gpu-b"].node_id
        sweep = asyncio.create_task(leader.hub.mark_detached_unreachable(SWEEP_AFTER_S))
        async with attached(leader, "gpu-a"):  # gpu-a's agent dials the new active in time
            assert leader.hub.is_connected(a)
            marked = await asyncio.wait_for(sweep, SWEEP_AFTER_S + EVENT_TIMEOUT_S)
            assert marked == [b]
            assert leader.store.get_node(a).status == "ready"
            assert leader.store.get_node(b).status == "unreachable"
            assert leader.store.get_node("local").status == "ready"


async def test_a_leader_standing_down_sends_its_agents_to_the_active(tmp_path: Path) -> None:
    async with hub_leader(tmp_path) as leader:
        a = leader.agents["gpu-a"].node_id
        async with attached(leader, "gpu-a") as ws:
            await leader.hub.close_for_standby("active=https://b.lan:11501")
            message = await ws.receive(timeout=15)
            assert message.type is aiohttp.WSMsgType.CLOSE, message
            assert (message.data, message.extra) == (
                CloseCode.NOT_LEADER, "active=https://b.lan:11501")  # fmt: skip
        assert not leader.hub.is_connected(a)
        await asyncio.sleep(0.5)  # a mark would be a background write: give it time
        assert leader.store.get_node(a).status == "ready"  # the active's to write now


class StandingBy:
    """An agent gate that says this leader is a standby (as shared leadership's roster does
    once the lease is another's)."""

    def refusal(self) -> str | None:
        return "active=https://b.lan:11501"

    def leaders(self) -> list[str]:
        return []


async def test_a_link_that_ends_on_a_leader_no_longer_active_marks_nothing(
    tmp_path: Path,
) -> None:
    # As an active resumed past its lease finds its links dead: the agents are on the new
    # active now, so it must not write their nodes unreachable.
    async with hub_leader(tmp_path) as leader:
        a, b = leader.agents["gpu-a"].node_id, leader.agents["gpu-b"].node_id
        async with attached(leader, "gpu-b"):
            pass  # an active's link that ends: its node is unreachable
        await wait_for_async(lambda: leader.store.get_node(b).status == "unreachable",
                             EVENT_TIMEOUT_S, "gpu-b to be marked")  # fmt: skip
        async with attached(leader, "gpu-a"):
            leader.hub.agent_gate = StandingBy()
        await wait_for_async(lambda: not leader.hub.is_connected(a), EVENT_TIMEOUT_S, "the end")
        await asyncio.sleep(0.5)  # a mark would be a background write: give it time
        assert leader.store.get_node(a).status == "ready"


async def _dial_close(leader: HubLeader, label: str) -> tuple[int, str]:
    """``label``'s agent dials; the close code and reason it is answered with."""
    url = leader.url.replace("https://", "wss://") + "/cluster/agent"
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(url, ssl=leader.agent_tls(label), max_msg_size=0) as ws,
    ):
        message = await ws.receive(timeout=15)
        assert message.type is aiohttp.WSMsgType.CLOSE, message
        return int(message.data), str(message.extra)


async def test_a_leader_whose_store_does_not_answer_still_answers_agents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database outage (issue 37): a standby sends agents on without asking the store; an
    active that cannot look the node up closes with 1011; either way the agent hears a
    close it redials after, not a broken handshake."""
    async with hub_leader(tmp_path) as leader:

        def out_of_reach(_fingerprint: str) -> None:
            raise StoreError("database error: no answer within the call's 4 s deadline")

        monkeypatch.setattr(leader.store, "find_node_by_fingerprint", out_of_reach)
        assert await _dial_close(leader, "gpu-a") == (
            CloseCode.INTERNAL_ERROR, "the leader's store did not answer")  # fmt: skip
        leader.hub.agent_gate = StandingBy()
        assert await _dial_close(leader, "gpu-a") == (
            CloseCode.NOT_LEADER, "active=https://b.lan:11501")  # fmt: skip
