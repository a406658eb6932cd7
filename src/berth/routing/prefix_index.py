"""The prefix policy's memory: which deployment served which prompt blocks, bounded.

An approximate record of the prompt prefixes each deployment has served, as the chained
block hashes of :mod:`berth.routing.prefix_blocks`: one entry per (block hash, deployment).
It is bounded by entries and by an estimate of their bytes (both settings,
``prefix_cache_entries`` and ``prefix_cache_mb``); past either bound the least recently
served entries go first. A request's blocks are recorded last block first, so within one
prompt its first blocks (the shared system prompt) are the most recent and the last to go:
what is left of an old prompt is always a prefix of it.

It is approximate both ways: an engine may have evicted what is recorded (its own cache is
smaller, or it restarted), which the engine's own signals correct where it has them (the
router drops what an engine no longer holds), and nothing here says which of an engine's
slots holds a prefix. The entries of a deployment that stops or leaves are dropped at once
(:meth:`PrefixIndex.drop`). Not thread-safe: the leader's event loop owns it.

:class:`PrefixRecord` is the contract the router uses; :class:`PrefixIndex` is this
process's, and :class:`berth.host.prefixes.SharedPrefixIndex` the one every serving process
of a host shares (a fixed table in the host's state file), so that a prompt goes to the
engine holding its prefix whichever process takes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Protocol

from berth.routing.prefix_blocks import PromptBlocks

#: What one entry costs in memory, in bytes, estimated (the LRU's node and key tuple, the
#: holder list's and the per-deployment set's slots; measured with tracemalloc at ~360).
ENTRY_BYTES = 384
#: Default bounds: entries, and MiB of entries.
DEFAULT_MAX_ENTRIES = 200_000
DEFAULT_MAX_MB = 64
_MiB = 1024 * 1024


class PrefixRecord(Protocol):
    """What the router asks of a prefix record (:class:`PrefixIndex`'s methods)."""

    def record(self, deployment_id: str, blocks: PromptBlocks, /) -> None: ...

    def matches(
        self, blocks: PromptBlocks, deployment_ids: Iterable[str], /
    ) -> Mapping[str, int]: ...

    def drop(self, deployment_id: str, /) -> int: ...

    def trim(self, caps: Mapping[str, int], /) -> dict[str, int]: ...

    def entries_of(self, deployment_id: str, /) -> int: ...


class PrefixIndex:
    """Block hash -> the deployments that served it, least recently served forgotten first.

    ``max_entries`` and ``max_mb`` bound it (the smaller wins, bytes counted at
    :data:`ENTRY_BYTES` an entry). Raises ``ValueError`` for a bound under 1.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_mb: int = DEFAULT_MAX_MB):
        if max_entries < 1 or max_mb < 1:
            raise ValueError("PrefixIndex bounds must be positive")
        self.capacity = min(max_entries, max_mb * _MiB // ENTRY_BYTES)
        self._lru: OrderedDict[tuple[int, str], None] = OrderedDict()
        #: block hash -> the deployments holding it (a list: a few at most, and far smaller)
        self._holders: dict[int, list[str]] = {}
        self._by_deployment: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes_estimate(self) -> int:
        """The entries' memory as estimated (entries x :data:`ENTRY_BYTES`)."""
        return len(self._lru) * ENTRY_BYTES

    def entries_of(self, deployment_id: str) -> int:
        return len(self._by_deployment.get(deployment_id, ()))

    def record(self, deployment_id: str, blocks: PromptBlocks) -> None:
        """``deployment_id`` was sent a request with these blocks: it holds them now."""
        if not blocks.hashes:
            return
        held = self._by_deployment.setdefault(deployment_id, set())
        lru = self._lru
        for block in reversed(blocks.hashes):
            key = (block, deployment_id)
            if key in lru:
                lru.move_to_end(key)
                continue
            lru[key] = None
            self._holders.setdefault(block, []).append(deployment_id)
            held.add(block)
        while len(lru) > self.capacity:
            (old, owner), _ = lru.popitem(last=False)
            self._unlink(old, owner)

    def matches(self, blocks: PromptBlocks, deployment_ids: Iterable[str]) -> Mapping[str, int]:
        """How many of ``blocks``' first blocks each of ``deployment_ids`` holds in a row
        (0: none); it does not mark anything as recently used."""
        alive = {d: 0 for d in deployment_ids}
        found = dict(alive)
        holders = self._holders
        for depth, block in enumerate(blocks.hashes, start=1):
            have = holders.get(block)
            if not have:
                break
            alive = {d: 0 for d in alive if d in have}
            if not alive:
                break
            for deployment_id in alive:
                found[deployment_id] = depth
        return found

    def drop(self, deployment_id: str) -> int:
        """Forget every entry of ``deployment_id`` (it stopped, or its node left); how many."""
        held = self._by_deployment.pop(deployment_id, set())
        for block in held:
            del self._lru[(block, deployment_id)]
            self._release(block, deployment_id)
        return len(held)

    def trim(self, caps: Mapping[str, int]) -> dict[str, int]:
        """Keep at most ``caps[d]`` entries of each deployment ``d`` (its engine's cache
        capacity, in blocks), its least recently served going first; how many went, per
        deployment that lost any. One pass over the record, only when one is over its cap."""
        over = {d: self.entries_of(d) - cap for d, cap in caps.items() if self.entries_of(d) > cap}
        if not over:
            return {}
        gone = dict.fromkeys(over, 0)
        doomed: list[tuple[int, str]] = []
        for key in self._lru:  # oldest first
            owner = key[1]
            if owner in over and gone[owner] < over[owner]:
                gone[owner] += 1
                doomed.append(key)
                if len(doomed) == sum(over.values()):
                    break
        for block, owner in doomed:
            del self._lru[(block, owner)]
            self._unlink(block, owner)
        return gone

    def deployments(self) -> list[str]:
        """The deployments with entries."""
        return list(self._by_deployment)

    def _release(self, block: int, deployment_id: str) -> None:
        owners = self._holders.get(block)
        if owners is not None and deployment_id in owners:
            owners.remove(deployment_id)
            if not owners:
                del self._holders[block]

    def _unlink(self, block: int, deployment_id: str) -> None:
        self._release(block, deployment_id)
        held = self._by_deployment.get(deployment_id)
        if held is not None:
            held.discard(block)
            if not held:
                del self._by_deployment[deployment_id]
