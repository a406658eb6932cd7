"""The OpenAI proxy served by berth's HTTP server on loopback, in front of the scripted
stand-in engine: routing, headers, JSON answers, errors and /v1/models."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, MutableMapping

import httpx
import pytest

from berth.gateway.exchange import payload_of
from berth.gateway.proxy import OpenAIProxy
from berth.observability.metrics import ProxyMetrics
from berth.routing.errors import InvalidRequestError
from support.proxy_fixtures import StaticResolver, running_proxy, sample
from support.standin_engine import Head, Reply, Stall, StandinEngine, Write, error_reply, json_reply

M = {"model": "m", "deployment": "d-m", "node": "local"}


def error_of(response: httpx.Response) -> dict[str, object]:
    """The OpenAI error object of an answer, checking the envelope on the way."""
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
)
async def test_a_request_reaches_the_engine_unchanged_and_its_answer_comes_back_whole(
    client: httpx.AsyncClient, engine: StandinEngine, metrics: ProxyMetrics, path: str
) -> None:
    answer = {"id": "x", "usage": {"prompt_tokens": 7, "completion_tokens": 2}}
    engine.script(json_reply(answer))
    body = b'{"model": "m",  "messages": [{"role": "user", "content": "h\\u00e9 \xc3\xa9"}]}'
    response = await client.post(path, content=body, headers={"content-type": "application/json"})

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.content == json.dumps(answer).encode()
    seen = engine.requests[0]
    assert (seen.method, seen.path, seen.body) == ("POST", path, body)
    assert sample(metrics, "berth_proxy_requests_total", **M, status_class="2xx") == 1
    assert sample(metrics, "berth_proxy_prompt_tokens_total", **M) == 7
    assert sample(metrics, "berth_proxy_completion_tokens_total", **M) == 2


async def test_a_request_id_is_made_when_absent_and_shared_with_the_engine(
    client: httpx.AsyncClient, engine: StandinEngine
) -> None:
    response = await client.post("/v1/chat/completions", json={"model": "m"})
    request_id = response.headers["x-request-id"]
    assert len(request_id) == 32 and int(request_id, 16) >= 0
    assert engine.requests[0].headers["x-request-id"] == request_id


async def test_credentials_never_reach_the_engine_and_only_allowed_headers_do(
    client: httpx.AsyncClient, engine: StandinEngine
) -> None:
    sent = {
        "authorization": "Bearer sk-secret",
        "cookie": "session=secret",
        "x-api-key": "secret",
        "api-key": "secret",
        "x-custom": "nope",
        "accept": "application/json",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=1",
        "baggage": "user=alice",
        "x-request-id": "client-req-1",
    }
    response = await client.post("/v1/chat/completions", json={"model": "m"}, headers=sent)

    assert response.headers["x-request-id"] == "client-req-1"
    seen = engine.requests[0].headers
    for name in ("authorization", "cookie", "x-api-key", "api-key", "x-custom"):
        assert name not in seen
    assert "secret" not in json.dumps(seen)
    for name in ("accept", "traceparent", "tracestate", "baggage", "x-request-id"):
        assert seen[name] == sent[name]


async def test_an_unusable_client_request_id_is_replaced(
    client: httpx.AsyncClient, engine: StandinEngine
) -> None:
    response = await client.post(
        "/v1/chat/completions", json={"model": "m"}, headers={"x-request-id": "a b" * 100}
    )
    assert len(response.headers["x-request-id"]) == 32
    assert engine.requests[0].headers["x-request-id"] == response.headers["x-request-id"]


async def test_an_engine_cookie_is_neither_relayed_nor_replayed(
    client: httpx.AsyncClient, engine: StandinEngine
) -> None:
    body = b'{"ok": true}'
    cookie = (("Set-Cookie", "engine=1"),)
    engine.script(Reply((Head(200, "application/json", len(body), cookie), Write(body))))
    first = await client.post("/v1/chat/completions", json={"model": "m"})
    await client.post("/v1/chat/completions", json={"model": "m"})
    assert "set-cookie" not in first.headers
    assert "cookie" not in engine.requests[1].headers


async def test_an_unknown_model_is_404(client: httpx.AsyncClient, metrics: ProxyMetrics) -> None:
    response = await client.post("/v1/chat/completions", json={"model": "nope"})
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found"
    assert "x-request-id" in response.headers
    # The unknown name is not a label value: clients cannot mint series.
    labels = {"model": "", "deployment": "", "node": "", "status_class": "4xx"}
    assert sample(metrics, "berth_proxy_requests_total", **labels) == 1
    assert sample(metrics, "berth_proxy_errors_total", **labels, reason="model_not_found") == 1


async def test_a_model_with_no_ready_deployment_is_503_with_retry_after(
    client: httpx.AsyncClient, metrics: ProxyMetrics
) -> None:
    response = await client.post("/v1/chat/completions", json={"model": "warming"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "3"
    error = error_of(response)
    assert error["code"] == "no_ready_deployment"
    assert "warming" in str(error["message"])
    labels = {"model": "warming", "deployment": "", "node": "", "status_class": "5xx"}
    assert sample(metrics, "berth_proxy_errors_total", **labels, reason="no_ready_deployment") == 1


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b'{"model": "m",', "invalid_json", None),
        (b"\xff\xfe", "invalid_json", None),
        (b'["m"]', "invalid_json", None),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json", None),
        (b'{"model": "m", "temperature": NaN}', "invalid_json", None),
        (b'{"model": "m", "max_tokens": -Infinity}', "invalid_json", None),
        (b'{"messages": []}', "missing_model", "model"),
        (b'{"model": 3}', "invalid_type", "model"),  # not a string: said so
    ],
)
async def test_a_malformed_request_is_400(
    client: httpx.AsyncClient, engine: StandinEngine, body: bytes, code: str, param: str | None
) -> None:
    response = await client.post("/v1/chat/completions", content=body)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert engine.requests == []


def _stdlib_read(body: bytes) -> object:
    """What ``json.loads`` with NaN and the infinities refused makes of ``body``."""

    def refuse(name: str) -> object:
        raise ValueError(name)

    try:
        return json.loads(body, parse_constant=refuse)
    except (ValueError, RecursionError):
        return "refused"


@pytest.mark.parametrize(
    "body",
    [
        rb'{"model": "m", "n": 1.5e3, "s": "caf\u00e9 \ud83d\ude00"}',
        '{"model": "café"}'.encode("utf-16"),
        '{"model": "m"}'.encode("utf-32-le"),
        b"\xef\xbb\xbf" + b'{"model": "m"}',  # a UTF-8 BOM
        b'{"model": "m", "x": NaN}',
        b"\xff\xfe",
        b'{"model": "\xe9"}',  # not UTF-8
        b"[" * 100_000 + b"]" * 100_000,
        b'["m"]',
    ],
    ids=["utf-8", "utf-16", "utf-32", "bom", "nan", "bad bytes", "latin-1", "deep", "array"],
)
def test_a_request_body_is_read_as_the_standard_library_reads_it(body: bytes) -> None:
    expected = _stdlib_read(body)
    try:
        got: object = payload_of(body)
    except InvalidRequestError:
        got = "refused"
    if isinstance(expected, list):
        expected = "refused"  # not an object
    assert got == expected


async def raw_exchange(url: str, request: bytes) -> bytes:
    """Send raw bytes to the proxy; return everything it answers until it closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(-1), 2.0)
    writer.close()
    return answer


async def test_a_body_announced_over_the_limit_is_413_before_it_is_read(
    resolver: StaticResolver, metrics: ProxyMetrics, engine: StandinEngine
) -> None:
    async with running_proxy(resolver, metrics, max_body_bytes=1024) as url:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: 1025\r\nconnection: close\r\n\r\n"
        )
        # No body byte is sent: the answer must come from the Content-Length alone.
        answer = await raw_exchange(url, head)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 413 Request Entity Too Large"
    assert b'"code":"request_too_large"' in rest
    assert engine.requests == []


async def test_a_chunked_body_over_the_limit_is_413(
    resolver: StaticResolver, metrics: ProxyMetrics, engine: StandinEngine
) -> None:
    async with (
        running_proxy(resolver, metrics, max_body_bytes=1024) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):

        async def body() -> AsyncIterator[bytes]:
            yield b'{"model": "m", "prompt": "'
            for _ in range(10):
                yield b"x" * 200
            yield b'"}'

        response = await client.post("/v1/completions", content=body())
        assert response.status_code == 413
        assert error_of(response)["code"] == "request_too_large"
        assert engine.requests == []
        # The rest of the body was read and dropped: the connection serves the next request.
        again = await client.post("/v1/completions", json={"model": "m"})
        assert again.status_code == 200


async def test_a_body_at_the_limit_is_relayed(
    resolver: StaticResolver, metrics: ProxyMetrics, engine: StandinEngine
) -> None:
    body = b'{"model": "m", "prompt": "' + b"x" * 100 + b'"}'
    async with (
        running_proxy(resolver, metrics, max_body_bytes=len(body)) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        response = await client.post("/v1/completions", content=body)
    assert response.status_code == 200
    assert engine.requests[0].body == body


async def test_an_engine_that_refuses_the_connection_is_503_with_retry_after(
    metrics: ProxyMetrics,
) -> None:
    """Never a 502: an engine berth believes ready that refuses is berth's to deal with (a
    retry elsewhere, its restart), and the client is told when to come back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]  # nothing listens there once closed
    resolver = StaticResolver({"m": f"http://127.0.0.1:{dead_port}"})
    async with running_proxy(resolver, metrics) as url, httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/chat/completions", json={"model": "m"})
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    error = error_of(response)
    assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
    assert "refused the connection" in str(error["message"])
    assert str(dead_port) not in str(error["message"])
    errors = sample(
        metrics, "berth_proxy_errors_total", **M, status_class="5xx", reason="engine_unavailable"
    )
    assert errors == 1
    assert sample(metrics, "berth_proxy_in_flight_requests", **M) == 0


async def test_an_engine_silent_past_the_read_timeout_is_504(
    resolver: StaticResolver, metrics: ProxyMetrics, engine: StandinEngine
) -> None:
    engine.script(Reply((Stall(2.0), *json_reply({}).steps)))
    async with (
        running_proxy(resolver, metrics, read_timeout_s=0.2) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        response = await client.post("/v1/chat/completions", json={"model": "m"})
        assert response.status_code == 504
        assert error_of(response)["code"] == "engine_timeout"
        record = engine.requests[0]
        await asyncio.wait_for(record.disconnected.wait(), 1.0)


async def test_an_engine_4xx_keeps_its_status_and_body(
    client: httpx.AsyncClient, engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    reply = error_reply(400, "the prompt is 9000 tokens, over the context of 4096")
    engine.script(reply)
    response = await client.post("/v1/chat/completions", json={"model": "m"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "the prompt is 9000 tokens, over the context of 4096"
    )
    write = reply.steps[1]
    assert isinstance(write, Write) and response.content == write.data
    errors = sample(
        metrics, "berth_proxy_errors_total", **M, status_class="4xx", reason="engine_status"
    )
    assert errors == 1


@pytest.mark.parametrize(
    ("reply", "status", "message"),
    [
        (
            json_reply(
                {"object": "error", "message": "max_tokens too large", "type": "BadRequestError"},
                status=400,
            ),
            400,
            "max_tokens too large",
        ),
        (
            Reply((Head(500, "text/plain", 5), Write(b"boom!"))),
            500,
            "boom!",
        ),
    ],
)
async def test_an_engine_error_in_another_shape_is_reshaped_keeping_its_message(
    client: httpx.AsyncClient, engine: StandinEngine, reply: Reply, status: int, message: str
) -> None:
    engine.script(reply)
    response = await client.post("/v1/chat/completions", json={"model": "m"})
    assert response.status_code == status
    error = error_of(response)
    assert (error["message"], error["code"]) == (message, "engine_error")


async def test_models_are_listed_in_the_openai_shape(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["m", "org/model:q4", "warming"]
    for card in body["data"]:
        assert card["object"] == "model" and card["owned_by"] == "berth"
        assert isinstance(card["created"], int)


@pytest.mark.parametrize("ident", ["m", "org/model:q4", "org%2Fmodel:q4"])
async def test_one_model_is_found_even_with_slashes_and_colons(
    client: httpx.AsyncClient, ident: str
) -> None:
    response = await client.get(f"/v1/models/{ident}")
    assert response.status_code == 200
    assert response.json()["id"] == ident.replace("%2F", "/")


async def test_an_unknown_model_id_is_404(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/models/org/other")
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found"


async def test_an_unknown_path_is_404_and_a_wrong_method_405(client: httpx.AsyncClient) -> None:
    unknown = await client.post("/v1/images/generations", json={"model": "m"})
    assert unknown.status_code == 404
    assert error_of(unknown)["code"] == "unknown_url"
    wrong = await client.get("/v1/chat/completions")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert error_of(wrong)["code"] == "method_not_allowed"


async def test_timings_are_recorded(client: httpx.AsyncClient, metrics: ProxyMetrics) -> None:
    await client.post("/v1/chat/completions", json={"model": "m"})
    labels = {**M, "status_class": "2xx"}
    assert sample(metrics, "berth_proxy_request_duration_seconds_count", **labels) == 1
    assert sample(metrics, "berth_proxy_time_to_first_byte_seconds_count", **labels) == 1
    assert 0 < sample(metrics, "berth_proxy_request_duration_seconds_sum", **labels) < 1
    assert sample(metrics, "berth_proxy_in_flight_requests", **M) == 0


async def test_served_directly_the_lifespan_protocol_opens_and_closes_the_client(
    resolver: StaticResolver, metrics: ProxyMetrics
) -> None:
    proxy = OpenAIProxy(resolver, metrics)
    inbox: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    sent: list[str] = []
    for kind in ("lifespan.startup", "lifespan.shutdown"):
        inbox.put_nowait({"type": kind})

    async def send(message: MutableMapping[str, object]) -> None:
        sent.append(str(message["type"]))

    await proxy({"type": "lifespan"}, inbox.get, send)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
