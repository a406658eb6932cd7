"""GPU inventory through NVML (``pynvml`` from the ``nvidia-ml-py`` package).

A node without an NVIDIA driver simply has no GPUs: :func:`read_gpus` returns ``[]`` rather
than failing, so berth runs the same on a laptop (llama.cpp on CPU) as on a GPU host.

A testing aid: :class:`SimulatedInventory` reports GPUs that do not exist (the node setting
``simulated_gpus``, e.g. ``24GiB,24GiB``, parsed by :func:`parse_simulated_gpus`), so
placement by free VRAM can be tried and tested on machines without GPUs.  Engines still run
on the CPU.  A simulated GPU reports nothing used; the leader counts its own deployments'
estimates against the total (``placement/fit.py``).  Its UUID starts with
:data:`SIMULATED_UUID_PREFIX`, which is how the leader tells it apart.

Memory is in MiB (2**20 bytes), the unit ``nvidia-smi`` prints as "MiB".  Every call here
talks to the driver synchronously (a few milliseconds per device); async callers run it
through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Protocol

import pynvml

from berth.vocab.gpu import SIMULATED_NAME, SIMULATED_UUID_PREFIX, GpuInfo, parse_simulated_gpus

_log = logging.getLogger(__name__)

_MIB = 1 << 20


class GpuInventory(Protocol):
    """Where the agent learns which GPUs its node has and how busy they are."""

    def read(self) -> list[GpuInfo]:
        """The node's GPUs in index order; ``[]`` when it has none (or no driver)."""
        ...


class NvmlInventory:
    """The real inventory: asks the NVIDIA driver on every :meth:`read`."""

    def read(self) -> list[GpuInfo]:
        """See :func:`read_gpus`."""
        return read_gpus()


class StaticInventory:
    """A fixed list of GPUs, for tests and for nodes configured by hand."""

    def __init__(self, gpus: Iterable[GpuInfo] = ()) -> None:
        self._gpus = tuple(gpus)

    def read(self) -> list[GpuInfo]:
        """The GPUs given at construction."""
        return list(self._gpus)


class SimulatedInventory:
    """GPUs that do not exist, of the given sizes in MiB (``simulated_gpus``): a testing
    aid.  Each reports its total, nothing used and no utilisation."""

    def __init__(self, totals_mb: Iterable[int]) -> None:
        self._gpus = tuple(
            GpuInfo(
                index=index,
                name=SIMULATED_NAME,
                uuid=f"{SIMULATED_UUID_PREFIX}{index}",
                memory_total_mb=total,
                memory_used_mb=0,
                utilization_pct=None,
            )
            for index, total in enumerate(totals_mb)
        )

    def read(self) -> list[GpuInfo]:
        """The simulated GPUs, in index order."""
        return list(self._gpus)


def inventory_for(simulated_gpus: str | None) -> GpuInventory:
    """The node's inventory: :class:`SimulatedInventory` when ``simulated_gpus`` names
    sizes, else NVML.  Raises ``ValueError`` for a malformed value (the setting's check
    refuses it before this)."""
    sizes = parse_simulated_gpus(simulated_gpus or "")
    return SimulatedInventory(sizes) if sizes else NvmlInventory()


def read_gpus() -> list[GpuInfo]:
    """Every GPU NVML can see, in index order.

    Returns ``[]`` when the NVML library or the driver is missing or fails to initialise.
    A device that fails to answer (fallen off the bus, reset in progress) is left out and
    logged, so one broken GPU does not hide the healthy ones.
    """
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        _log.debug("NVML unavailable, reporting no GPUs: %s", exc)
        return []
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        gpus: list[GpuInfo] = []
        for index in range(count):
            try:
                gpus.append(_read_device(index))
            except pynvml.NVMLError as exc:
                _log.warning("GPU %d does not answer NVML queries, left out: %s", index, exc)
        return gpus
    except pynvml.NVMLError as exc:
        _log.warning("NVML failed to list GPUs, reporting none: %s", exc)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            _log.debug("nvmlShutdown failed: %s", exc)


def _read_device(index: int) -> GpuInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization: int | None = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError_NotSupported:
        utilization = None
    return GpuInfo(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        memory_total_mb=int(memory.total) // _MIB,
        memory_used_mb=int(memory.used) // _MIB,
        utilization_pct=utilization,
    )


def _text(value: object) -> str:
    # Old nvidia-ml-py releases return bytes, newer ones str.
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def nvml_status() -> tuple[list[GpuInfo], str]:
    """The GPUs NVML sees and a line saying why there are none (``""`` when there are)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML cannot start (no NVIDIA driver?): {exc}"
    with contextlib.suppress(pynvml.NVMLError):
        pynvml.nvmlShutdown()
    gpus = read_gpus()
    return gpus, "" if gpus else "NVML works but lists no GPU"
