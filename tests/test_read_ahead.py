"""The bounded buffer between an engine's answer and a slow client."""

from __future__ import annotations

import asyncio

import pytest

from berth.engine_http.errors import UpstreamDisconnectError
from berth.engine_http.origin import Origin
from berth.gateway.read_ahead import ReadAhead


class EndlessAnswer:
    """An engine that always has another chunk ready; counts what was read from it."""

    def __init__(self, chunk: bytes = b"x" * 10, fail_after: int | None = None) -> None:
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length = None
        self.chunk = chunk
        self.reads = 0
        self.closed = False
        self.fail_after = fail_after

    def header(self, name: bytes) -> bytes | None:
        return None

    @property
    def at_eof(self) -> bool:
        return False

    async def read_chunk(self) -> bytes:
        await asyncio.sleep(0)
        if self.fail_after is not None and self.reads >= self.fail_after:
            raise UpstreamDisconnectError(Origin("e", 1), "gone", answered=True)
        self.reads += 1
        return self.chunk

    async def read(self, limit_bytes: int | None = None) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("max_chunks", "max_bytes", "bound"), [(4, 10_000, 5), (64, 35, 4)])
async def test_a_stalled_reader_stops_the_reading(
    max_chunks: int, max_bytes: int, bound: int
) -> None:
    answer = EndlessAnswer()
    ahead = ReadAhead(answer, max_chunks, max_bytes)  # type: ignore[arg-type]
    await asyncio.sleep(0.05)  # nobody reads
    assert answer.reads <= bound
    stalled = answer.reads
    assert await ahead.read_chunk() == b"x" * 10
    await asyncio.sleep(0.05)
    assert stalled < answer.reads <= bound + 1  # one taken, room for one more
    ahead.close()
    await asyncio.sleep(0)
    assert answer.closed


async def test_errors_arrive_after_the_chunks_before_them() -> None:
    answer = EndlessAnswer(fail_after=2)
    ahead = ReadAhead(answer)  # type: ignore[arg-type]
    assert await ahead.read_chunk() == b"x" * 10
    assert await ahead.read_chunk() == b"x" * 10
    with pytest.raises(UpstreamDisconnectError):
        await ahead.read_chunk()
    ahead.close()
