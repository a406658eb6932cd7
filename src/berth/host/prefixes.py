"""The prefix policy's record shared by the host's serving processes: which deployment was
sent which prompt blocks, so that every process sends a prompt to the engine already
holding its prefix.

The same contract as :class:`berth.routing.prefix_index.PrefixIndex` (record, matches, drop,
trim), over a fixed table of the state file. An entry is 24 bytes::

    block hash u64 | deployment tag u64 (BLAKE2b of its id, 8 bytes) | last served u64 (ns)

An entry's place is its hash's window of :data:`WINDOW` rows; a window read is one slice
and one ``bytes.find``. **Bounded**: a window with no room drops its least recently served
entry (an approximate LRU: per window, not across the table), so the record never grows past
``rows`` entries (24 bytes each: 1.5 MiB for the default 65,536). A block of a prompt is
recorded last block first, as in process, so within a window the shared system prompt is
the last to go.

No lock: an entry is written in two aligned 8-byte stores and read back whole; a read that
races a write sees the old or the new entry (the record is a hint the router checks against
the engines' own signals, as in process). Deployments are known by their tag: this process
names those it recorded or was asked about (:meth:`deployments` lists those with entries).
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from berth.host.region import Region, Table

WINDOW = 8
ENTRY = struct.Struct("<QQQ")
_MASK = (1 << 64) - 1


class Blocks(Protocol):
    """A prompt's chained block hashes (:class:`berth.routing.prefix_blocks.PromptBlocks`)."""

    @property
    def hashes(self) -> Sequence[int]: ...


def prefix_row_bytes() -> int:
    return ENTRY.size


def _tag(deployment_id: str) -> int:
    tag = int.from_bytes(hashlib.blake2b(deployment_id.encode(), digest_size=8).digest(), "little")
    return tag or 1  # 0 marks an empty entry


class SharedPrefixIndex:
    """Block hash x deployment -> last served, in the host's state file (see the module
    doc)."""

    def __init__(self, region: Region, table: Table) -> None:
        self._region = region
        self._table = table
        self.capacity = table.rows
        self._tags: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def _tag_of(self, deployment_id: str) -> int:
        tag = self._tags.get(deployment_id)
        if tag is None:
            tag = self._tags[deployment_id] = _tag(deployment_id)
            self._names[tag] = deployment_id
        return tag

    def _window(self, block: int, tag: int) -> int:
        # The first row of the window of (block, deployment): block hashes are spread
        # already; the tag spreads one block's deployments over different windows.
        rows = self._table.rows
        return ((block ^ (tag * 0x9E3779B97F4A7C15)) & _MASK) % max(1, rows - WINDOW + 1)

    def _find(self, block: int, tag: int) -> int:
        # The row of (block, tag) in its window, or -1.
        start = self._window(block, tag)
        table = self._table
        at = table.at(start)
        window = self._region.map[at : at + WINDOW * ENTRY.size]
        needle = struct.pack("<QQ", block & _MASK, tag)
        found = window.find(needle)
        while found >= 0 and found % ENTRY.size:
            found = window.find(needle, found + 1)
        return -1 if found < 0 else start + found // ENTRY.size

    def __len__(self) -> int:
        mapped = self._region.map
        table = self._table
        count = 0
        for row in range(table.rows):
            at = table.at(row) + 8
            if mapped[at : at + 8] != bytes(8):
                count += 1
        return count

    @property
    def bytes_estimate(self) -> int:
        """The table's size in bytes (it is allocated whole)."""
        return self._table.rows * ENTRY.size

    def record(self, deployment_id: str, blocks: Blocks) -> None:
        """``deployment_id`` was sent a request with these blocks: it holds them now."""
        hashes = blocks.hashes
        if not hashes:
            return
        tag = self._tag_of(deployment_id)
        mapped = self._region.map
        table = self._table
        now = time.monotonic_ns()
        for step, block in enumerate(reversed(hashes)):
            block &= _MASK
            stamp = now + step  # later blocks first: the first blocks are the newest
            row = self._find(block, tag)
            if row < 0:
                start = self._window(block, tag)
                oldest, oldest_stamp = start, _MASK
                for candidate in range(start, start + WINDOW):
                    _b, owner, served = ENTRY.unpack_from(mapped, table.at(candidate))
                    if owner == 0:
                        oldest = candidate
                        break
                    if served < oldest_stamp:
                        oldest, oldest_stamp = candidate, served
                row = oldest
                ENTRY.pack_into(mapped, table.at(row), block, tag, stamp)
            else:
                struct.pack_into("<Q", mapped, table.at(row) + 16, stamp)

    def matches(self, blocks: Blocks, deployment_ids: Iterable[str]) -> Mapping[str, int]:
        """How many of ``blocks``' first blocks each of ``deployment_ids`` holds in a row
        (0: none); it marks nothing as recently served."""
        found = {d: 0 for d in deployment_ids}
        alive = [(d, self._tag_of(d)) for d in found]
        for depth, block in enumerate(blocks.hashes, start=1):
            block &= _MASK
            alive = [(d, tag) for d, tag in alive if self._find(block, tag) >= 0]
            if not alive:
                break
            for deployment_id, _tag_value in alive:
                found[deployment_id] = depth
        return found

    def _rows_of(self, tag: int) -> list[int]:
        mapped = self._region.map
        table = self._table
        start, end = table.at(0), table.at(table.rows)
        needle = struct.pack("<Q", tag)
        rows = []
        at = mapped.find(needle, start, end)
        while at >= 0:
            if (at - start) % ENTRY.size == 8:
                rows.append((at - start) // ENTRY.size)
            at = mapped.find(needle, at + 1, end)
        return rows

    def entries_of(self, deployment_id: str) -> int:
        return len(self._rows_of(self._tag_of(deployment_id)))

    def drop(self, deployment_id: str) -> int:
        """Forget every entry of ``deployment_id`` (in every process); how many."""
        rows = self._rows_of(self._tag_of(deployment_id))
        mapped = self._region.map
        for row in rows:
            ENTRY.pack_into(mapped, self._table.at(row), 0, 0, 0)
        return len(rows)

    def trim(self, caps: Mapping[str, int]) -> dict[str, int]:
        """Keep at most ``caps[d]`` entries of each deployment ``d``, its least recently
        served going first; how many went, per deployment that lost any."""
        mapped = self._region.map
        gone: dict[str, int] = {}
        for deployment_id, cap in caps.items():
            rows = self._rows_of(self._tag_of(deployment_id))
            if len(rows) <= cap:
                continue
            stamped = sorted(
                (ENTRY.unpack_from(mapped, self._table.at(row))[2], row) for row in rows
            )
            doomed = stamped[: len(rows) - cap]
            for _stamp, row in doomed:
                ENTRY.pack_into(mapped, self._table.at(row), 0, 0, 0)
            gone[deployment_id] = len(doomed)
        return gone

    def deployments(self) -> list[str]:
        """The deployments this process knows by name that have entries."""
        return [d for d, tag in self._tags.items() if self._rows_of(tag)]
