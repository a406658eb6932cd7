"""The errors a request meets before an engine answers it, which the OpenAI-compatible proxy
(:mod:`berth.gateway.proxy`) answers itself: raised by the proxy's request checks, by the
resolvers (no ready deployment) and by each attempt to reach an engine.

They live with routing because the resolver contract (:mod:`berth.routing.resolver`) and the
retry rules are stated in them. They are answered in the OpenAI shape (:mod:`berth.openai_errors`)::

    BerthError
    └── ProxyError                 carries error_code (the OpenAI "code" and the metrics reason)
        ├── InvalidRequestError    400 bad JSON / no model; 404 unknown URL; 405 wrong method
        ├── RequestTooLargeError   413 body over max_body_bytes
        ├── NoReadyDeploymentError 503 + Retry-After: the model exists, nothing serves it yet
        ├── EngineUnreachableError 502 its node could not be reached, or closed before
        │   │                          an answer
        │   ├── EngineUnavailableError 503 + Retry-After: an engine believed ready refused
        │   │                          or broke the connection, or ended, and no other
        │   │                          deployment could take the request
        │   └── AdapterUnavailableError 503 the LoRA adapter could not be loaded there
        └── EngineTimeoutError     504 the engine sent nothing for read_timeout_s
            └── FirstByteTimeoutError 504 a stream's first byte did not come in time

    BerthError
    └── EngineSignalError          an engine's cache signal (/slots, /metrics) could not be
                                   read or made sense of: the probe cycle logs it, no request
                                   sees it

An unknown model is the resolver's :class:`berth.errors.NotFoundError` (404).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from berth.errors import BerthError

if TYPE_CHECKING:
    from berth.routing.resolver import Upstream


#: Seconds a client is told to wait after an engine believed ready did not take its request
#: (its restart, or the next health probe, is about that far off).
ENGINE_GONE_RETRY_AFTER_S: Final = 2.0


class ProxyError(BerthError):
    """An error the proxy answers itself; ``error_code`` is the OpenAI ``code`` field."""

    error_code: str = "proxy_error"
    param: str | None = None


class InvalidRequestError(ProxyError):
    """The request cannot be relayed as sent: 400, or 404/405 for an unknown URL or method."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(
        self, message: str, *, code: str, param: str | None = None, status: int = 400
    ) -> None:
        self.http_status = status
        self.error_code = code
        self.param = param
        super().__init__(message)


class RequestTooLargeError(ProxyError):
    """The request body is over ``limit_bytes`` (413)."""

    http_status = 413
    error_type = "invalid_request_error"
    error_code = "request_too_large"

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        super().__init__(f"request body is larger than the limit of {limit_bytes} bytes")


class NoReadyDeploymentError(ProxyError):
    """``model`` is known but none of its deployments is ready (503 with ``Retry-After``).

    ``retry_after_s`` is the client's suggested wait in seconds, e.g. while an engine loads.
    """

    http_status = 503
    error_type = "server_error"
    error_code = "no_ready_deployment"

    def __init__(self, model: str, *, retry_after_s: float = 5.0, detail: str = "") -> None:
        self.model = model
        self.retry_after_s = retry_after_s
        message = f"model {model!r} has no ready deployment"
        super().__init__(f"{message}: {detail}" if detail else message)


class EngineUnreachableError(ProxyError):
    """The engine could not be reached or closed the exchange before answering (502).

    ``engine_side``: the engine itself did not take the request (it refused the connection,
    or broke it before answering) while its node answered: the deployment's own failure,
    not its node's (the dispatch loop tries a replica on the same node next)."""

    http_status = 502
    error_type = "engine_error"
    error_code = "engine_unreachable"

    def __init__(self, upstream: Upstream, why: str, *, engine_side: bool = False) -> None:
        self.upstream = upstream
        self.deployment_id = upstream.deployment_id
        self.why = why
        self.engine_side = engine_side
        super().__init__(f"the engine of deployment {upstream.deployment_id} {why}")


class EngineUnavailableError(EngineUnreachableError):
    """An engine berth believed ready did not take the request (it refused or broke the
    connection before answering, or ended while the request waited) and no other deployment
    could: 503 with ``Retry-After`` (``retry_after_s``), never a 502: the engine's end is
    berth's to deal with (its restart), not a fault the client should see as a bad gateway."""

    http_status = 503
    error_type = "server_error"
    error_code = "engine_unavailable"

    def __init__(
        self, upstream: Upstream, why: str, *, retry_after_s: float = ENGINE_GONE_RETRY_AFTER_S
    ) -> None:
        super().__init__(upstream, why, engine_side=True)
        self.retry_after_s = retry_after_s


class AdapterUnavailableError(EngineUnreachableError):
    """The deployment chosen for an adapter request could not take the adapter (its load
    failed, or every slot holds an adapter in use): retried elsewhere like an unreachable
    engine, answered 503 when it was the last try."""

    http_status = 503
    error_type = "server_error"
    error_code = "adapter_unavailable"


class EngineTimeoutError(ProxyError):
    """The engine sent nothing for the read timeout (504)."""

    http_status = 504
    error_type = "engine_error"
    error_code = "engine_timeout"

    def __init__(self, upstream: Upstream, timeout_s: float | None) -> None:
        self.upstream = upstream
        self.deployment_id = upstream.deployment_id
        super().__init__(
            f"the engine of deployment {upstream.deployment_id} sent nothing for {timeout_s} s"
        )


class FirstByteTimeoutError(EngineTimeoutError):
    """A streamed request's engine sent no first byte of its answer (its head, and the first
    bytes of its event stream) within the first-byte timeout (504 when no other deployment
    could take it). Its exchange was closed, so the engine stops working on it."""

    error_code = "first_byte_timeout"

    def __init__(self, upstream: Upstream, timeout_s: float) -> None:
        self.upstream = upstream
        self.deployment_id = upstream.deployment_id
        ProxyError.__init__(
            self,
            f"the engine of deployment {upstream.deployment_id} sent no first byte of its "
            f"answer within {timeout_s:g} s",
        )


class EngineSignalError(BerthError):
    """An engine's prefix cache signal (llama.cpp's ``/slots``, vLLM's or SGLang's
    ``/metrics``) could not be read or parsed; ``deployment_id`` (``""`` when parsing alone)
    and ``reason`` say which and why. The prefix policy then keeps its own estimate."""

    def __init__(self, reason: str, *, deployment_id: str = "") -> None:
        self.reason = reason
        self.deployment_id = deployment_id
        where = f"deployment {deployment_id}: " if deployment_id else ""
        super().__init__(f"{where}{reason}")
