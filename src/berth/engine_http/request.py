"""One request to an engine, as it travels from the proxy's attempt down to the socket: to a
local engine over berth's pooled client, to a remote one through its node's link or direct
data path, and on the agent to the engine it relays to (as httpx carries one ``Request``).

A new field of a request (a deadline, a priority) is one field here, not an argument of
every opener.
"""

from __future__ import annotations

from typing import NamedTuple

_POST = b"POST"


class EngineRequest(NamedTuple):
    """What is sent to an engine.

    ``path`` is the API path as the engine serves it (``/v1/chat/completions``; a local
    engine's base URL path is put before it by the proxy's client), ``query`` the raw query
    string (no ``?``, ``b""``: none), ``headers`` those the engine may see (lower-case byte
    pairs, without ``Host`` and ``Content-Length``; the engine's own key is added by whoever
    reaches it: the proxy for a local engine, the agent for a remote one), ``body`` the bytes
    to send and ``method`` the HTTP method (``POST`` for a client's request, ``GET`` for the
    leader's reads of an engine's ``/slots`` and ``/metrics``).
    """

    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    method: bytes = _POST

    @property
    def target(self) -> bytes:
        """The origin-form request target: ``path``, then ``?query`` when there is one."""
        path = self.path.encode("latin-1")
        return path + b"?" + self.query if self.query else path

    @classmethod
    def from_target(
        cls, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> EngineRequest:
        """The request for an origin-form ``target`` (``/v1/models?x=1``), as an agent
        receives it from the leader."""
        path, _, query = target.partition(b"?")
        return cls(path.decode("latin-1"), query, headers, body, method)
