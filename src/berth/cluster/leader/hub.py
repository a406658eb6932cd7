"""The leader's hub of agent links: the ``/cluster/agent`` WebSocket endpoint.

For every connection it: sends the agent to the active leader (``NOT_LEADER``) when this one
is a standby, before asking the store anything; takes the node's identity from the verified
client certificate (never from a frame) and checks it against the store
(:mod:`berth.cluster.pki.node_identity`; a store that does not answer closes with 1011); refuses
with a typed close code (``BAD_CERTIFICATE``, ``NODE_REMOVED``, ``PROTOCOL_ERROR``,
``UNSUPPORTED_VERSION``); waits for Hello and answers Welcome; closes an older session of the
same node (``SUPERSEDED``); attaches a :class:`RemoteLink` to the leader's
:class:`LinkRegistry`; and watches it: a link on which nothing (not even a pong) arrived for
``link_timeout_s`` is dead and ends at once (:class:`~berth.cluster.link.connection.Liveness`), and
one that sent no frame for ``node_timeout_s`` (pongs but no heartbeats) is closed; either way
the node is marked ``unreachable``. When a link comes up or goes down the lifecycle manager
hears of it, to reconcile deployments and stop routing to that node; an engine an agent
reports ended (in a heartbeat it sends at once) leaves routing as the heartbeat is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from aiohttp import web

from berth import __version__
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.cluster.leader.dial_limit import DialRateLimiter
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.remote_link import RemoteLink, TunnelResponse
from berth.cluster.link.connection import LinkConnection
from berth.cluster.link.liveness import LINK_TIMEOUT_S, Liveness
from berth.cluster.link.tunnel_stream import TunnelStream
from berth.cluster.pki.enrollment import AuditLog
from berth.cluster.pki.node_identity import identify_node
from berth.cluster.pki.peer_identity import ForwardedFingerprintTrust
from berth.cluster.pki.renewal import LinkCertificates, LinkDeadline
from berth.cluster.protocol.errors import CloseCode, LinkError, rate_limited_reason
from berth.cluster.protocol.frames import Heartbeat, Hello, Request, ResetCode
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.limits import LinkLimits
from berth.cluster.protocol.ops import RENEW, SPEC_CAPABILITY
from berth.cluster.protocol.payloads import (
    AdoptedState,
    EngineState,
    ErrorCode,
    ErrorInfo,
    Inventory,
    policy_of,
)
from berth.cluster.protocol.session import Role
from berth.cluster.wire_forms import gpu_infos
from berth.engine_http.errors import UpstreamConnectError
from berth.engine_http.origin import Origin
from berth.engine_http.request import EngineRequest
from berth.errors import BerthError, StoreError
from berth.observability.cluster import ClusterMetrics
from berth.runtime.base import EngineExit
from berth.store import Store
from berth.vocab.records import NodeHardware

log = logging.getLogger(__name__)

#: Seconds between an agent's heartbeats (told to it in Welcome).
HEARTBEAT_INTERVAL_S = 5.0
#: Seconds of silence after which a node counts as unreachable (three missed heartbeats).
NODE_TIMEOUT_S = 15.0
#: What this leader does over a link (sent in Welcome).
LEADER_CAPABILITIES = ("stream.http", "stream.logs", "op.pull")
#: Seconds an agent has to send Hello once its WebSocket is open.
HELLO_TIMEOUT_S = 10.0


class NodeListener(Protocol):
    """Who hears of links coming and going (the lifecycle manager)."""

    async def node_connected(self, node_id: str, engines: list[EngineState]) -> None: ...

    def node_disconnected(self, node_id: str) -> None: ...

    def adopted_reported(self, node_id: str, adopted: list[AdoptedState]) -> None: ...

    def engine_ended(self, node_id: str, deployment_id: str, exited: EngineExit | None) -> None:
        """An agent reported that one of its engines ended by itself."""
        ...


class AgentGate(Protocol):
    """Shared leadership's say on agents (:class:`berth.daemon.leader_roster.LeaderRoster`)."""

    def refusal(self) -> str | None:
        """``None`` to take agents (this leader is active), else the ``NOT_LEADER`` reason."""
        ...

    def leaders(self) -> Sequence[str]:
        """Every leader's cluster URL, for Welcome."""
        ...


class NodeHub:
    """Live agent sessions by node id, and the WebSocket endpoint that makes them.

    ``links`` is the leader's registry of live links: the hub attaches a :class:`RemoteLink`
    when an agent says Hello and detaches it when the link ends.  ``listener``, when given,
    hears of links coming and going and of the adopted endpoints agents report.
    ``cluster_metrics``, when given, hears every session's start, every heartbeat and every
    node removal;
    ``audit``, when given, gets a ``node.lost`` line (id, label, close code) per lost link.
    ``forwarded``, when given, turns on the reverse-proxy fingerprint mode
    (:mod:`berth.cluster.pki.peer_identity`). ``link_timeout_s`` is the dead-link timeout both
    ends keep (told to agents in Welcome); ``node_timeout_s`` the longest an agent may go
    without sending a frame. ``certificates``, when given, renews agents' certificates over
    their links and closes a link whose certificate expired (:mod:`berth.cluster.pki.renewal`).
    ``dial_limiter`` bounds how often one node may dial (``RATE_LIMITED`` beyond it).
    """

    def __init__(
        self,
        store: Store,
        links: LinkRegistry,
        *,
        listener: NodeListener | None = None,
        limits: LinkLimits | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        node_timeout_s: float = NODE_TIMEOUT_S,
        link_timeout_s: float = LINK_TIMEOUT_S,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        cluster_metrics: ClusterMetrics | None = None,
        audit: AuditLog | None = None,
        forwarded: ForwardedFingerprintTrust | None = None,
        certificates: LinkCertificates | None = None,
        dial_limiter: DialRateLimiter | None = None,
    ) -> None:
        self._dial_limiter = dial_limiter or DialRateLimiter()
        self._store = store
        #: renewal over links and the expiry of their certificates (``None``: neither)
        self._certificates = certificates
        self._forwarded = forwarded
        self._audit = audit
        self._cluster_metrics = cluster_metrics
        self._links = links
        self.limits = limits or LinkLimits()
        self._heartbeat_interval_s = heartbeat_interval_s
        self._node_timeout_s = node_timeout_s
        self._liveness = Liveness(link_timeout_s)
        self._hello_timeout_s = hello_timeout_s
        self._clock = clock
        #: each node's live session: its link, which owns the connection
        self._sessions: dict[str, RemoteLink] = {}
        self._listener = listener
        self._shutting_down = False
        self._background: set[asyncio.Future[Any]] = set()
        self._saved_at: dict[str, float] = {}
        #: with shared leadership: who may take agents, and the leaders Welcome lists
        self.agent_gate: AgentGate | None = None

    @property
    def renewal_refusals(self) -> dict[str, str]:
        """Why each node's last certificate renewal was refused (nodes whose last one
        succeeded are absent)."""
        return {} if self._certificates is None else self._certificates.refusals

    def is_connected(self, node_id: str) -> bool:
        link = self._sessions.get(node_id)
        return link is not None and not link.conn.closed

    def has_reported(self, node_id: str) -> bool:
        """Whether the node has sent signals the router can use: ``local`` always; an
        agent once its first heartbeat arrived."""
        if node_id == LOCAL_NODE_ID:
            return True
        link = self.remote_link(node_id)
        return link is not None and link.load.heartbeat_at > 0

    def free_vram_mb(self, node_id: str) -> int | None:
        """The most free memory on one GPU of a remote node, per its last report (``None``:
        no GPUs or unknown): what a model that must fit on one GPU can use."""
        link = self.remote_link(node_id)
        if link is None or not link.last_inventory.gpus:
            return None
        return max(g.memory_total_mb - g.memory_used_mb for g in link.last_inventory.gpus)

    def remote_link(self, node_id: str) -> RemoteLink | None:
        """The node's live remote link (``None``: it has none, or it is node ``local``)."""
        return self._sessions.get(node_id)

    async def open_http(
        self, node_id: str, deployment_id: str, request: EngineRequest, read_timeout_s: float | None
    ) -> TunnelResponse:
        """The proxy's way to a remote engine (:class:`berth.engine_http.answer.HttpOpener`).

        Raises ``UpstreamConnectError`` when the node has no live link.
        """
        link = self.remote_link(node_id)
        if link is None:
            raise UpstreamConnectError(
                Origin(node_id, 0), f"could not be reached (node {node_id} is not connected)"
            )
        return await link.open_http(deployment_id, request, read_timeout_s)

    async def disconnect_node(self, node_id: str) -> None:
        """Close the node's live link at once with ``NODE_REMOVED`` (the node was removed)
        and retire its metrics series (:meth:`ClusterMetrics.remove_node`)."""
        if self._cluster_metrics is not None:
            self._cluster_metrics.remove_node(node_id)
        link = self._sessions.get(node_id)
        if link is not None:
            conn = link.conn
            self._drop(node_id, conn)
            await conn.close(CloseCode.NODE_REMOVED, "this node was removed from the cluster")

    async def certificate_replaced(self, node_id: str) -> None:
        """The node was enrolled again: close a live link made with its old certificate
        (``BAD_CERTIFICATE``); the new agent dials with the new one."""
        link = self._sessions.get(node_id)
        if link is not None:
            conn = link.conn
            self._drop(node_id, conn)
            await conn.close(CloseCode.BAD_CERTIFICATE, "this node was enrolled again")

    async def shutdown(self) -> None:
        """Close every link with ``LEADER_SHUTTING_DOWN`` (agents redial with backoff)."""
        self._shutting_down = True
        conns = [(node_id, link.conn) for node_id, link in self._sessions.items()]
        for node_id, conn in conns:
            self._drop(node_id, conn)
        await asyncio.gather(
            *(c.close(CloseCode.LEADER_SHUTTING_DOWN, "the leader is shutting down")
              for _n, c in conns),
            return_exceptions=True,
        )  # fmt: skip

    # -- the endpoint ------------------------------------------------------------------------

    async def handle_agent(self, request: web.Request) -> web.StreamResponse:
        """``GET /cluster/agent``: one agent's link, from upgrade to close."""
        peer = request.remote or "?"
        # The WebSocket layer's own cap is looser than the protocol's, so that a frame a
        # little over the limit is read whole and refused by the decoder with a clean close
        # (1009) the agent can read; far larger ones are cut off by aiohttp.
        # Pings and pongs go up to the connection, which answers and sends them itself and
        # counts them as signs of life (autoping=False).
        ws = web.WebSocketResponse(
            max_msg_size=4 * self.limits.max_frame_bytes, compress=False, autoping=False
        )
        await ws.prepare(request)
        # A standby sends the agent on before asking the store anything: it answers at once
        # even while the database does not (an outage makes every leader a standby), and the
        # active checks the agent's identity when it dials there (docs/ha.md).
        standby = self.agent_gate.refusal() if self.agent_gate is not None else None
        if standby is not None:
            log.info("sent the agent at %s to the active leader: %s", peer, standby)
            await ws.close(code=CloseCode.NOT_LEADER, message=standby.encode())
            return ws
        try:
            node_id, refusal, certificate_der, not_after = await identify_node(
                request, self._store, self._forwarded, self._clock
            )
        except StoreError as exc:  # the store is out of reach: the agent redials
            log.warning("refused agent link from %s: the store did not answer: %s", peer, exc)
            await ws.close(
                code=CloseCode.INTERNAL_ERROR, message=b"the leader's store did not answer"
            )
            return ws
        if refusal is not None:
            log.warning("refused agent link from %s: %s", peer, refusal[1])
            # A close frame's reason has room for 123 bytes (RFC 6455 section 5.5).
            await ws.close(code=refusal[0], message=refusal[1].encode()[:120])
            return ws
        assert node_id is not None
        retry_after_s = self._dial_limiter.check(node_id, time.monotonic())
        if retry_after_s is not None:
            log.warning("refused agent link from %s: node %s dials too often", peer, node_id)
            reason = rate_limited_reason(retry_after_s).encode()
            await ws.close(code=CloseCode.RATE_LIMITED, message=reason)
            return ws
        if self._shutting_down:
            await ws.close(code=CloseCode.LEADER_SHUTTING_DOWN, message=b"shutting down")
            return ws
        conn = LinkConnection(
            Role.LEADER,
            ws,
            self,
            peer=node_id,
            limits=self.limits,
            on_closed=lambda: self._drop(node_id, conn),
            liveness=self._liveness,
        )
        terms = WelcomeTerms(
            node_id=node_id,
            leader_version=__version__,
            heartbeat_interval_s=self._heartbeat_interval_s,
            capabilities=(
                LEADER_CAPABILITIES
                if self._certificates is None
                else (*LEADER_CAPABILITIES, RENEW.capability)
            ),
            link_timeout_s=self._liveness.timeout_s,
            leaders=self.agent_gate.leaders() if self.agent_gate is not None else (),
        )
        try:
            hello = await conn.handshake(
                terms,
                timeout_s=self._hello_timeout_s,
                admit=lambda hello: self._admit(node_id, conn, hello, certificate_der),
                clock=self._clock,
            )
        except LinkError:
            return ws  # refused or gone; the connection closed the socket and said why
        log.info("node %s connected from %s (agent %s)", node_id, peer, hello.agent_version)
        if SPEC_CAPABILITY not in hello.capabilities:
            log.warning("node %s: agent %s does not check signed specs (no %s); only this "
                        "leader's check guards its starts (require_agent_spec_check refuses "
                        "them)", node_id, hello.agent_version, SPEC_CAPABILITY)  # fmt: skip
        watchdog = asyncio.create_task(self._watch(node_id, conn), name=f"watch-{node_id}")
        expiry = None
        if self._certificates is not None:
            watch = self._certificates.watch(conn, LinkDeadline(not_after))
            expiry = asyncio.create_task(watch, name=f"expiry-{node_id}")
        if self._listener is not None:
            # After run() starts: reconciling sends requests whose answers the reader reads.
            self._listener.adopted_reported(node_id, hello.adopted)
            self._spawn(self._reconcile(node_id, hello.engines))
        try:
            await conn.run()
        finally:
            watchdog.cancel()
            if expiry is not None:
                expiry.cancel()
            self._drop(node_id, conn)
            log.info("node %s link closed (code %s)", node_id, conn.close_code)
        return ws

    async def _admit(
        self, node_id: str, conn: LinkConnection, hello: Hello, certificate_der: bytes | None
    ) -> None:
        """Before Welcome: record the node's Hello, make ``conn`` the node's link, and close
        an older session of the node. Refuses a node removed meanwhile (``NODE_REMOVED``)."""
        try:
            await asyncio.to_thread(
                self._store.record_node_hello,
                node_id,
                agent_version=hello.agent_version,
                protocol_version=conn.protocol_version or 0,
                capabilities=hello.capabilities,
                inventory=node_hardware(hello.inventory),
                now=self._clock(),
            )
        except BerthError as exc:
            raise LinkError(str(exc), code=CloseCode.NODE_REMOVED, node_id=node_id) from exc
        # The new session takes the node's place first, then the old one is closed: the
        # node is never without a link, and the old one's end changes nothing.
        previous = self._sessions.get(node_id)
        old = None if previous is None else previous.conn
        link = RemoteLink(
            node_id,
            conn,
            hello.inventory,
            hello.capabilities,
            advertise=hello.advertise,
            certificate_der=certificate_der,
            agent_policy=policy_of(hello.policy) if hello.policy is not None else None,
        )
        self._sessions[node_id] = link
        self._links.attach(link)
        if self._cluster_metrics is not None:
            # Before the session's first heartbeat: its totals may predate this leader.
            self._cluster_metrics.node_connected(node_id)
        if old is not None:
            log.warning("node %s: a newer session replaces the one from %s", node_id, old.peer)
            self._spawn(old.close(CloseCode.SUPERSEDED, "a newer session of this node connected"))

    async def _reconcile(self, node_id: str, engines: list[EngineState]) -> None:
        assert self._listener is not None
        try:
            await self._listener.node_connected(node_id, engines)
        except BerthError:
            log.exception("reconciling node %s failed", node_id)

    async def _watch(self, node_id: str, conn: LinkConnection) -> None:
        interval = min(1.0, self._node_timeout_s / 5)
        while True:
            await asyncio.sleep(interval)
            silent_s = time.monotonic() - conn.last_frame_at
            if silent_s > self._node_timeout_s:
                log.warning("node %s sent no frame for %.0f s: unreachable", node_id, silent_s)
                self._drop(node_id, conn)
                await conn.close(CloseCode.HEARTBEAT_TIMEOUT, "no heartbeat in time")
                return

    def _drop(self, node_id: str, conn: LinkConnection, *, lost: bool = True) -> None:
        """Forget ``conn`` as the node's link (once); the node stops getting traffic.  With
        ``lost`` (the link failed or was ended here), the node is marked unreachable."""
        link = self._sessions.get(node_id)
        if link is None or link.conn is not conn:
            return
        del self._sessions[node_id]
        self._links.detach(link)
        if self._listener is not None:
            self._listener.node_disconnected(node_id)
        if not lost:
            return
        if self._audit is not None and not self._shutting_down:
            self._spawn(self._audit_loss(node_id, conn.close_code))
        self._spawn(self._mark_unreachable(node_id))

    async def _audit_loss(self, node_id: str, code: int | None) -> None:
        assert self._audit is not None
        try:
            label: str | None = (await asyncio.to_thread(self._store.get_node, node_id)).label
        except BerthError:
            label = None
        log.warning("node %s (%s) lost its link (code %s)", node_id, label, code)
        event = {"event": "node.lost", "node_id": node_id, "label": label, "close_code": code}
        await asyncio.to_thread(self._audit.append, event)

    async def _mark_unreachable(self, node_id: str) -> None:
        if node_id in self._sessions:
            return  # a new session came up meanwhile
        if self.agent_gate is not None and self.agent_gate.refusal() is not None:
            # A standby, or an active resumed past its lease whose links died meanwhile:
            # the node's status is the active's to write (it may be connected there).
            return
        with contextlib.suppress(BerthError):  # removed nodes stay removed
            await asyncio.to_thread(self._store.set_node_status, node_id, "unreachable")

    async def mark_detached_unreachable(self, after_s: float) -> list[str]:
        """Wait ``after_s`` seconds (a leader that just took over: ``node_timeout_s``, the
        time its agents get to dial it), then mark ``unreachable`` every node the store
        says is ``ready`` that has no live link to this hub: links that ended with another
        leader (a dead active) are marked by no one else.  Returns the ids marked.  Raises
        ``StoreError`` when the store cannot list the nodes."""
        await asyncio.sleep(after_s)
        nodes = await asyncio.to_thread(self._store.list_nodes)
        marked = []
        for node in nodes:
            if node.id == LOCAL_NODE_ID or node.status != "ready" or self.is_connected(node.id):
                continue
            log.warning("node %s has no link to this leader: unreachable", node.id)
            await self._mark_unreachable(node.id)
            marked.append(node.id)
        return marked

    async def close_for_standby(self, reason: str) -> None:
        """Close every link with ``NOT_LEADER`` and ``reason`` (``active=<cluster URL>``):
        this leader lost the lease, and its agents dial the active at once.  Their nodes
        are not marked unreachable: their status is the active's to write now."""
        conns = [(node_id, link.conn) for node_id, link in self._sessions.items()]
        for node_id, conn in conns:
            self._drop(node_id, conn, lost=False)
        await asyncio.gather(
            *(c.close(CloseCode.NOT_LEADER, reason) for _n, c in conns), return_exceptions=True
        )

    # -- LinkHandler (what the agent sends outside answers and streams) ----------------------

    async def on_request(self, conn: LinkConnection, request: Request) -> None:
        if request.op == RENEW.name and self._certificates is not None:
            await self._certificates.serve(conn, request)
            return
        error = ErrorInfo(
            code=ErrorCode.UNSUPPORTED, message=f"the leader serves no {request.op!r}"
        )
        conn.respond(request.id, error=error)

    async def on_stream(self, conn: LinkConnection, stream: TunnelStream) -> None:
        # The session refuses an agent's STREAM_OPEN, so this never runs.
        stream.reset(ResetCode.REFUSED, "agents do not open streams")

    def on_heartbeat(self, conn: LinkConnection, heartbeat: Heartbeat) -> None:
        node_id = conn.peer
        link = self.remote_link(node_id)
        now = self._clock()
        if link is not None and link.conn is conn:
            link.record_heartbeat(heartbeat, now)
            if self._listener is not None:
                # An engine that ended leaves routing now, before the next request.
                for ended in heartbeat.ended:
                    exited = None
                    if ended.exit_code is not None or ended.exit_signal is not None:
                        exited = EngineExit(ended.exit_code, ended.exit_signal)
                    self._listener.engine_ended(node_id, ended.deployment_id, exited)
                self._listener.adopted_reported(node_id, heartbeat.adopted)
            if self._cluster_metrics is not None:
                self._cluster_metrics.record_heartbeat(node_id, heartbeat, now)
            # Kept in memory on every heartbeat, written at most once an interval: a
            # flood of heartbeats must not queue database writes for everyone.
            if now - self._saved_at.get(node_id, 0.0) >= self._heartbeat_interval_s:
                self._saved_at[node_id] = now
                hardware = node_hardware(link.last_inventory)
                self._spawn(
                    asyncio.to_thread(self._store.record_node_heartbeat, node_id, now, hardware)
                )

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background, keeping a reference until it is done; a failure
        is logged (these tasks have no caller to raise to)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("hub background task failed", exc_info=task.exception())


def node_hardware(inventory: Inventory) -> NodeHardware:
    """The store's record of an agent-reported inventory."""
    return NodeHardware(
        inventory.hostname,
        inventory.cpu_count,
        inventory.memory_total_mb,
        gpu_infos(inventory.gpus),
    )
