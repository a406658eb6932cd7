"""An engine's answer as the proxy reads it, whichever way it came (:class:`EngineAnswer`), so
local and tunneled engines share one relay path."""

from __future__ import annotations

from typing import Protocol


class EngineAnswer(Protocol):
    """How the proxy reads an engine's answer, local
    (:class:`berth.engine_http.response.UpstreamResponse`) or tunneled through an agent
    (:class:`berth.cluster.remote_link.TunnelResponse`).

    ``status``; ``headers`` as lower-case ``(name, value)`` bytes pairs; ``content_length``
    (``None`` when not announced). :meth:`read_chunk` and :meth:`read` raise
    :class:`UpstreamError` subclasses; :meth:`close` ends the exchange (an unfinished one
    tells the engine to stop).
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    content_length: int | None

    def header(self, name: bytes) -> bytes | None: ...

    @property
    def at_eof(self) -> bool: ...

    async def read_chunk(self) -> bytes: ...

    async def read(self, limit_bytes: int | None = None) -> bytes: ...

    def close(self) -> None: ...


async def read_body(answer: EngineAnswer, limit_bytes: int | None = None) -> bytes:
    """The rest of ``answer``'s body, or at most its first ``limit_bytes`` bytes, read chunk
    by chunk; raises what ``answer.read_chunk`` raises."""
    parts: list[bytes] = []
    size = 0
    while limit_bytes is None or size < limit_bytes:
        chunk = await answer.read_chunk()
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    data = b"".join(parts)
    return data if limit_bytes is None else data[:limit_bytes]
