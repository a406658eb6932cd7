"""Runs the leader: :class:`Leader` binds its listeners, builds its graph, starts and stops it.

Shaped as uvicorn's ``Server(config)``: ``Leader(home, settings)`` holds nothing live until
``await leader.start()``, which binds the sockets, builds the object graph
(:func:`berth.daemon.build.build_leader`) and starts every piece, and ``await leader.stop()``
stops them in order and releases what ``start`` took (ports, the socket and pid files, the
owner lock); ``await leader.serve()`` is the daemon's whole run (signals, start, wait, stop).
Two Leaders on different homes and ports may run in one process.

Two listeners of berth's own HTTP server (:mod:`berth.http_server`) share one event loop: the
public HTTPS listener and the Unix socket for the local CLI; the cluster listener for agents
(aiohttp, see ``cluster/leader/listener.py``) runs on the same loop. All three apply the listener
bounds of the settings (``max_head_bytes`` ...). Sockets are bound first, before anything else
starts, so a port in use fails the start with the listener's name, and the socket file is
created with mode 0600 from the first instant.

With ``leader_only`` the leader is a control plane only: no agent core, no ``local`` link, no
local node sampler; every deployment runs on an agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping

from berth.agent.owner import JournalOwnership, own_engines
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.cluster.protocol.errors import not_leader_reason
from berth.config import Settings
from berth.daemon.build import LeaderParts, build_leader
from berth.daemon.graph import LeaderGraph
from berth.daemon.ha import SharedLeadership
from berth.daemon.link_wait import LinkWait
from berth.daemon.pieces import open_store
from berth.daemon.sockets import bind_sockets
from berth.errors import STANDBY_RESTART_EXIT, DaemonError
from berth.eventloop import freeze_startup_objects
from berth.paths import BerthHome

log = logging.getLogger(__name__)


#: Seconds requests in flight get to finish when the leader stops (as uvicorn gave them).
SHUTDOWN_GRACE_S = 5.0


class Leader:
    """One leader on ``home`` with ``settings``; see the module docstring.

    ``environ`` is read once by :meth:`start` (the reverse proxy fingerprint mode,
    :mod:`berth.cluster.pki.peer_identity`; default ``os.environ``). :attr:`should_exit` is the
    event :meth:`serve` waits on (SIGTERM and SIGINT set it; so does :meth:`request_stop`).

    Leadership: :meth:`start_leading` starts the loops only the leader of a store may run
    (reconcile and the engine watcher, the supervisor's restarts, scaling, drains). A lone Leader
    leads from :meth:`start`; with ``leader_ha`` its :class:`~berth.daemon.ha.SharedLeadership`
    calls it once this leader holds the store's lease (at once, or when a standby takes
    over).  If it loses the lease after leading, a ``leader_only`` Leader steps down
    (:meth:`stop_leading`) and stays on as a standby, to lead again when the lease is free;
    one that runs engines on its own host stops instead (:meth:`request_standby_restart`,
    exiting with ``STANDBY_RESTART_EXIT`` for its service to start it again): its
    node ``local``'s engines and their deployments are its own host's, which a demotion
    would leave unwatched, and which the new active cannot reach.
    """

    def __init__(
        self, home: BerthHome, settings: Settings, *, environ: Mapping[str, str] | None = None
    ) -> None:
        self.home = home
        self.settings = settings
        self._environ: Mapping[str, str] = os.environ if environ is None else environ
        self.should_exit = asyncio.Event()
        self._parts: LeaderParts | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._ownership: JournalOwnership | None = None
        self._leading = False
        self._shared: SharedLeadership | None = None
        self._detached_sweep: asyncio.Task[list[str]] | None = None
        self._restart_as_standby = False
        self._drain_over = asyncio.Event()

    # -- what a started leader shows ------------------------------------------------------

    @property
    def parts(self) -> LeaderParts:
        """Everything built by :meth:`start`. Raises ``DaemonError`` before it."""
        if self._parts is None:
            raise DaemonError("the leader has not been started")
        return self._parts

    @property
    def started(self) -> bool:
        """Whether :meth:`start` has built the leader and :meth:`stop` not yet released it."""
        return self._parts is not None

    @property
    def graph(self) -> LeaderGraph:
        """The object graph the apps serve (store, lifecycle, proxy ...)."""
        return self.parts.graph

    @property
    def public_port(self) -> int:
        """The bound public port (the real one, also for ``public_port = 0``)."""
        return self.parts.sockets.public_port

    @property
    def cluster_port(self) -> int:
        """The bound cluster port."""
        return self.parts.sockets.cluster_port

    @property
    def leading(self) -> bool:
        """Whether the leader-only loops run (:meth:`start_leading`)."""
        return self._leading

    @property
    def exit_status(self) -> int:
        """What the daemon's process exits with after :meth:`serve`:
        :data:`~berth.errors.STANDBY_RESTART_EXIT` after a step-down or a lease lost while
        running engines here (start it again, as a standby), else 0 (a stop on request:
        SIGTERM, SIGINT, ``berth daemon stop``)."""
        return STANDBY_RESTART_EXIT if self._restart_as_standby else 0

    # -- the daemon's run -----------------------------------------------------------------

    async def serve(self) -> None:
        """Run until SIGTERM or SIGINT (or :meth:`request_stop`), then :meth:`stop`; SIGHUP
        reloads the public and cluster listeners' certificates. The signal handlers are
        installed before :meth:`start` (a SIGTERM while starting stops the leader once
        started) and removed at the end.

        Raises what :meth:`start` raises.
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self._reload_certificates)  # never: death
        try:
            await self.start()
            try:
                await self.should_exit.wait()
                if self.graph.run.handed_over:
                    self._restart_as_standby = True
                log.info(
                    "berth leader stopping%s",
                    f" (exit status {STANDBY_RESTART_EXIT}: to be started again as a standby)"
                    if self._restart_as_standby
                    else "",
                )
            finally:
                await self.stop()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    def request_stop(self) -> None:
        """Make :meth:`serve` stop the leader and return."""
        self.should_exit.set()

    def end_drain(self) -> None:
        """End a drain under way now (see :meth:`stop`): the listeners close at once."""
        self._drain_over.set()

    def _stop_signal(self) -> None:
        """SIGTERM or SIGINT: stop; a second one while draining ends the drain."""
        if self.should_exit.is_set():
            self.end_drain()
        self.should_exit.set()

    def request_standby_restart(self) -> None:
        """Make :meth:`serve` stop the leader and return, its :attr:`exit_status` asking its
        service to start it again (it lost the lease while running engines here)."""
        self._restart_as_standby = True
        self.should_exit.set()

    def _reload_certificates(self) -> None:
        if self._parts is not None:
            self._parts.tls.reloads.reload_all()

    # -- start ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the listeners, build the graph, start every piece; the leader is ready
        (``/readyz``) when it returns.

        Raises ``DaemonError`` when a listener cannot bind (naming it, its address and port),
        when ``leader_only`` is set while deployments on this host are still active, or when
        the leader already runs; a failure part way releases what was taken.
        """
        if self._parts is not None:
            raise DaemonError("the leader already runs")
        self.home.ensure()
        sockets = bind_sockets(self.home, self.settings)
        try:
            store = await open_store(self.settings)
        except BaseException:
            sockets.close()
            raise
        try:
            self._parts = await build_leader(
                self.home, self.settings, sockets, store,
                environ=self._environ, pid=os.getpid(), started_at=time.time(),
            )  # fmt: skip
        except BaseException:
            sockets.close()
            store.close()
            raise
        try:
            await self._start_parts(self._parts)
        except BaseException:
            await self._release()
            raise
        log.info(
            "berth leader ready%s: public https://%s:%d, cluster %s, socket %s, CA %s",
            " (leader-only: no engines on this host)" if self.graph.leader_only else "",
            self.settings.public_bind,
            self.public_port,
            self.graph.cluster_url,
            self.home.socket_file,
            self.graph.ca.fingerprint_sha256,
        )

    async def _start_parts(self, parts: LeaderParts) -> None:
        """Start the pieces in order: the data paths before the cluster listener (no agent
        links before them), the listeners, node ``local``'s engines taken back, then the
        leader's own loops."""
        graph = parts.graph
        self._shared = graph.shared  # built with the graph: a standby says so at once
        self.home.pid_file.write_text(f"{os.getpid()}\n")
        await graph.proxy.startup()
        self._flusher = asyncio.create_task(parts.ledger.run())  # usage, every few seconds
        await graph.data_paths.start()
        await parts.public_server.start(parts.sockets.public)
        await parts.socket_server.start(parts.sockets.unix)
        await parts.cluster_listener.start()
        parts.tls.reloads.start()
        core = graph.local_core
        if core is not None:
            graph.run.runtimes = tuple(await core.runtime_status())
            for runtime in graph.run.runtimes:
                verdict = "available" if runtime.available else "unavailable"
                log.info("runtime %s: %s (%s)", runtime.name, verdict, runtime.detail)
            # Held until this leader stops; its warden stops this host's engines if the
            # leader does not come back.
            self._ownership = await own_engines(self.home, "leader", self.settings, LOCAL_NODE_ID)
            # Engines (in the journal) and containers (by label) left running by the last
            # leader, with their keys, for reconcile.
            await core.restore()
        if self._shared is not None:  # shared leadership: lead now, or once the lease is ours
            # Only a leader-only leader can stand by again without its host's engines.
            demote = self.stop_leading if graph.leader_only else None
            await self._shared.start(
                self.start_leading, demote, on_lost=self.request_standby_restart
            )
        else:
            await self.start_leading()
        if core is not None and core.adopted is not None:
            watcher = core.adopted  # the servers this host adopted: node local reports them
            lifecycle = graph.lifecycle
            watcher.on_change = lambda: lifecycle.adopted_reported(LOCAL_NODE_ID, watcher.states())
            watcher.start()
        if parts.local_sampler is not None:
            parts.local_sampler.start()
        freeze_startup_objects()  # full collections then skip the start-up heap
        parts.loop_lag.start()
        graph.history.start()  # every leader keeps its own last hour
        graph.run.ready = True

    async def start_leading(self) -> None:
        """Start the loops only a store's leader runs: reconcile what the last run left and
        watch the engines (the lifecycle manager, whose supervisor restarts them), and the
        scaling controller; and, once, ``node_timeout_s`` from now, mark unreachable the
        nodes the store says are ``ready`` whose agents have no link to this leader (links
        that ended with the last active, or the last run: only the hub that held a link
        marks its node when it ends). Called by :meth:`start` (a lone leader) or by shared
        leadership once the lease is this leader's, again after each :meth:`stop_leading`.
        Raises ``DaemonError`` when already leading."""
        if self._leading:
            raise DaemonError("the leader already leads")
        graph = self.graph
        await graph.lifecycle.start()
        graph.scaling.start(
            await asyncio.to_thread(graph.store.list_service_profiles),
            await asyncio.to_thread(graph.store.list_deployments, active_only=True),
        )
        graph.drains.start()  # the store's drains resume where they were
        self._detached_sweep = asyncio.create_task(
            graph.hub.mark_detached_unreachable(self.settings.node_timeout_s),
            name="detached-nodes",
        )
        self._leading = True
        # /readyz says ready once the agents' deployments are routed again, or once the
        # sweep above would mark their nodes unreachable (the same bound).
        graph.run.serving = await LinkWait.begin(
            graph.store, graph.lifecycle.routed, wait_s=self.settings.node_timeout_s
        )

    async def stop_leading(self) -> None:
        """Step down after the lease was lost (shared leadership, ``leader_only``): close
        every agent's link with ``NOT_LEADER`` naming the active (the agents dial it at
        once), then stop the leader-only loops (the engine watcher, restarts and starts in
        flight, scaling, the sweep of detached nodes) without stopping any engine: the
        agents' engines run on, for the new active to re-attach.  The listeners stay open
        and answer as a standby's (they read the leadership).  :meth:`start_leading` may be
        called again afterwards.  Raises ``DaemonError`` when not leading."""
        if not self._leading:
            raise DaemonError("the leader does not lead")
        self._leading = False
        graph = self.graph
        graph.run.serving = None
        await self._cancel_detached_sweep()
        # The links first: a start or restart cut short below then reaches no agent.
        gate = graph.hub.agent_gate
        reason = gate.refusal() if gate is not None else None
        await graph.hub.close_for_standby(reason or not_leader_reason(None))
        await graph.drains.stop()
        await graph.scaling.close()
        await graph.lifecycle.stand_down()
        log.info("berth leader standing by: the leader-only loops stopped, no engine stopped")

    async def _cancel_detached_sweep(self) -> None:
        sweep, self._detached_sweep = self._detached_sweep, None
        if sweep is not None:
            sweep.cancel()
            await asyncio.gather(sweep, return_exceptions=True)

    # -- stop -----------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop: a leader that serves first drains (``/readyz`` answers 503 ``draining`` for
        the ``drain_s`` setting's seconds while it goes on serving, with its lease, so a load
        balancer moves new requests elsewhere before anything closes); then not ready (with
        ``leader_ha``, the lease handed over), requests in flight get
        :data:`SHUTDOWN_GRACE_S` to finish, then
        every piece stops in order (node ``local``'s engines too) and the ports, the socket
        and pid files and the owner lock are released. A stopped leader may start again;
        stopping one that does not run does nothing."""
        parts = self._parts
        if parts is None:
            return
        await self._drain(parts)
        parts.graph.run.ready = False
        if self._shared is not None:  # the lease before the close: a standby takes over
            await self._shared.hand_over()
        await asyncio.gather(
            parts.public_server.close(SHUTDOWN_GRACE_S), parts.socket_server.close(SHUTDOWN_GRACE_S)
        )
        await self._release()

    async def _drain(self, parts: LeaderParts) -> None:
        """Answer ``/readyz`` 503 for ``drain_s`` seconds while serving on, when this leader
        serves (it leads and started; a standby serves nothing and closes at once), or until
        :meth:`end_drain` (a second SIGTERM or SIGINT)."""
        run, drain_s = parts.graph.run, self.settings.drain_s
        if drain_s <= 0 or not (run.ready and self._leading) or run.draining:
            return
        if self._shared is not None and not self._shared.leadership.is_active:
            return  # the lease was lost: /v1 is refused here already
        run.draining = True
        log.info(
            "berth leader draining: /readyz answers 503 for %.1f s (drain_s) while requests "
            "are still served; then the listeners close",
            drain_s,
        )
        self._drain_over.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drain_over.wait(), drain_s)

    async def _release(self) -> None:
        """Stop every piece (those never started too), in the order that settles answers
        before the usage ledger's last write, then release the files, ports and lock.

        The release happens even when stopping a piece raises (a store out of reach: a
        ``StoreError``), which is then raised: a leader that cannot stop cleanly still lets
        go of its ports, socket, lease and key-sync thread, so its process exits and its
        supervisor can start it again."""
        parts = self._parts
        assert parts is not None
        try:
            await self._stop_pieces(parts)
        finally:
            await self._let_go(parts)

    async def _stop_pieces(self, parts: LeaderParts) -> None:
        graph = parts.graph
        await self._cancel_detached_sweep()
        await parts.tls.reloads.close()
        await asyncio.gather(parts.public_server.close(0.0), parts.socket_server.close(0.0))
        if parts.local_sampler is not None:
            await parts.local_sampler.stop()
        await graph.history.stop()
        await graph.drains.stop()
        await graph.scaling.close()
        await graph.hub.shutdown()
        await graph.data_paths.close()
        await parts.cluster_listener.stop()
        await graph.lifecycle.shutdown()
        await graph.proxy.shutdown()
        if parts.tracing is not None:  # the spans still held are sent (the exporter's timeout)
            await asyncio.to_thread(parts.tracing.shutdown)
        parts.ledger.stop()  # every answer has been settled: write the rest of the usage
        if self._flusher is not None:
            await self._flusher
        core = graph.local_core
        if core is not None:
            if core.adopted is not None:
                await core.adopted.stop()
            core.close()

    async def _let_go(self, parts: LeaderParts) -> None:
        graph = parts.graph
        parts.loop_lag.stop()
        if self._flusher is not None and not self._flusher.done():  # a piece failed first
            parts.ledger.stop()
            await self._flusher
        if self._shared is not None:  # the lease handed back: a standby takes over at once
            await self._shared.stop()
            self._shared = None
        graph.store.close()
        parts.sockets.close()
        self.home.pid_file.unlink(missing_ok=True)
        if self._ownership is not None:
            self._ownership.release()
        self._parts, self._flusher, self._ownership, self._leading = None, None, None, False
        graph.run.serving, graph.run.draining = None, False
        self.should_exit.clear()  # a stopped leader may serve again
        log.info("berth leader stopped")


async def serve(home: BerthHome, settings: Settings) -> int:
    """``berth daemon start``'s run: :meth:`Leader.serve` of a Leader on ``home``; the
    process's exit status (:attr:`Leader.exit_status`)."""
    leader = Leader(home, settings)
    await leader.serve()
    return leader.exit_status
