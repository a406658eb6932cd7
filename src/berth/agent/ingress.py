"""The agent's direct ingress: the leader's ``/v1`` requests to this host's engines without the
tunnel, when the leader can reach the agent (``docs/protocol.md``, Direct data path).

An agent started with ``--advertise HOST:PORT`` (setting ``agent_advertise``) binds the port
at start, on ``agent_ingress_bind`` (all addresses by default), says ``advertise`` in Hello
and lists ``op.ingress``. The leader answers with the ``ingress`` op: this node's ingress
certificate and the leader's client certificate, both checked here against the pinned berth
CA (:mod:`berth.cluster.pki.direct_tls`); only then does the ingress serve, over TLS that lets
in exactly that leader certificate. Each later ``ingress`` op (a new link, a renewal)
replaces the certificates for the handshakes that follow, without restarting the server:
answers streaming on connections made with the old ones go on.

What it serves:

- ``GET /healthz``: ``{"node_id", "exchanges"}`` (the leader's probe);
- ``POST /d/<deployment id>/v1/...``: one exchange with that deployment's engine, relayed by
  :meth:`berth.agent.relay.EngineRelay.relay_exchange`, the tunnel's relay, with the
  tunnel's bounds: a body of at most
  :data:`~berth.agent.relay.MAX_REQUEST_BODY_BYTES` (413), at most
  :data:`MAX_OPEN_EXCHANGES` at once (503), writes that wait for a slow leader, and a leader
  that goes away closing the engine connection. A failure before the engine's head is
  answered ``502`` with ``x-berth-reset: <reset code>`` (the codes of a tunnel stream's
  reset), so the leader treats it exactly as the same failure through the tunnel; one after
  the head cuts the connection off, as a tunneled answer is reset.

It runs on berth's own HTTP/1.1 server (:mod:`berth.http_server`) with the listeners'
bounds (``ListenerLimits``: head size and lines, head, idle and body timeouts, the TLS
handshake within the head timeout), except that it always admits the
:data:`~berth.cluster.protocol.direct.MAX_DIRECT_CONNECTIONS` connections the leader may
open: the leader is its only client (a connection is counted once its TLS handshake, which
only the leader's certificate completes, is done), so a per-address cap lower than that
would refuse the leader itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from berth.agent.relay import MAX_REQUEST_BODY_BYTES, AnswerSink
from berth.atomic import write_atomic
from berth.cluster.pki.direct_tls import (
    TrustRoots,
    check_ingress_certificate,
    check_leader_certificate,
    ingress_server_context,
)
from berth.cluster.protocol.direct import (
    GET_ENGINE_PATHS,
    HEALTH_PATH,
    MAX_DIRECT_CONNECTIONS,
    MAX_DIRECT_EXCHANGES,
    RESET_HEADER,
    parse_address,
    split_deployment_target,
)
from berth.cluster.protocol.frames import ResetCode
from berth.cluster.protocol.ops import IngressArgs
from berth.engine_http.request import EngineRequest
from berth.errors import ConfigError, NotFoundError
from berth.http_server.errors import BindError
from berth.http_server.limits import ListenerLimits
from berth.http_server.request import Request
from berth.http_server.server import HttpServer
from berth.http_server.sockets import bind_tcp
from berth.http_server.writer import ResponseWriter
from berth.openai_errors import error_body

log = logging.getLogger(__name__)

#: Exchanges relayed at once, as many as streams on one link (``LinkLimits.max_streams``).
MAX_OPEN_EXCHANGES: Final = MAX_DIRECT_EXCHANGES
#: Request headers that describe the leader's connection to the ingress, not the request.
_NOT_FORWARDED = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection",
                            b"keep-alive", b"te", b"trailer", b"upgrade", b"proxy-connection",
                            b"expect"})  # fmt: skip
_JSON = (b"content-type", b"application/json")

#: ``EngineRelay.relay_exchange``: (deployment, request, sink).
Relay = Callable[[str, EngineRequest, AnswerSink], Awaitable[None]]


def parse_advertise(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as host and port.

    Raises :class:`ConfigError` for anything else, or a port outside 1-65535.
    """
    address = parse_address(text)
    if address is None:
        raise ConfigError(f"advertise: expected HOST:PORT (e.g. 10.0.0.7:11502), got {text!r}")
    return address


class AgentIngress:
    """The ingress of node ``node_id``, advertised as ``advertise`` and bound on
    ``bind_host`` at the advertised port.

    ``key_path`` is the agent's key (the ingress certificate is for it), ``ca_certificate``
    the pinned berth CA (or every root of its bundle), ``cert_path`` where the ingress
    certificate is kept. ``relay`` serves each exchange; ``limits`` are the listeners' bounds
    (``Settings.listener_limits``), passed through :func:`ingress_limits`. Call :meth:`bind`
    at start, :meth:`close` at the end.
    """

    def __init__(
        self,
        *,
        node_id: str,
        advertise: str,
        bind_host: str,
        key_path: Path,
        cert_path: Path,
        ca_certificate: TrustRoots,
        relay: Relay,
        limits: ListenerLimits | None = None,
        max_open_exchanges: int = MAX_OPEN_EXCHANGES,
        max_body_bytes: int = MAX_REQUEST_BODY_BYTES,
    ) -> None:
        self._node_id = node_id
        self._advertise = advertise
        _, self._port = parse_advertise(advertise)
        self._bind_host = bind_host
        self._key_path = key_path
        self._cert_path = cert_path
        self._ca = ca_certificate
        self._relay = relay
        self._limits = ingress_limits(limits or ListenerLimits())
        self._max_open = max_open_exchanges
        self._max_body = max_body_bytes
        self._sock: socket.socket | None = None
        self._server: HttpServer | None = None
        self._configured: tuple[str, str] | None = None
        self._context: ssl.SSLContext | None = None
        self.open_exchanges = 0

    @property
    def advertise(self) -> str:
        return self._advertise

    @property
    def port(self) -> int:
        """The port the ingress listens on: the advertised one."""
        return self._port

    @property
    def serving(self) -> bool:
        """Whether it serves: the leader sent its certificates (``ingress`` op) and they
        passed their checks."""
        return self._server is not None

    def bind(self) -> None:
        """Bind the ingress's port now, so that one in use fails the agent's start.

        Raises :class:`ConfigError` naming the address and the reason.
        """
        self._sock = _bind(self._bind_host, self._port)

    async def configure(self, args: IngressArgs) -> None:
        """Serve with the certificates of an ``ingress`` op (the same ones again: keep
        serving). Raises :class:`berth.errors.AuthError` when one fails its check,
        :class:`ConfigError` when the certificate does not fit the agent's key or the port
        cannot be bound again."""
        certs = (args.certificate, args.leader_certificate)
        if certs == self._configured and self._server is not None:
            return
        check_ingress_certificate(args.certificate.encode(), self._ca, self._node_id)
        check_leader_certificate(args.leader_certificate.encode(), self._ca)
        await asyncio.to_thread(
            write_atomic, self._cert_path, args.certificate.encode(), mode=0o644
        )
        context = ingress_server_context(
            self._cert_path, self._key_path, args.leader_certificate.encode()
        )
        self._context = context
        self._configured = certs
        if self._server is not None:
            # Serving already: the next handshake takes the new certificates, and answers
            # streaming on connections made with the old ones go on.
            log.info("direct ingress on %s:%d: new certificates", self._bind_host, self._port)
            return
        sock, self._sock = self._sock, None
        if sock is None:
            sock = _bind(self._bind_host, self._port)
        # Each handshake is handed the newest context by the first one's SNI callback (it
        # runs on every ClientHello, with or without a server name).
        context.sni_callback = self._newest_context
        server = HttpServer("ingress", self.handle, self._limits, ssl_context=context)
        await server.start(sock)
        self._server = server
        log.info("direct ingress serving on %s:%d (advertised as %s)", self._bind_host,
                 self._port, self._advertise)  # fmt: skip

    def _newest_context(
        self, ssl_object: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None,
        context: ssl.SSLContext,
    ) -> None:  # fmt: skip
        if self._context is not None and self._context is not context:
            ssl_object.context = self._context

    async def close(self) -> None:
        """Stop serving and release the port."""
        if self._server is not None:
            await self._server.close(grace_s=1.0)
            self._server = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- one request -------------------------------------------------------------------------

    async def handle(self, request: Request, reply: ResponseWriter) -> None:
        """Answer one request (see the module docstring for the routes). An answer broken
        off after its head is left unended: the server then cuts the connection off."""
        path = request.raw_path
        if path == HEALTH_PATH and request.method in ("GET", "HEAD"):
            body = {"node_id": self._node_id, "exchanges": self.open_exchanges}
            await _answer(reply, 200, json.dumps(body).encode())
            return
        split = split_deployment_target(path)
        if split is None:
            await _error(reply, 404, "no such route on the agent's ingress", "not_found_error")
            return
        deployment, engine_path = split
        method = request.method.encode("ascii")
        if method != b"POST" and not (method == b"GET" and engine_path in GET_ENGINE_PATHS):
            message = f"{request.method} is not served here"
            await _error(reply, 405, message, "invalid_request_error")
            return
        if self.open_exchanges >= self._max_open:
            message = f"the ingress relays its limit of {self._max_open} exchanges"
            await _reset_answer(reply, ResetCode.REFUSED, message)
            return
        body_bytes = await request.read_body(self._max_body)
        if body_bytes is None:
            message = f"request body is larger than the limit of {self._max_body} bytes"
            await _error(reply, 413, message, "invalid_request_error", code="request_too_large")
            return
        headers = [(k, v) for k, v in request.headers if k not in _NOT_FORWARDED]
        exchange = EngineRequest(
            engine_path.decode("latin-1"), request.query, headers, body_bytes, method
        )
        sink = _ReplySink(reply)
        task = asyncio.current_task()
        if task is not None:
            # The leader left: cancelling the relay closes the engine connection.
            request.watch_disconnect(lambda: _cancel(task))
        self.open_exchanges += 1
        try:
            await self._relay(deployment, exchange, sink)
        except NotFoundError as exc:
            sink.reset(ResetCode.NOT_FOUND, str(exc))
        except Exception as exc:  # the leader must hear the exchange is over; the log says why
            log.exception("direct exchange for %s failed", deployment)
            sink.reset(ResetCode.INTERNAL, f"{type(exc).__name__}: {exc}"[:200])
        finally:
            self.open_exchanges -= 1
            request.watch_disconnect(None)
        if sink.reset_code is not None and not sink.started:
            await _reset_answer(reply, sink.reset_code, sink.reset_message)


def ingress_limits(limits: ListenerLimits) -> ListenerLimits:
    """``limits`` with room for every connection the leader may open
    (:data:`~berth.cluster.protocol.direct.MAX_DIRECT_CONNECTIONS`), in all and from its one
    address."""
    room = max(limits.max_connections, MAX_DIRECT_CONNECTIONS)
    return dataclasses.replace(limits, max_connections=room, max_connections_per_address=room)


class _ReplySink:
    """An :class:`~berth.agent.relay.AnswerSink` over one HTTP reply."""

    def __init__(self, reply: ResponseWriter) -> None:
        self._reply = reply
        self.started = False
        self.reset_code: ResetCode | None = None
        self.reset_message = ""

    async def send_head(
        self, status: int, headers: list[tuple[bytes, bytes]], payload: bytes, end: bool
    ) -> None:
        self.started = True
        await self._reply.start(status, headers)  # bytes from the engine, bytes to the leader
        if end:
            await self._reply.end(payload)
        elif payload:
            await self._reply.write(payload)

    async def write(self, data: bytes, end: bool = False) -> None:
        if end:
            await self._reply.end(data)
        else:
            await self._reply.write(data)

    def write_nowait(self, data: bytes, end: bool = False) -> bool:
        # The transport buffers it; backlogged says when to wait for the leader.
        if end:
            self._reply.end_now(data)
        else:
            self._reply.write_now(data)
        return True

    @property
    def backlogged(self) -> bool:
        return self._reply.write_paused

    async def drain(self) -> None:
        await self._reply.drain()

    def reset(self, code: ResetCode = ResetCode.CANCELLED, message: str = "") -> None:
        # Before the head, the handler answers with the code; after it, the answer is left
        # unended and the server cuts the connection off: the leader sees it break off.
        if self.reset_code is None:
            self.reset_code, self.reset_message = code, message


def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()


async def _answer(
    reply: ResponseWriter, status: int, body: bytes, *extra: tuple[bytes, bytes]
) -> None:
    await reply.start(status, [_JSON, (b"content-length", b"%d" % len(body)), *extra])
    await reply.end(body)


async def _error(
    reply: ResponseWriter, status: int, message: str, kind: str, *, code: str | None = None
) -> None:
    await _answer(reply, status, error_body(message, type=kind, code=code))


async def _reset_answer(reply: ResponseWriter, code: ResetCode, message: str) -> None:
    """A relay failure before the engine's head: 502 (503 when refused), ``x-berth-reset``."""
    status = 503 if code is ResetCode.REFUSED else 502
    body = error_body(message or code.value, type="server_error", code=code.value)
    await _answer(reply, status, body, (RESET_HEADER, code.value.encode()))


def _bind(host: str, port: int) -> socket.socket:
    try:
        return bind_tcp("direct ingress", host, port, backlog=1024)
    except BindError as exc:
        raise ConfigError(
            f"the direct ingress cannot listen on {exc.host}:{exc.port}: {exc.reason}"
        ) from None
