"""The leader's data path to each agent: straight to the agent's ingress when it answers,
else through the link's tunnel (``docs/protocol.md``, Direct data path).

:class:`DataPaths` watches the :class:`~berth.cluster.leader.link_registry.LinkRegistry`. When an
agent links whose Hello advertised an address (and who lists ``op.ingress``), it

1. issues the agent's ingress certificate (:mod:`berth.cluster.pki.direct_tls`) and sends it,
   with the leader's client certificate, in the ``ingress`` op;
2. probes ``GET /healthz`` at the advertised address over mutual TLS at once and then every
   ``probe_interval_s``, each probe bounded by ``probe_timeout_s``;
3. on a good probe (``200`` naming the node) sends the node's requests direct; on a failed
   one, through the tunnel, and gives up the requests still waiting on the direct path for
   the head of their answer, which then go through the tunnel as well; after
   :data:`DEAD_AFTER_FAILED_PROBES` failed probes in a row, answers still streaming over it
   are closed too (the client sees the stream end with an error, as when a link dies).

It is the proxy's way to remote engines (:class:`berth.engine_http.answer.HttpOpener`):
:meth:`DataPaths.open_http` goes direct while the node's path is up, except a request that
would queue behind :data:`MAX_CONNECTING` TLS handshakes to the ingress (a burst of new
exchanges with no idle connection), which the tunnel, multiplexed on its one connection,
carries at once; the pool grows by that many handshakes at a time. A direct attempt that
fails before the first byte of its answer (no connection, a TLS refusal, a connection closed
before the head) is sent through the tunnel at once, and the path stays down until the next
good probe. Failures of the engine itself (reported by the ingress with the tunnel's reset
codes) are raised as the tunnel would raise them, without a second attempt. Every other
node, and every request while the path is down, goes through the tunnel unchanged.

Each node's connections are one keep-alive :class:`~berth.engine_http.pool.UpstreamPool`
(the proxy's pool to engines, over TLS): an exchange takes an idle connection when there is
one, so sequential streams pay one handshake in all, not one each. A connection goes back
idle when its answer ends, is closed after :data:`IDLE_TIMEOUT_S` idle, and is never used
again once it failed or its peer closed it; the whole pool goes when the node's link does
(a new link, perhaps with a new certificate, gets a new pool), and idle connections are
closed when the node's certificates are renewed. Concurrent streams still take one
connection each: HTTP/1.1 does not multiplex.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from berth.cluster.leader.agent_link import AgentLink
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.remote_link import RemoteLink
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.direct_tls import (
    INGRESS_CERT_DAYS,
    ensure_leader_certificate,
    ingress_server_name,
    issue_ingress_certificate,
    leader_client_context,
)
from berth.cluster.protocol.direct import (
    HEALTH_PATH,
    MAX_DIRECT_CONNECTIONS,
    RESET_HEADER,
    deployment_target,
    parse_address,
)
from berth.cluster.protocol.frames import ResetCode
from berth.cluster.protocol.ops import INGRESS
from berth.engine_http.answer import EngineAnswer, HttpOpener
from berth.engine_http.errors import UpstreamConnectError, UpstreamError, UpstreamTimeoutError
from berth.engine_http.origin import Origin
from berth.engine_http.pool import UpstreamPool
from berth.engine_http.request import EngineRequest
from berth.errors import BerthError

log = logging.getLogger(__name__)

DataPathName = Literal["direct", "tunnel"]

#: Seconds between probes of an agent's ingress (0 turns the direct path off).
DEFAULT_PROBE_INTERVAL_S = 2.0
#: Seconds one probe may take, from connecting to the end of its answer.
DEFAULT_PROBE_TIMEOUT_S = 2.0
#: Seconds to make a connection (TCP and TLS) to an agent's ingress.
DEFAULT_CONNECT_TIMEOUT_S = 3.0
#: Seconds between attempts to have an agent start its ingress after it failed to.
CONFIGURE_RETRY_S = 30.0
#: Failed probes in a row after which answers still streaming direct are closed as well.
DEAD_AFTER_FAILED_PROBES = 3
#: TLS handshakes to one ingress at a time; a request that would wait behind them (no idle
#: connection) takes the tunnel instead, so a burst grows the pool gradually.
MAX_CONNECTING = 8
#: Seconds a connection to an ingress stays open idle (it is reused until then): under the
#: ingress's own keep-alive timeout (``ListenerLimits.keepalive_timeout_s``, 15 s by
#: default), so the leader ends an idle connection before the ingress does and never sends a
#: request on one being closed. The probes keep one warm.
IDLE_TIMEOUT_S = 10.0
#: Seconds after which an agent's ingress certificate is issued anew: half its lifetime.
RENEW_AFTER_S = INGRESS_CERT_DAYS * 86400 / 2


@dataclass(frozen=True)
class DataPath:
    """How the leader reaches a node's engines now: ``path`` (``direct`` or ``tunnel``),
    ``reason`` (why, in words), the address the agent advertised (``""``: none), and when
    the path last changed (epoch seconds)."""

    path: DataPathName
    reason: str
    advertise: str
    since: float


class _PathFailed(Exception):
    """A direct attempt failed before the first byte of its answer: try the tunnel."""


class _Node:
    """One linked agent's direct path: its pool, the prober, and the path's state."""

    def __init__(self, link: RemoteLink, now: float) -> None:
        self.link = link
        self.node_id = link.node_id
        self.advertise = link.advertise
        self.origin: Origin | None = None
        self.pool: UpstreamPool | None = None
        self.task: asyncio.Task[None] | None = None
        self.up = False
        self.reason = ""
        self.since = now
        self.configured_at: float | None = None
        self.leader_pem = b""  # the leader certificate the agent's ingress lets in
        self.failed_probes = 0


class DataPaths:
    """The leader's data paths to its agents; see the module docstring.

    ``tunnel`` is the fallback (the hub), ``links`` the registry watched for agents coming
    and going, ``ca`` and ``ca_dir`` where the leader's client certificate is issued and
    kept. ``probe_interval_s`` of 0 turns the direct path off: every request goes through
    the tunnel. ``read_timeout_s`` bounds every wait for an engine on the direct path, as
    the proxy's own read timeout does. Call :meth:`start` before use, :meth:`close` after.
    """

    def __init__(
        self,
        tunnel: HttpOpener,
        links: LinkRegistry,
        ca: CertificateAuthority,
        ca_dir: Path,
        *,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float | None = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._tunnel = tunnel
        self._links = links
        self._ca = ca
        self._ca_dir = ca_dir
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._context: ssl.SSLContext | None = None
        self._leader_pem = b""
        self._unwatch: Callable[[], None] | None = None
        self._cleanups: set[asyncio.Future[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._probe_interval_s > 0

    async def start(self) -> None:
        """Issue (or renew) the leader's client certificate and watch the links."""
        if self.enabled:
            await self._load_leader_certificate()
        self._unwatch = self._links.watch(self._link_changed)
        for link in self._links:
            self._link_changed(link.node_id, link)

    async def close(self) -> None:
        """Stop probing and close every connection to an ingress."""
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        nodes, self._nodes = list(self._nodes.values()), {}
        for node in nodes:
            await self._drop(node)
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    def data_path(self, node_id: str) -> DataPath | None:
        """The node's path now; ``None`` when it has no live remote link."""
        node = self._nodes.get(node_id)
        if node is None:
            return None
        return DataPath("direct" if node.up else "tunnel", node.reason, node.advertise, node.since)

    # -- the proxy's opener ------------------------------------------------------------------

    async def open_http(
        self, node_id: str, deployment_id: str, request: EngineRequest, read_timeout_s: float | None
    ) -> EngineAnswer:
        """Open one exchange with ``deployment_id``'s engine on ``node_id``, direct when the
        node's path is up, else (or when the direct attempt fails before the first byte)
        through the tunnel. Raises what the tunnel raises
        (:meth:`berth.cluster.leader.remote_link.RemoteLink.open_http`)."""
        node = self._nodes.get(node_id)
        if node is not None and node.up and not _saturated(node):
            try:
                return await self._open_direct(node, deployment_id, request)
            except _PathFailed as exc:
                if node.up:  # else a probe put it down and gave this request up: its reason
                    self._set(node, False, f"a direct request failed before its answer "
                              f"({exc}); the tunnel until the next good probe")  # fmt: skip
        return await self._tunnel.open_http(node_id, deployment_id, request, read_timeout_s)

    async def _open_direct(
        self, node: _Node, deployment_id: str, request: EngineRequest
    ) -> EngineAnswer:
        pool, origin = node.pool, node.origin
        assert pool is not None and origin is not None
        try:
            target = deployment_target(deployment_id, request.target)
            response = await pool.request(
                origin, request.method, target, request.headers, request.body
            )
        except UpstreamTimeoutError:
            raise  # the engine is slow: the tunnel would wait as long
        except UpstreamError as exc:
            raise _PathFailed(exc.why) from exc
        reset = response.header(RESET_HEADER)
        if reset is None:
            return response
        try:
            detail = await response.read(4096)
        except UpstreamError:
            detail = b""
        finally:
            response.close()
        code = ResetCode(reset.decode("latin-1"))
        message = _error_message(detail) or code.value
        if code is ResetCode.REFUSED:
            raise _PathFailed(message)
        # The engine failed, not the path: raised as RemoteLink.open_http raises a reset.
        tunnel_origin = Origin(node.node_id, 0)
        if code is ResetCode.ENGINE_TIMEOUT:
            raise UpstreamTimeoutError(tunnel_origin, self._read_timeout_s or 0.0)
        raise UpstreamConnectError(tunnel_origin, f"could not be reached ({message})")

    # -- links coming and going --------------------------------------------------------------

    def _link_changed(self, node_id: str, link: AgentLink | None) -> None:
        old = self._nodes.get(node_id)
        if old is not None and old.link is link:
            return
        if old is not None:
            del self._nodes[node_id]
            cleanup = asyncio.ensure_future(self._drop(old))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
        if isinstance(link, RemoteLink):
            self._adopt(link)

    def _adopt(self, link: RemoteLink) -> None:
        node = _Node(link, self._clock())
        self._nodes[link.node_id] = node
        why_not = self._why_tunnel_only(link)
        address = parse_address(link.advertise)
        if why_not is not None or address is None:
            node.reason = why_not or f"the agent advertises {link.advertise!r}, not HOST:PORT"
            return
        node.origin = Origin(*address)
        node.pool = self._new_pool(node)
        node.reason = f"setting up the agent's ingress at {link.advertise}"
        node.task = asyncio.create_task(self._run(node), name=f"direct-{link.node_id}")

    def _new_pool(self, node: _Node) -> UpstreamPool:
        assert self._context is not None
        return UpstreamPool(
            connect_timeout_s=self._connect_timeout_s,
            read_timeout_s=self._read_timeout_s,
            max_connections=MAX_DIRECT_CONNECTIONS,
            idle_timeout_s=IDLE_TIMEOUT_S,
            ssl_context=self._context,
            server_hostname=ingress_server_name(node.node_id),
        )

    def _why_tunnel_only(self, link: RemoteLink) -> str | None:
        if not self.enabled:
            return "the direct path is off on this leader (direct_probe_interval_s = 0)"
        if not link.advertise:
            return "the agent advertises no address (berth agent start --advertise HOST:PORT)"
        if INGRESS.capability not in link.capabilities:
            return f"the agent advertises {link.advertise} but offers no {INGRESS.capability}"
        if link.certificate_der is None:
            return "the leader did not see the agent's certificate (a proxy forwards it)"
        return None

    async def _drop(self, node: _Node) -> None:
        """Stop probing ``node`` (forgotten already) and close its connections."""
        if node.task is not None:
            node.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await node.task
        if node.pool is not None:
            await node.pool.close()

    # -- setting up and probing --------------------------------------------------------------

    async def _run(self, node: _Node) -> None:
        while True:
            # Due at first, when its certificate is half-way to expiry, and when the
            # leader's own was renewed meanwhile (for another node): new connections
            # present the new one, which this agent's ingress does not let in yet.
            due = (
                node.configured_at is None
                or self._clock() - node.configured_at > RENEW_AFTER_S
                or node.leader_pem != self._leader_pem
            )
            if due and not await self._configure(node):
                await asyncio.sleep(CONFIGURE_RETRY_S)
                continue
            failure = await self._probe(node)
            if failure is None:
                node.failed_probes = 0
                self._set(node, True, f"its ingress at {node.advertise} answers probes")
            else:
                node.failed_probes += 1
                self._set(node, False, failure)
                if node.failed_probes == DEAD_AFTER_FAILED_PROBES:
                    await self._cut_off(node)
            await asyncio.sleep(self._probe_interval_s)

    async def _configure(self, node: _Node) -> bool:
        """Send the agent its ingress certificates; whether it took them."""
        link = node.link
        assert link.certificate_der is not None
        try:
            await self._load_leader_certificate()
            certificate = await asyncio.to_thread(
                issue_ingress_certificate, self._ca, link.certificate_der, node.node_id
            )
            leader_pem = self._leader_pem
            await link.configure_ingress(certificate, leader_pem)
        except BerthError as exc:
            self._set(node, False, f"the agent could not start its ingress: {exc}")
            log.warning("node %s: direct ingress not started: %s", node.node_id, exc)
            return False
        renewed = node.configured_at is not None
        node.configured_at = self._clock()
        node.leader_pem = leader_pem
        if renewed and node.pool is not None:
            # Idle connections were made with the old certificates: new ones take over.
            node.pool.close_idle()
        return True

    async def _probe(self, node: _Node) -> str | None:
        """One probe of the node's ingress: ``None`` when it answered for the node, else
        what went wrong."""
        pool, origin = node.pool, node.origin
        assert pool is not None and origin is not None
        try:
            async with asyncio.timeout(self._probe_timeout_s):
                response = await pool.request(origin, b"GET", HEALTH_PATH, [], b"")
                try:
                    body = await response.read(4096)
                finally:
                    response.close()
        except TimeoutError:
            return (f"its ingress at {node.advertise} did not answer a probe within "
                    f"{self._probe_timeout_s:g} s")  # fmt: skip
        except UpstreamError as exc:
            return f"probe of its ingress at {node.advertise}: {exc.why}"
        answered = _node_of(body) if response.status == 200 else None
        if answered != node.node_id:
            return (f"its ingress at {node.advertise} answered a probe with status "
                    f"{response.status} for node {answered}")  # fmt: skip
        return None

    async def _cut_off(self, node: _Node) -> None:
        """The ingress has failed :data:`DEAD_AFTER_FAILED_PROBES` probes in a row: close the
        answers still streaming over it too (they would hang until the read timeout on a
        dead path) and start over with a new pool."""
        old, node.pool = node.pool, self._new_pool(node)
        if old is None:
            return
        cut = old.fail_all(f"its ingress failed {DEAD_AFTER_FAILED_PROBES} probes in a row")
        if cut:
            log.warning("node %s: %d direct answers cut off: the ingress failed %d probes in "
                        "a row", node.node_id, cut, DEAD_AFTER_FAILED_PROBES)  # fmt: skip
        await old.close()

    def _set(self, node: _Node, up: bool, reason: str) -> None:
        if self._nodes.get(node.node_id) is not node:
            return  # forgotten meanwhile: a newer link has the node
        changed = up != node.up
        node.reason = reason
        if not changed:
            return
        node.up = up
        node.since = self._clock()
        if up:
            log.info("node %s: data path direct: %s", node.node_id, reason)
            return
        log.warning("node %s: data path tunnel: %s", node.node_id, reason)
        if node.pool is not None:
            given_up = node.pool.fail_unanswered("the direct path went down")
            if given_up:
                log.info("node %s: %d requests waiting on the direct path go through the "
                         "tunnel", node.node_id, given_up)  # fmt: skip

    async def _load_leader_certificate(self) -> None:
        cert_path, key_path = await asyncio.to_thread(
            ensure_leader_certificate, self._ca, self._ca_dir
        )
        pem = await asyncio.to_thread(cert_path.read_bytes)
        if pem == self._leader_pem and self._context is not None:
            return
        if self._context is None:
            self._context = leader_client_context(self._ca.cert_pem, cert_path, key_path)
        else:  # renewed: new connections present the new one
            self._context.load_cert_chain(str(cert_path), str(key_path))
        self._leader_pem = pem


def _saturated(node: _Node) -> bool:
    """Whether a request sent direct now would wait for a new connection behind
    :data:`MAX_CONNECTING` others being made (a burst): the tunnel carries it at once."""
    pool = node.pool
    return pool is not None and pool.idle_connections == 0 and pool.connecting >= MAX_CONNECTING


def _node_of(body: bytes) -> str | None:
    try:
        value = json.loads(body).get("node_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _error_message(body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return message if isinstance(message, str) else ""
