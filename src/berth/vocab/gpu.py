"""One GPU as a node reports it (:class:`GpuInfo`), and the sizes of simulated GPUs (the
``simulated_gpus`` setting, :func:`parse_simulated_gpus`).

Memory is in MiB (2**20 bytes), the unit ``nvidia-smi`` prints as "MiB". Reading real GPUs
(NVML) is :mod:`berth.runtime.gpu`'s job; a simulated GPU is told apart by its UUID, which
starts with :data:`SIMULATED_UUID_PREFIX`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The UUID of a simulated GPU is this prefix and its index.
SIMULATED_UUID_PREFIX = "GPU-berth-simulated-"
#: The name simulated GPUs report.
SIMULATED_NAME = "simulated GPU"
#: At most this many simulated GPUs per node, each at most 16 TiB.
MAX_SIMULATED_GPUS = 64
MAX_SIMULATED_MB = 16 << 20
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GiB|G|MiB|M|TiB|T)\s*$", re.IGNORECASE)
_UNIT_MB = {"m": 1, "mib": 1, "g": 1024, "gib": 1024, "t": 1 << 20, "tib": 1 << 20}


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it.

    ``index`` is NVML's device number (the one ``CUDA_VISIBLE_DEVICES`` takes when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); ``utilization_pct`` is the percentage of the last sample
    period a kernel ran (``nvmlDeviceGetUtilizationRates().gpu``), ``None`` where the device
    does not report it (e.g. MIG-enabled GPUs).
    """

    index: int
    name: str
    uuid: str
    memory_total_mb: int
    memory_used_mb: int
    utilization_pct: int | None

    @property
    def memory_free_mb(self) -> int:
        """Memory not in use, in MiB."""
        return max(0, self.memory_total_mb - self.memory_used_mb)

    @property
    def simulated(self) -> bool:
        """Whether the node simulates this GPU (``simulated_gpus``)."""
        return self.uuid.startswith(SIMULATED_UUID_PREFIX)


def parse_simulated_gpus(text: str) -> tuple[int, ...]:
    """``"24GiB,24GiB"`` → ``(24576, 24576)``: simulated GPU sizes in MiB.

    Each size is a number with a unit: ``MiB``/``M``, ``GiB``/``G`` or ``TiB``/``T``
    (binary units, as ``nvidia-smi`` counts; any case; ``1.5GiB`` allowed).  An empty or
    blank text is no GPUs.  Raises ``ValueError`` naming the part at fault for anything
    else, a size of 0 or above 16 TiB, or more than 64 GPUs.
    """
    if not text.strip():
        return ()
    sizes = []
    for part in text.split(","):
        found = _SIZE.match(part)
        if found is None:
            raise ValueError(
                f"{part.strip()!r} is not a GPU size such as 24GiB or 81920MiB "
                "(comma-separated, one per GPU)"
            )
        size_mb = int(float(found.group(1)) * _UNIT_MB[found.group(2).lower()])
        if not 0 < size_mb <= MAX_SIMULATED_MB:
            raise ValueError(f"{part.strip()!r}: a GPU has more than 0 and at most 16 TiB")
        sizes.append(size_mb)
    if len(sizes) > MAX_SIMULATED_GPUS:
        raise ValueError(f"at most {MAX_SIMULATED_GPUS} simulated GPUs, not {len(sizes)}")
    return tuple(sizes)
