"""The engine runtime interface: how an agent starts, watches and stops one engine.

A runtime knows nothing about models or the store.  It takes a :class:`LaunchSpec` (argv,
environment, port, health path, log file) and returns an :class:`EngineHandle`.  The process
runtime (``runtime/process.py``) is the real one; tests may use an in-memory fake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a runtime needs to start one engine.

    ``argv`` is the full command line; ``port`` is the TCP port the engine listens on at
    ``host``; ``health_path`` answers 200 once the model is loaded; ``log_path`` receives the
    engine's stdout and stderr.
    """

    deployment_id: str
    argv: tuple[str, ...]
    port: int
    health_path: str
    served_model_name: str
    log_path: Path
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineHandle:
    """A started engine: enough to find, probe and stop it again, even after a restart."""

    deployment_id: str
    pid: int
    port: int
    host: str = "127.0.0.1"

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the engine's OpenAI-compatible server."""
        return f"http://{self.host}:{self.port}"


class Runtime(Protocol):
    """Starts, probes and stops engines of one kind (child processes, containers)."""

    name: str

    async def start(self, spec: LaunchSpec) -> EngineHandle:
        """Start the engine and return at once (before it is healthy).

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

    def is_alive(self, handle: EngineHandle) -> bool:
        """Whether the engine's process (or container) still runs."""
        ...
