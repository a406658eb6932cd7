"""Why admission refused a request, as errors the HTTP edge answers in the OpenAI shape.

::

    AdmissionError            a request its key may not make now (key_id, error_code)
    ├── QuotaExceededError    429 rate_limit_error: a limit is spent; retry_after_s, headers
    ├── ModelNotAllowedError  403 permission_error: the key may not use this model
    ├── KeyPausedError        403 permission_error: a limit of 0, or a tier that is gone
    ├── KeyExpiredError       401 authentication_error: the key's expiry has passed
    └── QueueRefusedError     503 server_error: no slot for the request; retry_after_s
        ├── QueueFullError    the fair admission queue is full
        └── QueueTimeoutError no slot came free within the queue's timeout

``error_code`` names the limit (``rpm_exceeded``, ``tpm_exceeded``,
``max_concurrency_exceeded``, ``daily_tokens_exceeded``, ``monthly_tokens_exceeded``,
``body_bytes_exceeded``,
``model_not_allowed``, ``key_paused``, ``unknown_tier``, ``key_expired``, ``queue_full``,
``queue_timeout``); it becomes the
OpenAI error's ``code`` (:func:`berth.openai_errors.error_from_exception`).
"""

from __future__ import annotations

from collections.abc import Sequence

from berth.errors import BerthError

Header = tuple[bytes, bytes]


class AdmissionError(BerthError):
    """Base: the key ``key_id`` may not make this request (``error_code`` says why)."""

    error_code: str = "admission_refused"

    def __init__(self, message: str, *, key_id: str, error_code: str) -> None:
        self.key_id = key_id
        self.error_code = error_code
        super().__init__(message)


class QuotaExceededError(AdmissionError):
    """A limit is spent: retry after ``retry_after_s``; ``headers`` are the rate-limit
    headers to send with the refusal (:mod:`berth.admission.headers`)."""

    http_status = 429
    error_type = "rate_limit_error"

    def __init__(
        self,
        message: str,
        *,
        key_id: str,
        error_code: str,
        retry_after_s: float,
        headers: Sequence[Header] = (),
    ) -> None:
        self.retry_after_s = retry_after_s
        self.headers = tuple(headers)
        super().__init__(message, key_id=key_id, error_code=error_code)


class ModelNotAllowedError(AdmissionError):
    """The key's ``models`` limit leaves out the model asked for."""

    http_status = 403
    error_type = "permission_error"

    def __init__(self, message: str, *, key_id: str) -> None:
        self.param = "model"
        super().__init__(message, key_id=key_id, error_code="model_not_allowed")


class KeyPausedError(AdmissionError):
    """The key may make no request at all: a limit of 0, or its tier is no longer defined."""

    http_status = 403
    error_type = "permission_error"


class KeyExpiredError(AdmissionError):
    """The key's expiry has passed; it no longer authenticates."""

    http_status = 401
    error_type = "authentication_error"

    def __init__(self, message: str, *, key_id: str) -> None:
        super().__init__(message, key_id=key_id, error_code="key_expired")


class QueueRefusedError(AdmissionError):
    """Every slot of the request's deployments stayed taken (:mod:`berth.admission.gate`):
    a 503, the leader's capacity and not the key's limit, with ``Retry-After``
    (``retry_after_s``). The OpenAI SDKs retry a 503 after that wait."""

    http_status = 503
    error_type = "server_error"

    def __init__(self, message: str, *, key_id: str, error_code: str, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message, key_id=key_id, error_code=error_code)


class QueueFullError(QueueRefusedError):
    """The fair admission queue holds its most requests already."""

    def __init__(self, message: str, *, key_id: str, retry_after_s: float) -> None:
        super().__init__(
            message, key_id=key_id, error_code="queue_full", retry_after_s=retry_after_s
        )


class QueueTimeoutError(QueueRefusedError):
    """The request waited the queue's timeout without a slot coming free."""

    def __init__(self, message: str, *, key_id: str, retry_after_s: float) -> None:
        super().__init__(
            message, key_id=key_id, error_code="queue_timeout", retry_after_s=retry_after_s
        )
