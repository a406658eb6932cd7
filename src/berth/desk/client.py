"""The desk's HTTP API, as the worker calls it (the protocol's "Desk" and "Pool test" tables).

JSON in, JSON out. Every call but registration carries ``Authorization: Bearer <node
secret>``. Errors are typed: no answer is :class:`DeskUnreachableError`, an error status is
:class:`DeskRefusedError` with the desk's ``error`` message, a body the protocol does not
allow is :class:`DeskProtocolError`. A pool with a private CA is trusted through
``SSL_CERT_FILE``, as every httpx client does.
"""

from __future__ import annotations

from typing import Final

import httpx
import msgspec

from berth import __version__
from berth.desk.errors import DeskProtocolError, DeskRefusedError, DeskUnreachableError
from berth.desk.wire import (
    ClaimedJob,
    ErrorAnswer,
    Fail,
    Finish,
    LinkCode,
    NodeStatus,
    Pulse,
    RegisterAnswer,
    RegisterRequest,
    decode,
    encode,
    is_node_secret,
)

#: Seconds allowed for one ordinary call.
CALL_TIMEOUT_S: Final = 30.0
#: Longest ``x-ow-wait`` the protocol allows, in seconds (and the shortest).
WAIT_MIN_S: Final = 1
WAIT_MAX_S: Final = 15
#: Longest desk error message kept (it is logged).
_MESSAGE_CHARS = 200


class DeskClient:
    """One desk at ``pool_url`` (``https://host[:port]``, no trailing slash needed).

    ``transport`` replaces the network (tests); close with :meth:`aclose` or ``async with``.
    """

    def __init__(
        self,
        pool_url: str,
        *,
        timeout_s: float = CALL_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.pool_url = pool_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.pool_url,
            timeout=timeout_s,
            transport=transport,
            headers={"user-agent": f"berth-desk/{__version__}", "accept": "application/json"},
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> DeskClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def register(self, request: RegisterRequest) -> RegisterAnswer:
        """``POST /api/v1/node`` (no auth): the node's secret, code and price.

        Raises :class:`DeskProtocolError` when the secret is not a node secret.
        """
        response = await self._call("POST", "/api/v1/node", "registration", body=encode(request))
        answer = decode(response.content, RegisterAnswer, call="registration")
        if not is_node_secret(answer.secret):
            raise DeskProtocolError("registration", "the secret is not a node secret")
        return answer

    async def pulse(self, secret: str, pulse: Pulse) -> None:
        """``POST /api/v1/pulse``: one node's heartbeat."""
        await self._call("POST", "/api/v1/pulse", "pulse", secret=secret, body=encode(pulse))

    async def claim(self, secret: str, *, wait_s: int | None = None) -> ClaimedJob | None:
        """``POST /api/v1/jobs/claim`` (no body): a job, or ``None`` for ``204`` (no work).

        ``wait_s`` (1 to 15) asks the desk to hold the claim that long for a job
        (``x-ow-wait``); the protocol offers it to one-model hosts only.
        """
        headers = {}
        timeout_s = CALL_TIMEOUT_S
        if wait_s is not None:
            headers["x-ow-wait"] = str(wait_s)
            timeout_s += wait_s
        response = await self._call(
            "POST", "/api/v1/jobs/claim", "jobs/claim", secret=secret, headers=headers,
            timeout_s=timeout_s,
        )  # fmt: skip
        if response.status_code == 204:
            return None
        job = decode(response.content, ClaimedJob, call="jobs/claim")
        if not job.id:
            raise DeskProtocolError("jobs/claim", "a job without an id")
        return job

    async def finish(self, secret: str, finish: Finish) -> None:
        """``POST /api/v1/jobs/finish``: the answer and its token counts."""
        await self._call(
            "POST", "/api/v1/jobs/finish", "jobs/finish", secret=secret, body=encode(finish)
        )

    async def fail(self, secret: str, job_id: str) -> None:
        """``POST /api/v1/jobs/fail``."""
        body = encode(Fail(id=job_id))
        await self._call("POST", "/api/v1/jobs/fail", "jobs/fail", secret=secret, body=body)

    async def request_check(self, secret: str) -> None:
        """``POST /api/v1/node/check``: ask for a pool test."""
        await self._call("POST", "/api/v1/node/check", "node/check", secret=secret)

    async def check_result(self, secret: str) -> str:
        """``GET /api/v1/node/check``: the pool test's result, the JSON text as the desk
        wrote it (to be printed as is); :class:`DeskProtocolError` when it is not JSON."""
        response = await self._call("GET", "/api/v1/node/check", "node/check", secret=secret)
        try:
            msgspec.json.decode(response.content)
        except msgspec.DecodeError:
            raise DeskProtocolError("node/check", "not JSON") from None
        return response.text

    async def status(self, secret: str) -> NodeStatus:
        """``GET /api/v1/node/status``: the node's state, pool test and last contact."""
        response = await self._call("GET", "/api/v1/node/status", "node/status", secret=secret)
        return decode(response.content, NodeStatus, call="node/status")

    async def link(self, secret: str) -> LinkCode:
        """``POST /api/v1/node/link``: a one-time code linking the machine to an account."""
        response = await self._call("POST", "/api/v1/node/link", "node/link", secret=secret)
        return decode(response.content, LinkCode, call="node/link")

    async def _call(
        self,
        method: str,
        path: str,
        call: str,
        *,
        secret: str | None = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        sent = dict(headers or {})
        if secret is not None:
            sent["authorization"] = f"Bearer {secret}"
        if body is not None:
            sent["content-type"] = "application/json"
        try:
            response = await self._http.request(
                method,
                path,
                content=body,
                headers=sent,
                timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TimeoutException:
            raise DeskUnreachableError(self.pool_url, f"{call} timed out") from None
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            raise DeskUnreachableError(self.pool_url, f"{call}: {reason}") from None
        if not 200 <= response.status_code < 300:
            message = ""
            try:
                message = msgspec.json.decode(response.content, type=ErrorAnswer).message()
            except (msgspec.ValidationError, msgspec.DecodeError):
                message = ""
            raise DeskRefusedError(call, response.status_code, message[:_MESSAGE_CHARS])
        return response
