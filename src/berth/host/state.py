"""One host's shared state, made by the supervisor and attached to by each serving process.

::

    state = HostState.create(path, workers=4)       # the parent, before the workers start
    mine = HostState.attach(path, worker=i)          # worker i (0 <= i < workers)
    Admission(..., counters=mine.keys); SlotGate(..., slots=mine.deployments)
    SignalBoard(in_flight=mine.deployments); Router(prefixes=mine.prefixes(...), ...)
    state.reclaim(i)                                 # worker i died: before it starts again

The file's size is fixed at creation: ``key_rows`` keys, ``deployment_rows`` deployments and
nodes together, ``prefix_rows`` prompt blocks and ``affinity_rows`` sessions, each row with
one column per worker (:func:`state_bytes` gives the total; the defaults take about 14 MiB
for 16 workers, 10 MiB for 4). A worker index serves in one process at a time: a restarted
worker takes the index of the one it replaces, after :meth:`HostState.reclaim`.
"""

from __future__ import annotations

from pathlib import Path

from berth.host.affinity import SharedAffinityMap, affinity_row_bytes
from berth.host.deployments import SharedDeployments, deployment_row_bytes
from berth.host.errors import HostFileError
from berth.host.keys import SharedKeyCounters, key_row_bytes
from berth.host.prefixes import SharedPrefixIndex, prefix_header_bytes, prefix_row_bytes
from berth.host.region import HEADER, Region, Shape, Table
from berth.host.wake import WakeBox, WakeSender

DEFAULT_KEY_ROWS = 8192
DEFAULT_DEPLOYMENT_ROWS = 4096
DEFAULT_PREFIX_ROWS = 65_536
DEFAULT_AFFINITY_ROWS = 65_536
#: Table numbers (for the row locks).
KEYS, DEPLOYMENTS, PREFIXES, AFFINITY = range(4)
MAX_WORKERS = 256


def _align(size: int) -> int:
    return (size + 7) // 8 * 8


def _tables(region: Region) -> list[Table]:
    shape = region.shape
    sizes = [
        (shape.key_rows, _align(key_row_bytes(shape.workers))),
        (shape.deployment_rows, _align(deployment_row_bytes(shape.workers))),
        (shape.prefix_rows, prefix_row_bytes()),
        (shape.affinity_rows, affinity_row_bytes()),
    ]
    tables = []
    offset = _align(HEADER.size) + prefix_header_bytes()
    for number, (rows, row_bytes) in enumerate(sizes):
        tables.append(Table(region, number, offset, rows, row_bytes))
        offset += rows * row_bytes
    if offset > len(region.map):
        raise HostFileError(
            f"{region.path} is {len(region.map)} bytes, its header says {offset}",
            path=region.path,
            reason="size",
        )
    return tables


def state_bytes(shape: Shape) -> int:
    """The size of a state file of ``shape``, in bytes."""
    return (
        _align(HEADER.size)
        + prefix_header_bytes()
        + shape.key_rows * _align(key_row_bytes(shape.workers))
        + shape.deployment_rows * _align(deployment_row_bytes(shape.workers))
        + shape.prefix_rows * prefix_row_bytes()
        + shape.affinity_rows * affinity_row_bytes()
    )


class HostState:
    """The host's shared tables as worker ``worker`` sees them (``None``: the supervisor,
    which counts nothing itself: it creates, reclaims and closes)."""

    def __init__(self, region: Region, worker: int | None) -> None:
        self.region = region
        self.worker = worker
        self.shape = region.shape
        if worker is not None and not 0 <= worker < region.shape.workers:
            raise ValueError(f"worker {worker} is not in 0..{region.shape.workers - 1}")
        keys, deployments, prefixes, affinity = _tables(region)
        self._wake: WakeSender = (
            WakeBox(region.token, worker) if worker is not None else WakeSender(region.token)
        )
        index = worker if worker is not None else 0
        self.keys = SharedKeyCounters(region, keys, index)
        self.deployments = SharedDeployments(region, deployments, index, self._wake)
        self.prefixes = SharedPrefixIndex(region, prefixes, _align(HEADER.size))
        self.sessions = SharedAffinityMap(region, affinity)

    @classmethod
    def create(
        cls,
        path: Path,
        *,
        workers: int,
        key_rows: int = DEFAULT_KEY_ROWS,
        deployment_rows: int = DEFAULT_DEPLOYMENT_ROWS,
        prefix_rows: int = DEFAULT_PREFIX_ROWS,
        affinity_rows: int = DEFAULT_AFFINITY_ROWS,
    ) -> HostState:
        """A new state file at ``path`` for ``workers`` processes (the supervisor's view).
        Raises ``ValueError`` for a shape out of bounds."""
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"workers must be 1..{MAX_WORKERS}, got {workers}")
        if min(key_rows, deployment_rows) < 1 or min(prefix_rows, affinity_rows) < 8:
            raise ValueError("the key and deployment tables need a row, the others 8")
        shape = Shape(workers, key_rows, deployment_rows, prefix_rows, affinity_rows)
        return cls(Region.create(path, shape, state_bytes(shape)), None)

    @classmethod
    def attach(cls, path: Path, worker: int | None) -> HostState:
        """Worker ``worker``'s view of the state file at ``path`` (``None``: a supervisor's
        view, which counts nothing: to reclaim, after a supervisor restart). Raises
        :class:`HostFileError` for a file of another kind, ``ValueError`` for a worker
        index the file has no column for, ``OSError`` when another process holds the
        index's wake socket."""
        return cls(Region.attach(path), worker)

    @property
    def wake_box(self) -> WakeBox | None:
        """This worker's wake socket (``None`` for the supervisor)."""
        return self._wake if isinstance(self._wake, WakeBox) else None

    def reclaim(self, worker: int) -> int:
        """Give back everything worker ``worker`` held (it died; call before its index
        serves again): its requests and body bytes in flight, its token reservations, its
        slots (handed to waiting processes) and its waiting counts. Returns the slots it
        held."""
        self.keys.reclaim(worker)
        return self.deployments.reclaim(worker)

    def close(self) -> None:
        self._wake.close()
        self.region.close()
