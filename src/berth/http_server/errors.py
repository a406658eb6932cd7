"""The HTTP server's errors.

::

    BerthError
    └── HttpServerError             a request the listener refuses or cannot finish
        ├── HeadTooLargeError       431: the request head is over its size or line limit
        ├── RequestTimeoutError     408: the head or the body did not arrive in time
        ├── TooManyConnectionsError 429: the source address holds its cap of connections
        ├── ListenerFullError       503: the listener holds its cap of connections
        └── ClientDisconnectedError the client went away (raised to a reader or writer)

The first four are answered in the OpenAI error shape (:mod:`berth.openai_errors`), then
the connection is closed; the last never reaches a client.
"""

from __future__ import annotations

from berth.errors import BerthError


class HttpServerError(BerthError):
    """Base of the HTTP server's errors."""

    error_code: str | None = None


class MalformedRequestError(HttpServerError):
    """What arrived is not an HTTP/1.1 request the parser accepts (400)."""

    http_status = 400
    error_type = "invalid_request_error"
    error_code = "malformed_request"


class HeadTooLargeError(HttpServerError):
    """The request line and headers are over ``max_head_bytes`` or ``max_header_count``
    (RFC 6585 section 5: 431 Request Header Fields Too Large)."""

    http_status = 431
    error_type = "invalid_request_error"
    error_code = "request_header_fields_too_large"


class RequestTimeoutError(HttpServerError):
    """The request head, or the next piece of its body, did not arrive in time
    (RFC 9110 section 15.5.9: 408 Request Timeout)."""

    http_status = 408
    error_type = "invalid_request_error"
    error_code = "request_timeout"


class TooManyConnectionsError(HttpServerError):
    """The client's address already holds ``max_connections_per_address`` connections."""

    http_status = 429
    error_type = "rate_limit_error"
    error_code = "too_many_connections"
    retry_after_s = 1


class ListenerFullError(HttpServerError):
    """The listener already holds ``max_connections`` connections."""

    http_status = 503
    error_type = "server_error"
    error_code = "too_many_connections"
    retry_after_s = 1


class ClientDisconnectedError(HttpServerError):
    """The client closed the connection (or it was lost) before the exchange ended."""

    http_status = 499
    error_code = "client_disconnected"


class BindError(HttpServerError):
    """A listening socket could not be bound: ``name`` (the listener), ``host``, ``port``,
    ``reason`` in words (``address already in use``, else the OS's ``strerror``) and the
    ``OSError`` itself (``os_error``, for its ``errno``)."""

    def __init__(self, name: str, host: str, port: int, reason: str, os_error: OSError) -> None:
        self.os_error = os_error
        self.name = name
        self.host = host
        self.port = port
        self.reason = reason
        super().__init__(f"{name} listener {host}:{port}: {reason}")
