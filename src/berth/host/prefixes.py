"""The prefix policy's record shared by the host's serving processes: which deployment was
sent which prompt blocks, so that every process sends a prompt to the engine already
holding its prefix.

The same contract as :class:`berth.routing.prefix_index.PrefixIndex` (record, matches, drop,
trim), over a fixed table of the state file: :data:`DEPLOYMENTS` named deployment places
(a 16-byte digest each: a deployment's bit), then the entries, 24 bytes each::

    block hash u64 | deployments holding it (a bit each) u64 | last served u64 (ns)

A block's entry is in its hash's window of :data:`WINDOW` rows, found with one
``mmap.find``; a match of a prompt is one find per block, its deployments' bits anded as
the prefix goes on. **Bounded**: a window with no room takes the place of its least
recently served entry (an approximate LRU: per window, not across the table), so the record
never holds more than ``rows`` blocks (24 bytes each: 1.5 MiB for the default 65,536). A
prompt is recorded last block first, as in process, so within a window the shared system
prompt is the last to go. At most :data:`DEPLOYMENTS` deployments hold entries at once
(:meth:`SharedPrefixIndex.drop` gives a place back); a deployment beyond them is not
recorded, and is routed as one holding no prefix.

No lock on the request path: an entry is written whole, and two processes recording the
same block at once may lose one's bit (the record is a hint the router checks against the
engines' own signals, as in process). Dropping and trimming read the whole table (a few
milliseconds: a deployment stopped, an engine's report).
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from berth.host.region import Region, Table

WINDOW = 8
DEPLOYMENTS = 64
ENTRY = struct.Struct("<QQQ")
_BLOCK = struct.Struct("<Q")
_MASK = (1 << 64) - 1
_NAME_BYTES = 16


class Blocks(Protocol):
    """A prompt's chained block hashes (:class:`berth.routing.prefix_blocks.PromptBlocks`)."""

    @property
    def hashes(self) -> Sequence[int]: ...


def prefix_row_bytes() -> int:
    return ENTRY.size


def prefix_header_bytes() -> int:
    return DEPLOYMENTS * _NAME_BYTES


def _name_of(deployment_id: str) -> bytes:
    digest = hashlib.blake2b(deployment_id.encode(), digest_size=_NAME_BYTES).digest()
    return digest if digest != bytes(_NAME_BYTES) else b"\x01" + digest[1:]


class SharedPrefixIndex:
    """Block hash -> the deployments that were sent it, in the host's state file (see the
    module doc). ``names_at`` is the offset of the deployment places."""

    def __init__(self, region: Region, table: Table, names_at: int) -> None:
        self._region = region
        self._table = table
        self._names_at = names_at
        self.capacity = table.rows
        self._bits: dict[str, tuple[bytes, int]] = {}  # deployment -> (name, bit), checked

    # -- deployments' places ------------------------------------------------------------------

    def _bit_of(self, deployment_id: str, *, add: bool) -> int:
        # The deployment's bit (0: it has no place, and ``add`` is false or none is free).
        mapped = self._region.map
        known = self._bits.get(deployment_id)
        if known is not None:
            name, bit = known
            at = self._names_at + _NAME_BYTES * (bit.bit_length() - 1)
            if mapped[at : at + _NAME_BYTES] == name:
                return bit
        name = _name_of(deployment_id)
        empty = bytes(_NAME_BYTES)
        places = mapped[self._names_at : self._names_at + prefix_header_bytes()]
        found = places.find(name)
        while found >= 0 and found % _NAME_BYTES:
            found = places.find(name, found + 1)
        if found < 0 and add:
            region, table = self._region, self._table
            region.lock(table.number, table.rows)
            try:
                places = mapped[self._names_at : self._names_at + prefix_header_bytes()]
                for place in range(DEPLOYMENTS):
                    if places[place * _NAME_BYTES : (place + 1) * _NAME_BYTES] == empty:
                        at = self._names_at + place * _NAME_BYTES
                        mapped[at : at + _NAME_BYTES] = name
                        found = place * _NAME_BYTES
                        break
            finally:
                region.unlock(table.number, table.rows)
        if found < 0:
            return 0
        bit = 1 << (found // _NAME_BYTES)
        self._bits[deployment_id] = (name, bit)
        return bit

    # -- entries ------------------------------------------------------------------------------

    def _find(self, block: int) -> int:
        # The byte offset of ``block``'s entry in its window, or -1.
        table = self._table
        start = table.at(block % (table.rows - WINDOW + 1))
        end = start + WINDOW * ENTRY.size
        mapped = self._region.map
        needle = _BLOCK.pack(block)
        found = mapped.find(needle, start, end)
        while found >= 0 and (found - start) % ENTRY.size:
            found = mapped.find(needle, found + 1, end)
        return found

    def __len__(self) -> int:
        return sum(1 for _b, held, _s in self._entries() if held)

    def _entries(self) -> Iterable[tuple[int, int, int]]:
        table = self._table
        return ENTRY.iter_unpack(self._region.map[table.at(0) : table.at(table.rows)])

    @property
    def bytes_estimate(self) -> int:
        """The table's size in bytes (it is allocated whole)."""
        return self._table.rows * ENTRY.size + prefix_header_bytes()

    def record(self, deployment_id: str, blocks: Blocks) -> None:
        """``deployment_id`` was sent a request with these blocks: it holds them now."""
        hashes = blocks.hashes
        if not hashes:
            return
        bit = self._bit_of(deployment_id, add=True)
        if not bit:
            return
        mapped = self._region.map
        table = self._table
        now = time.monotonic_ns()
        for step, block in enumerate(reversed(hashes)):
            block &= _MASK
            stamp = now + step  # later blocks first: the first blocks are the newest
            at = self._find(block)
            if at >= 0:
                _b, held, _s = ENTRY.unpack_from(mapped, at)
                ENTRY.pack_into(mapped, at, block, held | bit, stamp)
                continue
            start = table.at(block % (table.rows - WINDOW + 1))
            oldest, oldest_stamp = start, _MASK
            for place in range(start, start + WINDOW * ENTRY.size, ENTRY.size):
                _b, held, served = ENTRY.unpack_from(mapped, place)
                if not held:
                    oldest = place
                    break
                if served < oldest_stamp:
                    oldest, oldest_stamp = place, served
            ENTRY.pack_into(mapped, oldest, block, bit, stamp)

    def matches(self, blocks: Blocks, deployment_ids: Iterable[str]) -> Mapping[str, int]:
        """How many of ``blocks``' first blocks each of ``deployment_ids`` holds in a row
        (0: none); it marks nothing as recently served."""
        found = dict.fromkeys(deployment_ids, 0)
        bits = {d: self._bit_of(d, add=False) for d in found}
        alive = 0
        for bit in bits.values():
            alive |= bit
        mapped = self._region.map
        depth = 0
        for block in blocks.hashes:
            if not alive:
                break
            at = self._find(block & _MASK)
            if at < 0:
                break
            alive &= ENTRY.unpack_from(mapped, at)[1]
            if alive:
                depth += 1
                for deployment_id, bit in bits.items():
                    if alive & bit:
                        found[deployment_id] = depth
        return found

    def entries_of(self, deployment_id: str) -> int:
        bit = self._bit_of(deployment_id, add=False)
        if not bit:
            return 0
        return sum(1 for _b, held, _s in self._entries() if held & bit)

    def _clear(self, bit: int, keep: int | None) -> int:
        # Take ``bit`` off every entry (or off all but the ``keep`` most recently served);
        # how many lost it.
        table = self._table
        mapped = self._region.map
        holding = [
            (served, row) for row, (_b, held, served) in enumerate(self._entries()) if held & bit
        ]
        if keep is not None:
            holding.sort()
            holding = holding[: max(0, len(holding) - keep)]
        for _served, row in holding:
            at = table.at(row)
            block, held, served = ENTRY.unpack_from(mapped, at)
            ENTRY.pack_into(mapped, at, block, held & ~bit & _MASK, served)
        return len(holding)

    def drop(self, deployment_id: str) -> int:
        """Forget every entry of ``deployment_id`` (in every process) and give its place
        back; how many."""
        bit = self._bit_of(deployment_id, add=False)
        if not bit:
            return 0
        gone = self._clear(bit, None)
        at = self._names_at + _NAME_BYTES * (bit.bit_length() - 1)
        self._region.map[at : at + _NAME_BYTES] = bytes(_NAME_BYTES)
        self._bits.pop(deployment_id, None)
        return gone

    def trim(self, caps: Mapping[str, int]) -> dict[str, int]:
        """Keep at most ``caps[d]`` entries of each deployment ``d``, its least recently
        served going first; how many went, per deployment that lost any."""
        gone: dict[str, int] = {}
        for deployment_id, cap in caps.items():
            bit = self._bit_of(deployment_id, add=False)
            if bit:
                lost = self._clear(bit, cap)
                if lost:
                    gone[deployment_id] = lost
        return gone

    def deployments(self) -> list[str]:
        """The deployments this process knows by name that have entries."""
        return [d for d in list(self._bits) if self.entries_of(d)]
