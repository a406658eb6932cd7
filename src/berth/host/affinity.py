"""Session affinity shared by the host's serving processes: affinity key -> node id, so a
conversation goes to the same node whichever process takes its next request.

The contract of :class:`berth.routing.affinity.AffinityMap` (get, peek, record,
forget_node) over a fixed table of the state file. A row is 96 bytes::

    key digest 16s (BLAKE2b of the affinity key) | last used u64 (ns) | node id 72s

An entry's place is its digest's window of :data:`WINDOW` rows (windows do not overlap).
**Bounded**: a window with no room takes the place of its least recently used entry (an
approximate LRU, per window), so the map never holds more than ``rows`` sessions (6 MiB for
the default 65,536). A node id longer than 72 bytes is not recorded (the request is routed
as one without affinity).

Writes take the window's lock (its first row's); reads take none and check the key digest
again after reading the node, so a read racing a write sees the old or the new entry, or
none.
"""

from __future__ import annotations

import struct
import time

from berth.host.region import Region, Table, digest_of

WINDOW = 8
ROW = struct.Struct("<16sQ72s")
MAX_NODE_BYTES = 72


def affinity_row_bytes() -> int:
    return ROW.size


class SharedAffinityMap:
    """Affinity key -> node id in the host's state file (see the module doc)."""

    def __init__(self, region: Region, table: Table) -> None:
        self._region = region
        self._table = table

    def _start(self, digest: bytes) -> int:
        buckets = self._table.rows // WINDOW  # windows do not overlap: one lock each
        return int.from_bytes(digest[:8], "little") % buckets * WINDOW

    def _find(self, digest: bytes) -> tuple[int, str | None]:
        start = self._start(digest)
        mapped = self._region.map
        table = self._table
        at = table.at(start)
        window = mapped[at : at + WINDOW * ROW.size]
        found = window.find(digest)
        while found >= 0 and found % ROW.size:
            found = window.find(digest, found + 1)
        if found < 0:
            return -1, None
        row = start + found // ROW.size
        name, _used, node = ROW.unpack_from(mapped, table.at(row))
        if name != digest:  # rewritten while read
            return -1, None
        return row, node.rstrip(b"\0").decode()

    def __len__(self) -> int:
        mapped = self._region.map
        table = self._table
        empty = bytes(16)
        return sum(
            1 for row in range(table.rows) if mapped[table.at(row) : table.at(row) + 16] != empty
        )

    def get(self, key: str | None) -> str | None:
        if key is None:
            return None
        row, node = self._find(digest_of(key))
        if row >= 0:
            struct.pack_into("<Q", self._region.map, self._table.at(row) + 16, time.monotonic_ns())
        return node

    def peek(self, key: str | None) -> str | None:
        """Like :meth:`get`, without marking the entry as recently used."""
        return None if key is None else self._find(digest_of(key))[1]

    def record(self, key: str | None, node_id: str) -> None:
        """``key`` was served by ``node_id`` (after a successful dispatch)."""
        if key is None:
            return
        node = node_id.encode()
        if len(node) > MAX_NODE_BYTES:
            return
        digest = digest_of(key)
        region, table = self._region, self._table
        start = self._start(digest)
        region.lock(table.number, start)  # the window's first row locks the window
        try:
            row, _old = self._find(digest)
            if row < 0:
                row, oldest = start, -1
                for candidate in range(start, start + WINDOW):
                    name, used, _node = ROW.unpack_from(region.map, table.at(candidate))
                    if name == bytes(16):
                        row = candidate
                        break
                    if oldest < 0 or used < oldest:
                        row, oldest = candidate, used
            ROW.pack_into(region.map, table.at(row), digest, time.monotonic_ns(), node)
        finally:
            region.unlock(table.number, start)

    def forget_node(self, node_id: str) -> int:
        """Drop every entry pointing at ``node_id`` (it became unreachable); how many."""
        node = node_id.encode()
        if len(node) > MAX_NODE_BYTES:
            return 0
        padded = node.ljust(MAX_NODE_BYTES, b"\0")
        mapped = self._region.map
        table = self._table
        start, end = table.at(0), table.at(table.rows)
        count = 0
        at = mapped.find(padded, start, end)
        while at >= 0:
            if (at - start) % ROW.size == 24:
                row = (at - start) // ROW.size
                ROW.pack_into(mapped, table.at(row), bytes(16), 0, bytes(MAX_NODE_BYTES))
                count += 1
            at = mapped.find(padded, at + 1, end)
        return count
