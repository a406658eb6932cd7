"""OpenAI-shaped error bodies and the mapping from berth errors."""

from __future__ import annotations

import json

import pytest

from berth.errors import AuthError, BerthError, ConflictError, NotFoundError
from berth.openai_errors import error_body, error_from_exception, stream_error_events
from berth.routing.errors import (
    EngineUnreachableError,
    InvalidRequestError,
    NoReadyDeploymentError,
    RequestTooLargeError,
)
from berth.routing.resolver import Upstream


def test_error_body_has_the_openai_shape() -> None:
    body = json.loads(error_body("bad thing", type="invalid_request_error", param="model"))
    assert body == {
        "error": {
            "message": "bad thing",
            "type": "invalid_request_error",
            "param": "model",
            "code": None,
        }
    }


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code", "param"),
    [
        (NotFoundError("model", "x"), 404, "invalid_request_error", "model_not_found", None),
        (ConflictError("busy"), 409, "invalid_request_error", None, None),
        (NotFoundError("API key", "k-1"), 404, "invalid_request_error", "api_key_not_found", None),
        (
            NotFoundError("registered desk model", "m"),
            404,
            "invalid_request_error",
            "registered_desk_model_not_found",
            None,
        ),
        (AuthError("no key"), 401, "authentication_error", None, None),
        (AuthError("admin only", status=403), 403, "permission_error", None, None),
        (BerthError("plain"), 500, "server_error", None, None),
        (
            InvalidRequestError("no model", code="missing_model", param="model"),
            400,
            "invalid_request_error",
            "missing_model",
            "model",
        ),
        (RequestTooLargeError(10), 413, "invalid_request_error", "request_too_large", None),
        (
            EngineUnreachableError(Upstream("http://h:1", "d-1", "local", "m"), "refused"),
            502,
            "engine_error",
            "engine_unreachable",
            None,
        ),
    ],
)
def test_berth_errors_keep_their_status_type_and_message(
    exc: BerthError, status: int, type_: str, code: str | None, param: str | None
) -> None:
    reply = error_from_exception(exc)
    assert reply.status == status
    error = json.loads(reply.body)["error"]
    assert error == {"message": str(exc), "type": type_, "param": param, "code": code}
    assert reply.headers == {}


@pytest.mark.parametrize(("retry_after_s", "header"), [(2.5, "3"), (5, "5"), (0.0, "0")])
def test_no_ready_deployment_is_503_with_retry_after_in_whole_seconds(
    retry_after_s: float, header: str
) -> None:
    status, body, headers = error_from_exception(
        NoReadyDeploymentError("m", retry_after_s=retry_after_s)
    )
    assert status == 503
    assert headers == {"Retry-After": header}
    assert json.loads(body)["error"]["code"] == "no_ready_deployment"


def test_an_unexpected_exception_is_a_500_that_hides_its_text() -> None:
    status, body, _ = error_from_exception(KeyError("secret internals"))
    assert status == 500
    assert b"secret" not in body
    assert json.loads(body)["error"]["type"] == "server_error"


def test_a_failed_stream_ends_with_an_error_event_then_done() -> None:
    data = stream_error_events("engine died", code="stream_aborted")
    first, second, rest = data.split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: "))["error"]["code"] == "stream_aborted"
    assert (second, rest) == (b"data: [DONE]", b"")
