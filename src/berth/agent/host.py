"""This host as its agent core reports it, besides its GPUs and engines.

:func:`read_host_facts` gives its hostname, CPU count and memory (the Hello's and the
``inventory`` op's :class:`~berth.cluster.protocol.frames.Inventory`); :func:`runtime_status`
says whether each runtime can start engines here, with a line saying why (not): the runtime
capabilities an agent advertises, and the leader's log for node ``local``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from berth.runtime.engines import EngineBinaries
from berth.runtime.process import ProcessRuntime
from berth.vocab.engines import RuntimeName

if TYPE_CHECKING:
    from berth.runtime.docker import DockerRuntime


@dataclass(frozen=True)
class HostFacts:
    hostname: str
    cpu_count: int
    memory_total_mb: int


def read_host_facts() -> HostFacts:
    """Hostname, CPU count and total memory (from ``os.sysconf``) of this host."""
    try:
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError):
        memory_mb = 0
    return HostFacts(socket.gethostname(), os.cpu_count() or 1, memory_mb)


@dataclass(frozen=True)
class RuntimeStatus:
    """Whether a runtime can start engines on this host, and a line saying why (not)."""

    name: RuntimeName
    available: bool
    detail: str


async def runtime_status(
    runtime: ProcessRuntime, binaries: EngineBinaries, docker: DockerRuntime | None
) -> list[RuntimeStatus]:
    """The process runtime (with the engines found in ``binaries`` and how process trees
    are kept) and the docker one (``docker`` ``None``: not set up here; else Docker is
    asked)."""
    found = [
        f"llama-server {'found' if binaries.llama_server else 'not found'}",
        f"vllm {'found' if binaries.vllm else 'not found'}",
        f"process trees: {runtime.trees.describe()}",
    ]
    statuses = [RuntimeStatus("process", True, "; ".join(found))]
    if docker is None:
        statuses.append(RuntimeStatus("docker", False, "not set up on this node"))
    else:
        status = await docker.status()
        statuses.append(RuntimeStatus("docker", status.available, status.detail))
    return statuses
