"""The control requests one end of an agent link asked, waiting for their answers.

:class:`PendingCalls` pairs each answer (and progress event) that arrives with the request
:meth:`~berth.cluster.link.connection.LinkConnection.call` sent, by request id, and turns an error
answer into :class:`RemoteOpError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from berth.cluster.protocol.errors import LinkError
from berth.cluster.protocol.frames import Progress, Response
from berth.cluster.protocol.ops import Op
from berth.cluster.protocol.payloads import ErrorCode, ErrorInfo

A = TypeVar("A", bound=msgspec.Struct)
R = TypeVar("R")

#: Hears a running request's progress events (e.g. a pull's bytes).
ProgressListener = Callable[[Progress], Awaitable[None]]


class RemoteOpError(LinkError):
    """The peer answered a control request with an error (``info`` says which)."""

    def __init__(self, op: str, info: ErrorInfo) -> None:
        super().__init__(f"{op} failed on the agent: {info.message}")
        self.op = op
        self.info = info


class PendingCalls:
    """The requests waiting for an answer, by request id, each with its progress listener."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[asyncio.Future[Response], ProgressListener | None]] = {}

    def expect(
        self, request_id: int, on_progress: ProgressListener | None
    ) -> asyncio.Future[Response]:
        """Wait for the answer to ``request_id`` (sent, or about to be)."""
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, on_progress)
        return future

    async def result(
        self,
        op: Op[A, R],
        request_id: int,
        answer: asyncio.Future[Response],
        timeout_s: float,
        peer: str,
    ) -> R:
        """The result of ``op`` once ``answer`` arrives, decoded as the op's result type.

        Raises :class:`RemoteOpError` for an error answer, ``ProtocolError`` for a result
        not of the op's shape, and :class:`LinkError` when nothing comes within
        ``timeout_s`` seconds (or the link is lost: :meth:`fail`).
        """
        try:
            async with asyncio.timeout(timeout_s):
                response = await answer
        except TimeoutError:
            raise LinkError(f"{op.name} on {peer} got no answer within {timeout_s} s") from None
        finally:
            self._pending.pop(request_id, None)
        if not response.ok:
            error = response.error or ErrorInfo(code=ErrorCode.INTERNAL, message="?")
            raise RemoteOpError(op.name, error)
        return op.decode_result(response.result)

    def answered(self, response: Response) -> None:
        """``response`` arrived: its waiting request (if still waiting) has it."""
        pending = self._pending.get(response.id)
        if pending is not None and not pending[0].done():
            pending[0].set_result(response)

    def listener(self, request_id: int) -> ProgressListener | None:
        """Who hears the progress of request ``request_id`` (``None``: nobody, or no such
        request)."""
        pending = self._pending.get(request_id)
        return pending[1] if pending is not None else None

    def fail(self, error: LinkError) -> None:
        """The link is lost: every request still waiting fails with ``error``."""
        for future, _listener in self._pending.values():
            if not future.done():
                future.set_exception(error)
