"""The agent core: runs one host's engines.

The same core runs in-process on the leader's host (node ``local``) and inside every remote
agent.  It owns the engines' handles, chooses ports and log files on its own host, and never
talks to the store: the leader tells it what to run through an ``AgentLink``.

It hears a running engine's end the moment its runtime does (a pidfd, Docker's events) and
tells its listeners (:meth:`AgentCore.on_engine_end`): the leader's lifecycle for node
``local``, the agent's link, which reports it to the leader at once.  An engine stopped on
purpose is not reported.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from berth.agent.engine_launch import (
    launch_spec,
    new_engine_key,
    remove_key_files,
    remove_secret_files,
    write_secret_files,
)
from berth.agent.host import HostFacts, RuntimeStatus, read_host_facts, runtime_status
from berth.agent.journal import EngineJournal, JournalEntry
from berth.agent.policy import enforce_mounts, enforce_path, enforce_start
from berth.cluster.leader.agent_link import (
    DEFAULT_PROBE_TIMEOUT_S,
    EngineReport,
    ProbeResult,
    SpawnListener,
)
from berth.cluster.protocol.spec_signing import SpecKeys, check_signed
from berth.engine_http.auth import bearer_header
from berth.errors import EngineError, NotFoundError
from berth.runtime.base import EngineExit, EngineHandle, ProgressListener, Runtime
from berth.runtime.engine_container import DEFAULT_SHM_SIZE
from berth.runtime.engine_log import follow_log, read_log_tail
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import GpuInventory
from berth.runtime.lora_api import load_adapter, unload_adapter
from berth.runtime.process import ProcessRuntime
from berth.vocab.agent_policy import AgentPolicy
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import EngineName, RuntimeName
from berth.vocab.gpu import GpuInfo

if TYPE_CHECKING:
    from berth.agent.adopted import AdoptedWatcher
    from berth.runtime.docker import DockerRuntime

log = logging.getLogger(__name__)


#: Engines without a recorded health path (re-attached after a restart) are probed here;
#: llama.cpp, vLLM and SGLang all serve it.
DEFAULT_HEALTH_PATH = "/health"
#: Seconds between SIGTERM and SIGKILL for what is left of an engine that died before a
#: restart (its helpers, its cgroup).
LEFTOVER_GRACE_S = 5.0

#: Told, on the event loop, that a running engine ended by itself: its deployment id and
#: how it ended (``None``: its runtime cannot tell).  It must not block.
EngineEndListener = Callable[[str, EngineExit | None], None]


@dataclass
class _Managed:
    handle: EngineHandle
    log_path: Path
    health_path: str = DEFAULT_HEALTH_PATH

    def __post_init__(self) -> None:
        key = self.handle.api_key
        #: the header every request to the engine carries
        self.auth = bearer_header(key) if key is not None else None


class AgentCore:
    """Starts, watches and stops the engines of one host.

    ``logs_dir`` receives one ``engine-<deployment id>.log`` per engine.  A request whose
    ``port`` is 0 gets a free port on this host.  Engines run as processes (``runtime``) or,
    when ``docker`` is given, also as containers; ``docker_shm_size`` sizes their
    ``/dev/shm``.  ``adopted`` watches the servers this host adopted (never started or
    stopped here; the tunnel reaches them like engines).

    Every engine started here gets an API key of its own
    (:func:`~berth.agent.engine_launch.new_engine_key`), made here, on the host that runs it:
    it never crosses the link.  The core keeps it with the engine's handle and in the journal
    (mode 0600), and hands it to whoever sends this host's engines requests
    (:meth:`engine_auth`: the agent's relay, the leader's client for node ``local``).  An
    engine that reads its key from a file gets one in ``keys_dir`` (mode 0600), removed once
    the engine answers.

    ``policy`` is the host's agent policy (:mod:`berth.agent.policy`): a start it refuses
    raises :class:`~berth.errors.PolicyError` naming the rule, before anything is prepared.

    ``spec_keys`` returns the keys this host trusts for signed specs (read at each start: a
    renewal may bring new ones); every start is then refused unless its spec is signed by
    one of them and matches (:func:`~berth.cluster.protocol.spec_signing.check_signed`,
    ``SpecRefusedError``).  ``None`` checks nothing: only tests build a core without keys.
    """

    def __init__(
        self,
        runtime: ProcessRuntime,
        binaries: EngineBinaries,
        gpu_inventory: GpuInventory,
        *,
        logs_dir: Path,
        journal_path: Path | None = None,
        docker: DockerRuntime | None = None,
        docker_shm_size: str = DEFAULT_SHM_SIZE,
        adopted: AdoptedWatcher | None = None,
        keys_dir: Path | None = None,
        policy: AgentPolicy | None = None,
        spec_keys: Callable[[], SpecKeys] | None = None,
    ) -> None:
        self.adopted = adopted
        #: what this host lets berth start (``None``: anything, for cores built by hand)
        self.policy = policy
        self._spec_keys = spec_keys
        self._keys_dir = keys_dir if keys_dir is not None else logs_dir.parent / "engine-keys"
        self._journal = EngineJournal(journal_path) if journal_path is not None else None
        #: one journal write at a time, in the order they were asked for
        self._journal_lock = asyncio.Lock()
        self._runtime = runtime
        self._docker = docker
        self._docker_shm_size = docker_shm_size
        self._binaries = binaries
        self._gpu_inventory = gpu_inventory
        self._logs_dir = logs_dir
        self._engines: dict[str, _Managed] = {}
        #: starts in progress (pulling, creating, loading), so a stop can cancel them
        self._starting: dict[str, asyncio.Task[Any]] = {}
        #: journal entries not taken back yet because Docker did not answer
        self._unresolved: dict[str, JournalEntry] = {}
        self._end_listeners: list[EngineEndListener] = []

    def on_engine_end(self, listener: EngineEndListener) -> None:
        """From now on, ``listener`` hears of every running engine that ends by itself."""
        self._end_listeners.append(listener)

    def _watch(self, deployment_id: str, managed: _Managed) -> None:
        """Watch the engine's end (it runs and answers now)."""
        runtime = self._runtime_for(managed.handle.runtime)

        def ended(exited: EngineExit | None) -> None:
            if self._engines.get(deployment_id) is not managed:
                return  # stopped or replaced meanwhile
            how = exited.describe() if exited is not None else "exited"
            log.warning("the engine of deployment %s ended by itself (%s)", deployment_id, how)
            for listener in self._end_listeners:
                listener(deployment_id, exited)

        runtime.watch_exit(managed.handle, ended)

    def close(self) -> None:
        """Release the runtimes' threads and connections; engines keep running."""
        self._runtime.close()
        if self._docker is not None:
            self._docker.close()

    def _runtime_for(self, name: RuntimeName) -> Runtime:
        if name == "docker":
            if self._docker is None:
                raise EngineError("the docker runtime is not set up on this node")
            return self._docker
        return self._runtime

    async def runtime_status(self) -> list[RuntimeStatus]:
        """Each runtime and whether it can start engines here (the docker one asks Docker)."""
        return await runtime_status(self._runtime, self._binaries, self._docker)

    async def start(
        self,
        request: DeploymentRequest,
        health_timeout_s: float,
        on_spawned: SpawnListener | None = None,
        on_progress: ProgressListener | None = None,
    ) -> EngineHandle:
        """Start the engine and wait until it answers health.

        ``on_spawned(pid, port)`` is awaited as soon as the process (or container) exists,
        before it is healthy, so the leader can record it (and stop it after a crash
        mid-load); ``on_progress(line)`` gets progress while the engine is prepared (an image
        pull).  Raises ``EngineError`` (with the engine's log tail) when it fails to start or
        to become healthy within ``health_timeout_s`` seconds (an image pull does not count
        against it); the engine is stopped then.  A cancelled start stops the engine too.
        """
        if request.deployment_id in self._engines or request.deployment_id in self._starting:
            raise EngineError(
                f"deployment {request.deployment_id} already runs on this node",
                deployment_id=request.deployment_id,
            )
        task = asyncio.current_task()
        assert task is not None
        self._starting[request.deployment_id] = task
        try:
            return await self._start(request, health_timeout_s, on_spawned, on_progress)
        finally:
            self._starting.pop(request.deployment_id, None)

    async def _start(
        self,
        request: DeploymentRequest,
        health_timeout_s: float,
        on_spawned: SpawnListener | None,
        on_progress: ProgressListener | None,
    ) -> EngineHandle:
        if self._spec_keys is not None:  # nothing runs here that the cluster did not sign
            check_signed(request, await asyncio.to_thread(self._spec_keys))
        log_path = self.log_path(request.deployment_id)
        runtime = self._runtime_for(request.runtime)
        request = replace(request, log_path=log_path, api_key=new_engine_key())
        await asyncio.to_thread(enforce_start, request, self.policy)
        spec = launch_spec(
            request, self._binaries, docker_shm_size=self._docker_shm_size, keys_dir=self._keys_dir
        )
        enforce_mounts(spec, self.policy, own=(self._keys_dir,))
        await write_secret_files(spec.secret_files, request.deployment_id)
        try:
            handle = await runtime.start(spec, on_progress)
        except BaseException:
            await asyncio.to_thread(remove_secret_files, spec.secret_files)
            raise
        managed = self._engines[request.deployment_id] = _Managed(
            handle, log_path, spec.health_path
        )
        try:
            await self._save_journal()
            if on_spawned is not None:
                await on_spawned(handle.pid, handle.port)
            await runtime.wait_healthy(handle, spec, health_timeout_s)
            await asyncio.to_thread(remove_secret_files, spec.secret_files)  # read by now
            self._watch(request.deployment_id, managed)
        except BaseException:
            # Failed or cancelled: never leave a half-started engine behind.  A failing
            # cleanup is logged; the error that stopped the start is the one reported.
            try:
                await asyncio.shield(self._discard(request.deployment_id, grace_s=5.0))
            except (EngineError, asyncio.CancelledError) as exc:
                log.warning("stopping the engine of %s after a failed start: %s",
                            request.deployment_id, exc)  # fmt: skip
            await asyncio.to_thread(remove_secret_files, spec.secret_files)
            raise
        return handle

    async def stop(self, deployment_id: str, grace_s: float) -> None:
        """Stop the engine; a deployment this core does not run is a ``NotFoundError``.

        A start still in progress (an image pull, a container being created, a model
        loading) is cancelled, and this returns once its cleanup has removed the engine.
        """
        starting = self._starting.get(deployment_id)
        if starting is not None and starting is not asyncio.current_task():
            starting.cancel()
            await asyncio.wait({starting})
            return
        if deployment_id not in self._engines:
            raise NotFoundError("engine", deployment_id)
        # Shielded: once forgotten here, a stop cut short would leave an untracked engine.
        await asyncio.shield(self._discard(deployment_id, grace_s))

    async def stop_all(self, grace_s: float) -> None:
        """Stop every engine at once (in parallel), e.g. when the daemon shuts down."""
        await asyncio.gather(*(self._discard(d, grace_s) for d in list(self._engines)))

    async def reattach(
        self, deployment_id: str, pid: int, port: int, runtime: RuntimeName = "process"
    ) -> EngineHandle | None:
        """Take back an engine that outlived its leader; ``None`` when it is gone.

        A process is recognised by ``pid`` and ``port``; a container by its labels.
        """
        managed = self._engines.get(deployment_id)
        if managed is not None:  # already taken back by restore()
            return managed.handle
        handle = await self._attach(deployment_id, JournalEntry(pid, port, "", runtime))
        if handle is None:
            return None
        log_path = self.log_path(deployment_id)
        managed = self._engines[deployment_id] = _Managed(handle, log_path)
        self._watch(deployment_id, managed)
        await self._save_journal()
        return handle

    async def _attach(self, deployment_id: str, entry: JournalEntry) -> EngineHandle | None:
        """Take back the engine ``entry`` describes; ``None`` when it is gone (what is left
        of a process engine then, its helpers or its cgroup, is stopped)."""
        if entry.runtime == "docker":
            if self._docker is None:
                return None
            log_path = self.log_path(deployment_id)
            return await self._docker.attach(deployment_id, log_path, entry.api_key)
        handle = self._runtime.attach(
            deployment_id, entry.pid, entry.port, cgroup=entry.cgroup, api_key=entry.api_key
        )
        if handle is None and entry.pid > 0:
            gone = EngineHandle(deployment_id, entry.pid, entry.port, cgroup=entry.cgroup)
            try:
                await self._runtime.stop(gone, LEFTOVER_GRACE_S)
            except EngineError as exc:
                log.warning("stopping what is left of engine %s: %s", deployment_id, exc)
        return handle

    async def restore(self) -> list[str]:
        """Take back the engines of a previous run of this host's agent or leader.

        Engines listed in the journal are re-attached (processes by pid, containers by
        label); then every running container labelled as this home's and node's is taken
        too, journal or not, so the leader can reconcile it (and stop it when no deployment
        owns it).  Returns the deployment ids taken back; engines that are gone are dropped
        from the journal.  Raises :class:`~berth.errors.ConfigError` naming the journal when
        it is malformed or unreadable; an unreachable Docker engine is logged, not raised.
        """
        saved: dict[str, JournalEntry] = {}
        if self._journal is not None:
            saved = await asyncio.to_thread(self._journal.load)
        if self._docker is not None:
            try:
                for deployment_id in await self._docker.owned():
                    saved.setdefault(
                        deployment_id, JournalEntry(0, 0, DEFAULT_HEALTH_PATH, "docker")
                    )
            except EngineError as exc:
                log.warning("cannot look for containers left running: %s", exc)
        self._unresolved.update(saved)
        return await self.retry_unresolved()

    async def retry_unresolved(self) -> list[str]:
        """Take back the engines :meth:`restore` could not reach yet (Docker was down).

        Returns the deployment ids taken back now; entries whose engine is gone are dropped,
        those whose runtime still does not answer are kept (in the journal too) for the next
        try.
        """
        restored = []
        for deployment_id, entry in list(self._unresolved.items()):
            try:
                handle = await self._attach(deployment_id, entry)
            except EngineError as exc:
                log.warning("cannot take back engine %s yet: %s", deployment_id, exc)
                continue
            del self._unresolved[deployment_id]
            if handle is not None and deployment_id not in self._engines:
                log_path = self.log_path(deployment_id)
                managed = _Managed(handle, log_path, entry.health_path)
                self._engines[deployment_id] = managed
                self._watch(deployment_id, managed)
                restored.append(deployment_id)
        await self._save_journal()
        return restored

    async def _save_journal(self) -> None:
        """Write the journal (the engines run now, and those not taken back yet) off the
        event loop.  Writes happen one at a time in the order asked for, each with the state
        of when it runs, so the last one on disk is the latest; a caller cancelled meanwhile
        does not cut its write short."""
        if self._journal is not None:
            await asyncio.shield(self._write_journal(self._journal))

    async def _write_journal(self, journal: EngineJournal) -> None:
        async with self._journal_lock:
            entries = {
                d: JournalEntry(
                    m.handle.pid,
                    m.handle.port,
                    m.health_path,
                    m.handle.runtime,
                    api_key=m.handle.api_key,
                    cgroup=m.handle.cgroup,
                )
                for d, m in self._engines.items()
            }
            for deployment_id, entry in self._unresolved.items():
                entries.setdefault(deployment_id, entry)
            await asyncio.to_thread(journal.save, entries)

    def engine_port(self, deployment_id: str) -> int:
        """The port the deployment's engine listens on; ``NotFoundError`` if none runs."""
        return self.engine_origin(deployment_id)[1]

    def engine_origin(self, deployment_id: str) -> tuple[str, int]:
        """``(host, port)`` where the deployment's engine, or the adopted endpoint whose id
        (``adopted:<name>``) is given, answers on this host; ``NotFoundError`` if none."""
        managed = self._engines.get(deployment_id)
        if managed is not None:
            return managed.handle.host, managed.handle.port
        if self.adopted is not None:
            origin = self.adopted.origin(deployment_id)
            if origin is not None:
                return origin
        raise NotFoundError("engine", deployment_id)

    def engine_auth(self, deployment_id: str) -> tuple[bytes, bytes] | None:
        """The ``authorization`` header requests to the deployment's engine (or the adopted
        endpoint ``adopted:<name>``) must carry on this host; ``None`` when it needs none
        (or there is no such engine: reaching it fails on its own)."""
        managed = self._engines.get(deployment_id)
        if managed is not None:
            return managed.auth
        if self.adopted is not None:
            return self.adopted.auth(deployment_id)
        return None

    def engine_processes(self, deployment_id: str) -> list[int]:
        """The pids of the deployment's engine and every process it started (its cgroup's,
        or those recorded from ``/proc``); none for a container (Docker keeps its tree) or
        an engine this core does not run."""
        managed = self._engines.get(deployment_id)
        if managed is None or managed.handle.runtime != "process":
            return []
        return self._runtime.processes(managed.handle)

    def is_alive(self, deployment_id: str) -> bool:
        managed = self._engines.get(deployment_id)
        if managed is None:
            return False
        return self._runtime_for(managed.handle.runtime).is_alive(managed.handle)

    def exit_status(self, deployment_id: str) -> EngineExit | None:
        """How the deployment's engine ended, once a probe found it gone; ``None`` while it
        runs, when this core runs no such engine, or when its runtime cannot tell."""
        managed = self._engines.get(deployment_id)
        if managed is None:
            return None
        return self._runtime_for(managed.handle.runtime).exit_status(managed.handle)

    async def probe(
        self, deployment_id: str, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    ) -> ProbeResult:
        """Whether the engine runs and answers its health path with 200 within ``timeout_s``
        seconds in all (connecting included: a stopped process's socket still accepts).

        Raises ``EngineError`` when its runtime cannot tell (Docker unreachable).
        """
        managed = self._engines.get(deployment_id)
        if managed is None:
            return "gone"
        runtime = self._runtime_for(managed.handle.runtime)
        if not await runtime.poll(managed.handle):
            return "gone"
        try:
            async with asyncio.timeout(timeout_s):
                healthy = await runtime.check_health(managed.handle, managed.health_path, timeout_s)
        except TimeoutError:
            healthy = False
        return "healthy" if healthy else "unhealthy"

    async def load_adapter(
        self, deployment_id: str, engine: EngineName, adapter: str, path: str
    ) -> None:
        """Have the deployment's engine load the LoRA adapter at ``path`` (on this host) as
        ``adapter``, through the engine's API (:mod:`berth.runtime.lora_api`).

        Raises ``PolicyError`` when ``path`` lies outside the policy's model roots,
        ``NotFoundError`` when no such engine runs here or ``path`` does not exist,
        ``ConfigError`` for an engine that takes adapters only at start (llama.cpp), and
        ``EngineError`` when the engine refuses.
        """
        managed = self._engines.get(deployment_id)
        if managed is None:
            raise NotFoundError("engine", deployment_id)
        await asyncio.to_thread(enforce_path, "adapter path", path, self.policy)
        if not await asyncio.to_thread(Path(path).exists):
            raise NotFoundError("adapter path", path)
        handle = managed.handle
        await load_adapter(engine, handle.base_url, adapter, path, api_key=handle.api_key)

    async def unload_adapter(self, deployment_id: str, engine: EngineName, adapter: str) -> None:
        """Have the deployment's engine unload ``adapter``; raises as :meth:`load_adapter`."""
        managed = self._engines.get(deployment_id)
        if managed is None:
            raise NotFoundError("engine", deployment_id)
        handle = managed.handle
        await unload_adapter(engine, handle.base_url, adapter, api_key=handle.api_key)

    def engines(self) -> list[EngineReport]:
        """Every engine this core manages, with its liveness as last seen."""
        return [
            EngineReport(d, m.handle.pid, m.handle.port, self.is_alive(d))
            for d, m in self._engines.items()
        ]

    def gpus(self) -> list[GpuInfo]:
        return self._gpu_inventory.read()

    def host_facts(self) -> HostFacts:
        return read_host_facts()

    def log_path(self, deployment_id: str) -> Path:
        return self._logs_dir / f"engine-{deployment_id}.log"

    async def logs(
        self, deployment_id: str, *, tail_lines: int, follow: bool
    ) -> AsyncIterator[bytes]:
        """Yield the engine log's last ``tail_lines`` lines, then new output if ``follow``.

        The log outlives the engine, so a stopped or failed deployment's log can be read.
        """
        path = self.log_path(deployment_id)
        if not path.exists():
            raise NotFoundError("engine log", deployment_id)
        if not follow:
            yield (await asyncio.to_thread(read_log_tail, path, tail_lines)).encode()
            return
        async for chunk in follow_log(path, from_start_lines=tail_lines):
            yield chunk

    async def _discard(self, deployment_id: str, grace_s: float) -> None:
        managed = self._engines.pop(deployment_id, None)
        if managed is None:
            return
        runtime = self._runtime_for(managed.handle.runtime)
        runtime.unwatch_exit(managed.handle)  # an end asked for is not news
        try:
            await self._save_journal()
            await runtime.stop(managed.handle, grace_s)
            await asyncio.to_thread(remove_key_files, self._keys_dir, deployment_id)
        except EngineError:
            # Still running as far as anyone knows: keep it, so it can be stopped later
            # (a reconnect or restart reports it, and an unowned engine is stopped then).
            self._engines.setdefault(deployment_id, managed)
            await self._save_journal()
            raise
