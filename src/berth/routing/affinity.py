"""Session affinity: keep a conversation on the node whose engine has its KV cache.

A bounded LRU map from an affinity key to a node id. The key is the ``X-Session-Id`` request
header, else ``X-Conversation-Id``, else the API key (a hash of it: the map never holds a
secret).

:class:`SessionRecord` is the contract the router uses; :class:`AffinityMap` is this
process's, and :class:`berth.host.affinity.SharedAffinityMap` the one every serving process
of a host shares, so a session goes to one node whichever process takes its requests.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

#: The prefix of keys taken from the API key (no session header): a weak preference.
API_KEY_PREFIX = "key:"
#: Entries kept before the least recently used is forgotten.
DEFAULT_CAPACITY = 100_000
_MAX_KEY_BYTES = 256


def affinity_key(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The affinity key of a request from its (lower-case) ASGI headers, or ``None``.

    Values longer than 256 bytes are hashed, so a client cannot make the map hold big keys.
    """
    session = conversation = bearer = None
    for name, value in headers:
        if name == b"x-session-id" and value:
            session = value
        elif name == b"x-conversation-id" and value:
            conversation = value
        elif name == b"authorization" and value[:7].lower() == b"bearer ":
            bearer = value[7:].strip()
    if session is not None:
        return "session:" + _bounded(session)
    if conversation is not None:
        return "conversation:" + _bounded(conversation)
    if bearer:
        return API_KEY_PREFIX + hashlib.sha256(bearer).hexdigest()[:32]
    return None


def _bounded(value: bytes) -> str:
    if len(value) > _MAX_KEY_BYTES:
        return "sha256:" + hashlib.sha256(value).hexdigest()
    return value.decode("latin-1")


class SessionRecord(Protocol):
    """What the router asks of a session map (:class:`AffinityMap`'s methods)."""

    def get(self, key: str | None, /) -> str | None: ...

    def peek(self, key: str | None, /) -> str | None: ...

    def record(self, key: str | None, node_id: str, /) -> None: ...

    def forget_node(self, node_id: str, /) -> int: ...


class AffinityMap:
    """Key -> node id, at most ``capacity`` entries (least recently used go first)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("AffinityMap capacity must be positive")
        self._capacity = capacity
        self._nodes: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, key: str | None) -> str | None:
        if key is None:
            return None
        node = self._nodes.get(key)
        if node is not None:
            self._nodes.move_to_end(key)
        return node

    def peek(self, key: str | None) -> str | None:
        """Like :meth:`get`, without marking the entry as recently used."""
        return None if key is None else self._nodes.get(key)

    def record(self, key: str | None, node_id: str) -> None:
        """``key`` was served by ``node_id`` (after a successful dispatch)."""
        if key is None:
            return
        self._nodes[key] = node_id
        self._nodes.move_to_end(key)
        while len(self._nodes) > self._capacity:
            self._nodes.popitem(last=False)

    def forget_node(self, node_id: str) -> int:
        """Drop every entry pointing at ``node_id`` (it became unreachable); how many."""
        stale = [key for key, node in self._nodes.items() if node == node_id]
        for key in stale:
            del self._nodes[key]
        return len(stale)
