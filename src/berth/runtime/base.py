"""The engine runtime interface: how an agent starts, watches and stops one engine.

A runtime knows nothing about models or the store.  It takes a :class:`LaunchSpec` (argv,
environment, port, health path, log file) and returns an :class:`EngineHandle`.  Two runtimes
exist: ``process`` (``runtime/process.py``: the engine is a child process) and ``docker``
(``runtime/docker/``: the engine runs in a container, described by the spec's
:class:`ContainerSpec`); tests may use an in-memory fake.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from berth.runtime.exits import ILLEGAL_INSTRUCTION, signal_name
from berth.vocab.engines import RuntimeName

#: Called with a one-line progress message while an engine is being prepared (an image
#: pull, for instance); it must not block.
ProgressListener = Callable[[str], None]


@dataclass(frozen=True)
class Mount:
    """A host path bind-mounted into a container (read-only unless ``read_only`` is False)."""

    source: Path
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerSpec:
    """How to run an engine in a container: the image and what the runtime adds to it.

    ``command`` is passed to the image's entrypoint (the engine's flags, or a whole command
    line for an image without one); the engine listens on ``container_port`` inside the
    container, published on the host's loopback only.  ``gpus`` are NVML device indexes handed
    to the container through a device request; ``shm_size`` is ``/dev/shm``'s size as Docker
    parses it (``"16g"``); ``ulimits`` are ``(name, soft, hard)``; ``labels`` are added to the
    runtime's own (owner, node).
    """

    image: str
    command: tuple[str, ...]
    container_port: int
    mounts: tuple[Mount, ...] = ()
    gpus: tuple[int, ...] = ()
    shm_size: str | None = None
    ulimits: tuple[tuple[str, int, int], ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SecretFile:
    """A file holding a secret the engine reads at start (SGLang's ``--config`` file with
    its API key): written with mode 0600 before the engine starts, removed once it answers
    (the engine has read it by then) and when it stops.  ``container_path`` is where a
    container sees it (bind-mounted read-only); ``None`` for a process."""

    path: Path
    content: str = field(repr=False)
    container_path: str | None = None


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a runtime needs to start one engine.

    ``argv`` is the full command line (for a container: the command given to its image);
    ``port`` is the TCP port the engine listens on at ``host`` (0 for a container: the
    runtime picks a free one); ``health_path`` answers 200 once the model is loaded;
    ``log_path`` receives the engine's stdout and stderr; ``container`` is set for the docker
    runtime only.

    ``api_key`` is the engine's own API key (``None``: it has none), which every request
    to it carries as ``Authorization: Bearer``; it reaches the engine through
    ``secret_env`` (environment entries added to ``env``) or ``secret_files``, never through
    ``argv``, which other users of the host can read.  None of the three is ever logged or
    shown in a ``repr``.
    """

    deployment_id: str
    argv: tuple[str, ...]
    port: int
    health_path: str
    served_model_name: str
    log_path: Path
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    container: ContainerSpec | None = None
    api_key: str | None = field(default=None, repr=False)
    secret_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    secret_files: tuple[SecretFile, ...] = field(default=(), repr=False)

    def environment(self) -> dict[str, str]:
        """What the engine gets on top of the runtime's environment: ``env`` and
        ``secret_env``."""
        return {**self.env, **self.secret_env}


#: Flags whose value is a secret, hidden wherever berth prints a command line.
SECRET_FLAGS = ("--api-key", "--admin-api-key")
#: What a hidden value is replaced with.
REDACTED = "<redacted>"


def printable_command(argv: Sequence[str]) -> str:
    """``argv`` joined with spaces for a log, with the values of :data:`SECRET_FLAGS`
    (``--api-key KEY`` or ``--api-key=KEY``, e.g. given with ``--extra-arg``) hidden."""
    shown: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            shown.append(REDACTED)
            hide_next = False
            continue
        flag, equals, _ = arg.partition("=")
        if flag in SECRET_FLAGS:
            if equals:
                shown.append(f"{flag}={REDACTED}")
            else:
                shown.append(arg)
                hide_next = True
            continue
        shown.append(arg)
    return " ".join(shown)


@dataclass(frozen=True)
class EngineHandle:
    """A started engine: enough to find, probe and stop it again, even after a restart.

    ``pid`` is the engine's process on this host (for a container: its main process as the
    host sees it); ``port`` the host port it answers on; ``container_id`` is set by the
    docker runtime only.  ``cgroup`` is the engine's own cgroup (``/berth/<deployment>``, as
    ``/proc/<pid>/cgroup`` names it) when the process runtime gave it one: stopping the
    engine stops everything in it.  ``api_key`` is the engine's API key (``None``: none),
    sent with every probe and request; it never appears in a ``repr``.
    """

    deployment_id: str
    pid: int
    port: int
    host: str = "127.0.0.1"
    runtime: RuntimeName = "process"
    container_id: str | None = None
    cgroup: str | None = None
    api_key: str | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the engine's OpenAI-compatible server."""
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class EngineExit:
    """How an engine ended: its exit ``code``, or the ``signal`` that killed it (``SIGKILL``;
    then ``code`` is ``None``).  A container killed by a signal reports ``128 + N`` as its
    code (Docker's convention)."""

    code: int | None = None
    signal: str | None = None

    @classmethod
    def from_returncode(cls, returncode: int) -> EngineExit:
        """From :attr:`subprocess.Popen.returncode` (``-N``: killed by signal ``N``)."""
        if returncode >= 0:
            return cls(code=returncode)
        return cls(signal=signal_name(-returncode))

    def describe(self) -> str:
        """``exit code 1``, ``killed by SIGKILL``, ``killed by SIGILL (built for instructions
        this CPU does not run)`` (:mod:`berth.runtime.exits`' words)."""
        if self.signal == signal_name(signal.SIGILL):
            return f"killed by {self.signal} ({ILLEGAL_INSTRUCTION})"
        if self.signal is not None:
            return f"killed by {self.signal}"
        return f"exit code {self.code}" if self.code is not None else "exited"


class Runtime(Protocol):
    """Starts, probes and stops engines of one kind (child processes, containers)."""

    name: str

    async def start(
        self, spec: LaunchSpec, on_progress: ProgressListener | None = None
    ) -> EngineHandle:
        """Start the engine and return at once (before it is healthy).

        ``on_progress`` gets one-line messages while the engine is prepared (an image pull).
        Raises :class:`berth.errors.EngineError` when it cannot be started at all.
        """
        ...

    async def wait_healthy(self, handle: EngineHandle, spec: LaunchSpec, timeout_s: float) -> None:
        """Poll ``spec.health_path`` until it answers 200.

        Raises :class:`berth.errors.EngineError` carrying the log tail when the engine exits
        or ``timeout_s`` seconds pass first.
        """
        ...

    async def stop(self, handle: EngineHandle, grace_s: float) -> None:
        """SIGTERM (or the runtime's equivalent), then SIGKILL after ``grace_s`` seconds."""
        ...

    async def check_health(self, handle: EngineHandle, health_path: str, timeout_s: float) -> bool:
        """One health probe: whether ``GET health_path`` answers 200 within ``timeout_s``."""
        ...

    def is_alive(self, handle: EngineHandle) -> bool:
        """Whether the engine's process (or container) still runs, as last seen.

        Never blocks: a runtime that must ask a daemon answers from what it saw last
        (:meth:`poll` refreshes that).
        """
        ...

    async def poll(self, handle: EngineHandle) -> bool:
        """Whether the engine runs, asked now (and remembered for :meth:`is_alive`)."""
        ...

    def exit_status(self, handle: EngineHandle) -> EngineExit | None:
        """How the engine ended, as last seen (:meth:`poll` looks again); ``None`` while it
        runs, or when this runtime cannot tell (an engine it re-attached to)."""
        ...

    def watch_exit(
        self, handle: EngineHandle, on_exit: Callable[[EngineExit | None], None]
    ) -> None:
        """Call ``on_exit`` on the event loop as soon as the engine ends, with how it ended
        when the runtime can tell (the process runtime: a pidfd; the docker runtime: the
        engine's events stream).  Called on the event loop."""
        ...

    def unwatch_exit(self, handle: EngineHandle) -> None:
        """Stop watching the engine's end (it is being stopped on purpose)."""
        ...
