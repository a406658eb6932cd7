"""The agent's dial loop: one outbound mTLS WebSocket to the leader, redialled with backoff.

It connects to ``wss://<cluster host>/cluster/agent`` with the agent's client certificate,
trusting only the pinned cluster CA; sends Hello (inventory, capabilities, the engines it
runs); waits for Welcome; then pumps the link through :class:`LinkConnection` while a task
sends a heartbeat every interval the leader asked for. The link pings the leader and is
dead once nothing arrived for the link timeout the leader named in Welcome
(:class:`~berth.cluster.link.connection.Liveness`); a dial (TCP, TLS and the WebSocket upgrade)
that does not finish within ``dial_timeout_s`` fails, so a leader behind a black hole costs
seconds per attempt. When the link ends, the close code decides
(:func:`berth.cluster.protocol.errors.agent_should_redial`): a final refusal (removed node,
bad certificate, superseded, no common version) stops the agent; anything else is redialled
after a capped exponential backoff with equal jitter (:func:`berth.backoff.jittered_delay_s`
from :data:`BACKOFF_BASE_S`, capped by the ``redial_max_s`` setting), which grows only while
no leader answers: after a leader's ``NOT_LEADER`` refusal the redial is its first or second
step (0.5 to 2 s) and the backoff starts over. The status file says so at once. Which leader
it dials is the :class:`~berth.agent.leaders.LeaderList`'s to say: the next one in turn after
a session ends, the active at once after a standby's ``NOT_LEADER`` (docs/ha.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import time
from collections.abc import Callable

import aiohttp

from berth.agent.identity import AgentIdentity, client_ssl_context, load_agent_identity
from berth.agent.leaders import LeaderList
from berth.agent.renewal import REENROLL_HINT, CertificateRenewer
from berth.agent.service import AgentService
from berth.agent.status import RECENT_LINES, AgentStatus
from berth.backoff import jittered_delay_s
from berth.cluster.link.connection import LinkConnection
from berth.cluster.link.liveness import LINK_TIMEOUT_S, Liveness
from berth.cluster.protocol.errors import (
    CloseCode,
    LinkError,
    ProtocolError,
    agent_should_redial,
    retry_after_of,
)
from berth.cluster.protocol.limits import LinkLimits
from berth.cluster.protocol.session import Role
from berth.errors import ConfigError
from berth.paths import BerthHome

log = logging.getLogger(__name__)

#: The first redial delay before jitter, in seconds (it doubles up to ``redial_max_s``).
BACKOFF_BASE_S = 1.0
#: The largest redial delay, in seconds: the ``redial_max_s`` setting's default.
REDIAL_MAX_S = 30.0

__all__ = [
    "BACKOFF_BASE_S",
    "RECENT_LINES",
    "REDIAL_MAX_S",
    "AgentDialer",
    "AgentStatus",
    "cluster_ws_url",
]

#: Seconds the leader has to answer Hello.
WELCOME_TIMEOUT_S = 10.0
#: Seconds a dial may take: TCP connect, TLS handshake and the WebSocket upgrade together.
DIAL_TIMEOUT_S = 5.0


def cluster_ws_url(leader_url: str) -> str:
    """``https://host:port`` (the cluster listener) -> ``wss://host:port/cluster/agent``."""
    base = leader_url.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base.removeprefix("https://")
    return base + "/cluster/agent"


class AgentDialer:
    """Keeps one link to the leader up until a final refusal or :meth:`stop`.

    Between dials it waits ``backoff(attempt)`` seconds (default
    :func:`~berth.backoff.jittered_delay_s` capped at ``redial_max_s``, the setting);
    ``attempt`` counts from 0 again after a link the leader welcomed.  The first dial waits
    ``first_dial_after_s`` (paced restarts: :mod:`berth.agent.exit_status`).
    """

    def __init__(
        self,
        identity: AgentIdentity,
        service: AgentService,
        status: AgentStatus,
        *,
        limits: LinkLimits | None = None,
        backoff: Callable[[int], float] | None = None,
        redial_max_s: float = REDIAL_MAX_S,
        dial_timeout_s: float = DIAL_TIMEOUT_S,
        renew: bool = True,
        leaders: LeaderList | None = None,
        first_dial_after_s: float = 0.0,
    ) -> None:
        self._identity = identity
        self._leaders = leaders or LeaderList([], identity.leader_url)
        self._home = home = BerthHome(identity.cert_path.parent)
        #: renews the certificate over each link (``renew=False``: never, for tests)
        self.renewer = CertificateRenewer(home, identity.node_id, status) if renew else None
        self._dial_timeout_s = dial_timeout_s
        self._service = service
        self._status = status
        self._limits = limits or LinkLimits()
        self._backoff = backoff or functools.partial(
            jittered_delay_s, first_s=BACKOFF_BASE_S, cap_s=redial_max_s
        )
        self._first_dial_after_s = first_dial_after_s
        self._stopping = asyncio.Event()
        self._conn: LinkConnection | None = None
        #: the reason of the last link's close (a rate limit's ``retry_after_s``)
        self._close_reason = ""
        #: the close code that ended the agent (a final refusal), if one did
        self.final_code: int | None = None

    async def stop(self) -> None:
        """Close the link (code 1000) and end :meth:`run`."""
        self._stopping.set()
        if self._conn is not None:
            await self._conn.close(CloseCode.NORMAL, "agent stopping")

    async def run(self) -> int:
        """Dial, serve, redial; returns 0 after :meth:`stop`, 1 after a final refusal.

        The identity files are read again at every dial, so a renewed certificate (or a
        new trust bundle) is used from the next dial on."""
        self._reload_identity()
        ssl_context = client_ssl_context(self._identity)
        attempt = 0
        if self._first_dial_after_s > 0:
            self._status.set("backoff")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._first_dial_after_s)
        async with aiohttp.ClientSession() as http:
            while not self._stopping.is_set():
                url = cluster_ws_url(self._leaders.current)
                self._status.leader_url = self._leaders.current
                self._status.set("connecting")
                ssl_context = self._current_context(ssl_context)
                try:
                    code, welcomed = await self._session(http, url, ssl_context)
                except (LinkError, aiohttp.ClientError, OSError) as exc:
                    # The dial loop must outlive one broken session; redial with backoff.
                    log.exception("the link to the leader failed")
                    self._status.set("backoff", error=f"link failed: {exc}")
                    code, welcomed = None, False
                if self._stopping.is_set():
                    break
                if welcomed:
                    attempt = 0
                if code is not None and not agent_should_redial(code):
                    self.final_code = code
                    expired = code == CloseCode.CERTIFICATE_EXPIRED
                    self._status.set("expired" if expired else "stopped")
                    return 1
                following = self._leaders.ended(code, self._close_reason)
                if following.at_once:
                    self._status.activity(f"dialling the active leader {following.url}")
                    continue
                if following.refused:
                    # A leader answered (no active yet, or not it): short, jittered, not
                    # growing; the backoff starts over (berth.agent.leaders).
                    attempt = 0
                    delay = self._backoff(0 if following.names_active else 1)
                else:
                    delay = self._backoff(attempt)
                    attempt += 1
                retry_after_s = retry_after_of(code, self._close_reason)
                if retry_after_s is not None and retry_after_s > delay:
                    delay = retry_after_s  # the leader said when: not sooner
                self._status.set("backoff")
                self._status.activity(f"redialling in {delay:.1f} s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
        self._status.set("stopped")
        return 0

    def _reload_identity(self) -> None:
        """Read ``agent.yaml`` again (a renewal may have changed the pinned roots); an
        identity given without one (tests) is kept.  Raises :class:`ConfigError`."""
        if self._home.agent_config.exists():
            self._identity = load_agent_identity(self._home)

    def _current_context(self, previous: ssl.SSLContext) -> ssl.SSLContext:
        """The TLS context from the identity files as they are now (``previous`` when they
        cannot be read: the status says why); says so when the certificate has expired."""
        try:
            self._reload_identity()
            context = client_ssl_context(self._identity)
        except ConfigError as exc:
            log.warning("cannot reload the agent's identity: %s", exc)
            self._status.set("connecting", error=str(exc))
            return previous
        if self.renewer is not None:
            facts = self.renewer.show()
            if facts is not None and facts.not_after <= time.time():
                hint = REENROLL_HINT.format(label=self._identity.label)
                self._status.set("expired", error=f"the certificate has expired; fix: {hint}")
        return context

    async def _session(
        self, http: aiohttp.ClientSession, url: str, ssl_context: ssl.SSLContext
    ) -> tuple[int | None, bool]:
        """One connection, from dial to close: (close code or None, whether Welcome came)."""
        self._close_reason = ""
        # Before dialing: the leader waits only seconds for Hello once the socket is open.
        await self._service.check_runtimes()
        await self._service.read_gpus()  # for Hello, off the loop
        try:
            async with asyncio.timeout(self._dial_timeout_s):
                ws = await http.ws_connect(
                    url,
                    ssl=ssl_context,
                    max_msg_size=self._limits.max_frame_bytes,
                    # The connection sends and answers pings itself (Liveness).
                    autoping=False,
                    compress=0,
                    timeout=aiohttp.ClientWSTimeout(ws_close=5.0),
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # aiohttp's connector errors print the SSL context object; the OS error is the news.
            why: object = getattr(exc, "os_error", None) or exc
            if isinstance(exc, TimeoutError):
                why = f"no answer within {self._dial_timeout_s:g} s (TCP, TLS, WebSocket upgrade)"
            self._status.set("backoff", error=f"cannot reach the leader at {url}: {why}")
            log.warning("cannot reach the leader at %s: %s", url, why)
            return None, False
        conn = LinkConnection(Role.AGENT, ws, self._service, peer="leader", limits=self._limits)
        heartbeats: asyncio.Task[None] | None = None
        renewing: asyncio.Task[None] | None = None
        try:
            try:
                welcome = await conn.handshake(self._service.hello(), timeout_s=WELCOME_TIMEOUT_S)
            except ProtocolError as exc:  # this side refused what came, or nothing came
                self._status.set("backoff", error=f"handshake failed: {exc}")
                return conn.close_code, False
            except LinkError:  # the leader closed the link first: a refusal, or it went away
                self._close_reason = conn.close_reason
                self._report_close(conn.close_code, conn.close_reason)
                return conn.close_code, False
            self._leaders.welcomed(welcome.leaders)
            self._conn = conn
            if self._stopping.is_set():  # stop() came during the dial or the handshake
                await conn.close(CloseCode.NORMAL, "agent stopping")
                return conn.close_code, True
            timeout_s = welcome.link_timeout_s
            conn.liveness = Liveness(timeout_s if timeout_s > 0 else LINK_TIMEOUT_S)
            self._status.set("connected")
            self._status.activity(f"connected as node {welcome.node_id}")
            heartbeats = asyncio.create_task(self._heartbeats(conn, welcome.heartbeat_interval_s))
            if self.renewer is not None:
                renewing = asyncio.create_task(self.renewer.run(conn, welcome), name="renewal")
            await conn.run()
            code = conn.close_code
            self._close_reason = conn.close_reason
            self._report_close(code, conn.close_reason)
            return code, True
        finally:
            self._conn = None
            if heartbeats is not None:
                heartbeats.cancel()
            if renewing is not None:
                renewing.cancel()
            if not ws.closed:
                await ws.close()

    async def _heartbeats(self, conn: LinkConnection, interval_s: float) -> None:
        """A heartbeat every ``interval_s``, and one at once when an engine ends."""
        due = self._service.report_due
        while not conn.closed:
            if not due.is_set():  # an end reported now waits for no GPU reading
                await self._service.read_gpus()  # NVML blocks: on a worker thread
            if conn.closed:
                return
            conn.send_heartbeat(self._service.heartbeat(time.time()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(due.wait(), interval_s)

    def _report_close(self, code: int | None, reason: str) -> None:
        try:
            name = CloseCode(code).name.lower().replace("_", " ") if code is not None else ""
        except ValueError:
            name = ""
        text = f"link closed (code {code}{': ' + name if name else ''})"
        if reason:
            text += f": {reason}"
        final = code is not None and not agent_should_redial(code)
        if code == CloseCode.CERTIFICATE_EXPIRED:
            text += f"; fix: {REENROLL_HINT.format(label=self._identity.label)}"
            self._status.set("expired", error=text)
        else:
            self._status.set("stopped" if final else "backoff", error=text)
        if final:
            log.error("%s; not redialling", text)
        else:
            log.warning("%s", text)
