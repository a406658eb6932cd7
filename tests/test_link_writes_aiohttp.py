"""The link's write shortcuts (``cluster/link/write_batch.py``) against the aiohttp installed here.

They reach into aiohttp's private WebSocket writer (``_writer``, its ``transport``,
``_write_websocket_frame``, ``_closing``, ``protocol.writing_paused``). When an aiohttp
release changes any of that, :func:`coalesce_writes` and :func:`frame_writer` return
``None`` and the link falls back to ``send_bytes`` without a word: still correct, but every
token event costs a coroutine and a TLS record again. These tests fail then, on both ends of
a real WebSocket over loopback (aiohttp's server and its client), so the fallback is seen
before a release is allowed (``pyproject.toml`` bounds aiohttp to the minor tested here).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from berth.cluster.link.write_batch import BatchingTransport, coalesce_writes, frame_writer


@asynccontextmanager
async def _websocket_pair() -> AsyncIterator[
    tuple[web.WebSocketResponse, aiohttp.ClientWebSocketResponse]
]:
    """A real WebSocket on 127.0.0.1: aiohttp's server end and its client end."""
    accepted: asyncio.Future[web.WebSocketResponse] = asyncio.get_running_loop().create_future()
    finished = asyncio.Event()

    async def endpoint(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=False)
        await ws.prepare(request)
        accepted.set_result(ws)
        await finished.wait()
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/ws", endpoint)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        url = f"http://127.0.0.1:{port}/ws"
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(url, autoping=False) as client,
        ):
            server = await asyncio.wait_for(accepted, 10)
            yield server, client
            finished.set()
    finally:
        finished.set()
        await runner.cleanup()


async def _received(ws: web.WebSocketResponse | aiohttp.ClientWebSocketResponse) -> bytes:
    message = await asyncio.wait_for(ws.receive(), 10)
    assert message.type is aiohttp.WSMsgType.BINARY, message
    data: bytes = message.data
    return data


async def test_the_frame_writer_is_aiohttps_own_on_both_ends_and_the_peer_reads_its_frames() -> (
    None
):
    async with _websocket_pair() as (server, client):
        for ws, peer in ((client, server), (server, client)):
            frames = frame_writer(ws)
            assert frames is not None, (
                f"aiohttp {aiohttp.__version__}: frame_writer fell back to send_bytes "
                f"({type(ws).__name__}'s private writer changed shape)"
            )
            assert frames.ready
            frames.write(b"\x00one frame")  # the client's frames are masked (RFC 6455 5.3)
            frames.write(b"")
            assert await _received(peer) == b"\x00one frame"
            assert await _received(peer) == b""


async def test_writes_are_coalesced_on_both_ends_and_arrive_whole_and_in_order() -> None:
    async with _websocket_pair() as (server, client):
        for ws, peer in ((client, server), (server, client)):
            batching = coalesce_writes(ws)
            assert isinstance(batching, BatchingTransport), (
                f"aiohttp {aiohttp.__version__}: coalesce_writes left {type(ws).__name__} "
                f"unbatched (its private writer changed shape)"
            )
            writes: list[int] = []
            real_write = batching.transport.write

            def counted(data: bytes | bytearray | memoryview, real=real_write, seen=writes) -> None:
                seen.append(len(data))
                real(data)

            batching.transport.write = counted  # type: ignore[method-assign]
            frames = frame_writer(ws)
            assert frames is not None and frames.ready
            for n in range(3):
                frames.write(b"event %d" % n)
            await ws.send_bytes(b"after")
            assert [await _received(peer) for _ in range(4)] == [
                b"event 0",
                b"event 1",
                b"event 2",
                b"after",
            ]
            assert len(writes) < 4, f"{len(writes)} transport writes for 4 frames of one pass"
