"""``/v1`` values checked at the edge (issue 38): ``"stream"`` must be a boolean, numbers
beyond a double's range and lone surrogates are refused 400 before any stage sees them, and
every body berth writes again (the usage rewriter, the per-engine model and LoRA rewriter)
is JSON a strict reader takes. Parsed in process, and answered by the proxy on loopback in
front of the scripted stand-in engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from berth.gateway.attempt import engine_body
from berth.gateway.request import PublicRequest, parse_request
from berth.gateway.stages import ask_usage
from berth.routing.errors import InvalidRequestError
from support.standin_engine import StandinEngine

CHAT = "/v1/chat/completions"


def parsed(raw: bytes, path: str = CHAT) -> PublicRequest:
    return parse_request(
        raw, path=path, dialect="", query=b"", request_id=b"r", headers=[], forward=[]
    )


def strict_json(raw: bytes) -> Any:
    """``raw`` read as a strict JSON reader does: UTF-8 only, no NaN or infinities, no lone
    surrogate (a UTF-8 encoder refuses one)."""

    def refuse(name: str) -> Any:
        raise ValueError(name)

    value = json.loads(raw.decode("utf-8"), parse_constant=refuse)
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    return value


# -- stream --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ('"true"', "a string"),
        ("1", "a number"),
        ("0", "a number"),
        ("[]", "an array"),
        ("{}", "an object"),
    ],
)
def test_a_stream_that_is_not_a_boolean_is_refused(value: str, said: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parsed(b'{"model":"m","stream":%s}' % value.encode())
    error = refused.value
    assert (error.http_status, error.error_code, error.param) == (400, "invalid_type", "stream")
    assert str(error) == f"'stream' must be a boolean, not {said}"


@pytest.mark.parametrize(("value", "stream"), [("true", True), ("false", False), ("null", False)])
def test_a_boolean_or_null_stream_is_taken(value: str, stream: bool) -> None:
    assert parsed(b'{"model":"m","stream":%s}' % value.encode()).stream is stream


# -- numbers -------------------------------------------------------------------------------


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1" * 400 + ".0", "1.8e308"])
def test_a_number_beyond_a_doubles_range_is_refused(number: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parsed(b'{"model":"m","temperature":%s}' % number.encode())
    assert (refused.value.http_status, refused.value.error_code) == (400, "invalid_json")
    assert f"{number} is beyond the range of a double" in str(refused.value)


@pytest.mark.parametrize(
    ("number", "value"), [("1e-400", 0.0), ("1.7e308", 1.7e308), ("1" * 100, int("1" * 100))]
)
def test_numbers_within_range_are_taken(number: str, value: float) -> None:
    assert parsed(b'{"model":"m","x":%s}' % number.encode()).body["x"] == value


# -- surrogates ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "lone"),
    [
        (rb'"\ud800"', "\\ud800"),
        (rb'"\uDC00 tail"', "\\udc00"),
        (rb'"\udc00\ud800"', "\\udc00"),  # a pair the wrong way round
        (rb'"\ud83d\ud83d\ude00"', "\\ud83d"),  # one too many highs before a pair
    ],
)
def test_a_lone_surrogate_is_refused(text: bytes, lone: str) -> None:
    for raw in (
        b'{"model":"m","messages":[{"role":"user","content":%s}]}' % text,
        b'{"model":"m","metadata":{%s:1}}' % text,  # in a key
    ):
        with pytest.raises(InvalidRequestError) as refused:
            parsed(raw)
        assert (refused.value.http_status, refused.value.error_code) == (400, "invalid_json")
        assert f"lone surrogate {lone}" in str(refused.value)


def test_a_surrogates_bytes_in_the_text_are_not_utf8() -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parsed(b'{"model":"m","prompt":"\xed\xa0\x80"}')
    assert refused.value.error_code == "invalid_json"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        (rb'"\ud83d\ude00"', "\U0001f600"),  # an escaped pair, as json.dumps writes one
        (rb'"\\ud800"', "\\ud800"),  # an escaped backslash, then text
        ('"caf\u00e9 \U0001f600"'.encode(), "caf\u00e9 \U0001f600"),
    ],
)
def test_paired_surrogates_and_lookalikes_are_taken(text: bytes, value: str) -> None:
    assert parsed(b'{"model":"m","prompt":%s}' % text).body["prompt"] == value


# -- rewritten bodies stay JSON -----------------------------------------------------------

BODIES = [
    {"model": "m", "messages": [{"role": "user", "content": "caf\u00e9 \U0001f600 \u2028"}]},
    {"model": "m", "prompt": [1, 2, 10**30], "temperature": 1.7e308, "stream_options": None},
    {"model": "m", "stream_options": {"include_usage": False, "x": [1.5e-300]}},
]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("ascii_only", [True, False], ids=["ascii", "utf-8"])
def test_every_rewrite_writes_json_a_strict_reader_takes(
    body: dict[str, Any], ascii_only: bool
) -> None:
    raw = json.dumps({**body, "stream": True}, ensure_ascii=ascii_only).encode()
    request = parsed(raw)
    asked = ask_usage(request)
    assert asked.strip_usage
    assert strict_json(asked.raw) == asked.body
    assert asked.body["stream_options"]["include_usage"] is True
    renamed = engine_body(asked.body, "engine-name", (1.0, 0.0))
    assert strict_json(renamed) == {
        **asked.body,
        "model": "engine-name",
        "lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}],
    }


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32-le", "utf-8-sig"])
def test_a_body_in_another_encoding_reaches_engines_as_utf8(encoding: str) -> None:
    text = json.dumps({"model": "m", "stream": True, "prompt": "caf\u00e9"}, ensure_ascii=False)
    request = parsed(text.encode(encoding))
    assert request.raw == text.encode()
    assert request.received_bytes == len(text.encode(encoding))
    assert strict_json(ask_usage(request).raw)["stream_options"] == {"include_usage": True}


# -- through the proxy ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b'{"model":"m","stream":"true"}', "invalid_type", "stream"),
        (b'{"model":"m","stream":1}', "invalid_type", "stream"),
        (b'{"model":"m","temperature":1e400}', "invalid_json", None),
        (b'{"model":"m","stream":true,"prompt":"\\ud800"}', "invalid_json", None),
    ],
    ids=["stream string", "stream number", "1e400", "lone surrogate"],
)
async def test_the_proxy_answers_400_and_the_engine_never_sees_it(
    client: httpx.AsyncClient,
    engine: StandinEngine,
    body: bytes,
    code: str,
    param: str | None,
) -> None:
    answer = await client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert not engine.requests


# -- model and messages (the tester's empty conversation ran an engine for 600 s) ------------


@pytest.mark.parametrize(
    ("value", "said"),
    [("5", "a number"), ("1.5", "a number"), ("true", "a boolean"), ('["m"]', "an array")],
)
def test_a_model_that_is_not_a_string_is_refused_as_such(value: str, said: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parsed(b'{"model":%s,"messages":[{"role":"user","content":"hi"}]}' % value.encode())
    error = refused.value
    assert (error.http_status, error.error_code, error.param) == (400, "invalid_type", "model")
    assert str(error) == f"'model' must be a string (a model's name), not {said}"


@pytest.mark.parametrize("body", [b'{"messages":[]}', b'{"model":"","messages":[]}'])
def test_a_missing_model_still_says_so(body: bytes) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parsed(body)
    assert refused.value.error_code == "missing_model"


@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/v1/messages/count_tokens"])
def test_an_empty_conversation_is_refused(path: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parsed(b'{"model":"m","max_tokens":8,"messages":[]}', path)
    error = refused.value
    assert (error.http_status, error.error_code, error.param) == (400, "empty_array", "messages")
    assert "give at least one message" in str(error)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/responses"])
def test_messages_mean_nothing_on_other_paths(path: str) -> None:
    assert parsed(b'{"model":"m","messages":[]}', path).model == "m"


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b'{"model":"m","messages":[]}', "empty_array", "messages"),
        (b'{"model":5,"messages":[{"role":"user","content":"hi"}]}', "invalid_type", "model"),
    ],
    ids=["no messages", "model a number"],
)
async def test_the_proxy_refuses_a_bad_chat_before_the_engine(
    client: httpx.AsyncClient,
    engine: StandinEngine,
    body: bytes,
    code: str,
    param: str,
) -> None:
    answer = await client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert not engine.requests
