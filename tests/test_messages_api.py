"""Anthropic's Messages API through the proxy: the error converter, the usage of its answers
(streamed and not), the engine capability, and the Anthropic SDK as the client of the real
listener app (:class:`berth.daemon.app.LeaderApp`, its auth over a stand-in authenticator)
in front of the scripted stand-in engine: locally, through an agent's tunnel (the ``linked``
fixture) and over the direct path to an agent's ingress (``test_direct_path``'s leader)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import FastAPI

from berth.admission import Admission, ManualClock, UsageLedger
from berth.anthropic_errors import anthropic_body, is_messages_path, to_anthropic
from berth.config import TierTable
from berth.daemon.app import LeaderApp
from berth.errors import AuthError, BerthError, NotFoundError
from berth.gateway.proxy import OpenAIProxy
from berth.gateway.sse import Usage, messages_stream_usage, messages_usage
from berth.observability.metrics import ProxyMetrics
from berth.openai_errors import error_from_exception
from berth.routing.capability import serving
from berth.routing.errors import (
    InvalidRequestError,
    NoReadyDeploymentError,
    RequestTooLargeError,
)
from berth.routing.resolver import Upstream
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import ApiKeyRecord, UsageRecord
from support.direct import DEPLOYMENT as DIRECT_DEPLOYMENT
from support.direct import Pki
from support.link_pair import DEPLOYMENT, Linked, OneLink
from support.proxy_fixtures import running_proxy
from support.standin_engine import (
    StandinEngine,
    error_reply,
    json_reply,
    message,
    message_events,
    sse_reply,
)
from support.waiting import EVENT_TIMEOUT_S, wait_for_async
from test_direct_path import _leader as direct_leader

ASK: dict[str, Any] = {
    "model": "m",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}


# -- the error converter -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (InvalidRequestError("no model", code="missing_model"), 400, "invalid_request_error"),
        (AuthError("invalid API key"), 401, "authentication_error"),
        (AuthError("admin only", status=403), 403, "permission_error"),
        (NotFoundError("model", "x"), 404, "not_found_error"),
        (RequestTooLargeError(10), 413, "request_too_large"),
        (NoReadyDeploymentError("m", retry_after_s=5), 503, "overloaded_error"),
        (BerthError("plain"), 500, "api_error"),
    ],
)
def test_berths_errors_become_anthropic_errors_by_status(
    exc: BerthError, status: int, kind: str
) -> None:
    reply = error_from_exception(exc)
    converted = to_anthropic(reply)
    assert converted.status == status
    assert converted.headers == reply.headers  # Retry-After and the like stay
    assert json.loads(converted.body) == {
        "type": "error",
        "error": {"type": kind, "message": str(exc)},
    }


def test_an_engines_error_keeps_its_message_and_an_anthropic_one_stays_as_it_is() -> None:
    own = b'{"type":"error","error":{"type":"overloaded_error","message":"busy"}}'
    assert anthropic_body(own, 529) == own
    llama = b'{"error":{"code":400,"message":"bad messages","type":"invalid_request_error"}}'
    assert json.loads(anthropic_body(llama, 400))["error"] == {
        "type": "invalid_request_error",
        "message": "bad messages",
    }
    assert json.loads(anthropic_body(b"gateway down", 502))["error"] == {
        "type": "api_error",
        "message": "gateway down",
    }


def test_only_paths_under_v1_messages_speak_anthropic() -> None:
    assert is_messages_path("/v1/messages") and is_messages_path("/v1/messages/count_tokens")
    assert is_messages_path("/v1/messages/nope")
    assert not is_messages_path("/v1/messagesx") and not is_messages_path("/v1/chat/completions")


# -- usage ----------------------------------------------------------------------------------------


def test_a_messages_answer_counts_its_cached_input_among_the_prompt_tokens() -> None:
    body = json.dumps(message("hello", usage=(1, 8, 30))).encode()
    assert messages_usage(body) == Usage(prompt_tokens=31, completion_tokens=8, cached_tokens=30)
    written = b'{"usage":{"input_tokens":4,"cache_creation_input_tokens":6,"output_tokens":2}}'
    assert messages_usage(written) == Usage(prompt_tokens=10, completion_tokens=2)
    assert messages_usage(b'{"usage":{"output_tokens":2}}') is None  # no input: unknown
    assert messages_usage(b'{"content":[]}') is None


def test_a_messages_stream_takes_input_from_message_start_and_output_from_message_delta() -> None:
    events = message_events(["a", "b"], usage=(1, 4, 30))
    usage = None
    for event in events:  # event by event, as a stream comes
        usage = messages_stream_usage(event, usage)
    expected = Usage(prompt_tokens=31, completion_tokens=4, cached_tokens=30)
    assert usage == expected
    assert messages_stream_usage(b"".join(events), None) == expected  # all in one piece
    # A message_delta that repeats the input (vLLM, Anthropic's API) replaces it.
    repeated = b'event: message_delta\ndata: {"usage":{"input_tokens":40,"output_tokens":9}}\n\n'
    assert messages_stream_usage(repeated, expected) == Usage(40, 9)


# -- the capability of each engine kind ---------------------------------------------------------


def _upstream(deployment_id: str, engine: str | None) -> Upstream:
    return Upstream("http://127.0.0.1:1", deployment_id, "local", "m", engine=engine)


def test_only_engines_that_serve_the_path_are_kept_in_the_routers_order() -> None:
    plan = [_upstream("d-1", "sglang"), _upstream("d-2", "vllm"), _upstream("d-3", "llamacpp")]
    assert [u.deployment_id for u in serving(plan, "/v1/messages")] == ["d-2", "d-3"]
    assert [u.deployment_id for u in serving(plan, "/v1/messages/count_tokens")] == ["d-2", "d-3"]


def test_a_plan_with_no_engine_serving_the_path_is_refused_naming_why() -> None:
    plan = [_upstream("d-1", "sglang"), _upstream("adopted:ext", None)]
    with pytest.raises(InvalidRequestError) as raised:
        serving(plan, "/v1/messages/count_tokens")
    assert raised.value.http_status == 400 and raised.value.error_code == "path_not_served"
    assert str(raised.value) == (
        "adopted:ext's engine is not known to serve /v1/messages/count_tokens; "
        "deployment d-1's engine (sglang) does not serve /v1/messages/count_tokens; "
        "a token count is not translated to /v1/chat/completions, which counts none"
    )


# -- the Anthropic SDK against the listener app -------------------------------------------------

LIMITED = ApiKeyRecord(
    "k-limited",
    "limited",
    "standard",
    "sk-berth-lim",
    datetime(2025, 1, 1, tzinfo=UTC),
    None,
    LimitOverrides(rpm=2),
)
PLAIN = ApiKeyRecord(
    "k-plain", "plain", "standard", "sk-berth-pla", datetime(2025, 1, 1, tzinfo=UTC), None
)
SECRETS = {"sk-limited": LIMITED, "sk-plain": PLAIN}


class NoSink:
    def add_usage(self, batch: Iterable[UsageRecord]) -> int:
        return 0


class Authenticator:
    """The listener's authenticator over :data:`SECRETS` (a wrong secret: 401)."""

    def __init__(self) -> None:
        self.secrets: list[str | None] = []

    async def authenticate(
        self, secret: str | None, *, address: str | None, surface: str
    ) -> ApiKeyRecord:
        self.secrets.append(secret)
        record = SECRETS.get(secret or "")
        if record is None:
            raise AuthError("invalid API key")
        return record


class Engines:
    """A resolver over fixed upstreams for model ``m``."""

    def __init__(self, upstreams: Sequence[Upstream]) -> None:
        self.upstreams = list(upstreams)

    def candidates(self, model: str) -> list[Upstream]:
        if model != "m":
            raise NotFoundError("model", model)
        return list(self.upstreams)

    def models(self) -> list[str]:
        return ["m"]


def local(engine: StandinEngine, kind: str | None = "llamacpp", name: str = "d-1") -> Upstream:
    return Upstream(engine.base_url, name, "local", "m", engine=kind)


@contextlib.asynccontextmanager
async def leader(
    upstreams: Sequence[Upstream], *, trusted: bool = False, **options: Any
) -> AsyncIterator[tuple[str, Admission, list[OpenAIProxy]]]:
    """The proxy behind the real public :class:`LeaderApp` (authentication by
    :class:`Authenticator`; ``trusted``: the Unix socket's, no key); yields its URL, its
    admission and the proxy (in a list)."""
    admission = Admission(TierTable(), UsageLedger(NoSink()), clock=ManualClock())
    built: list[OpenAIProxy] = []

    def wrap(proxy: OpenAIProxy) -> Any:
        built.append(proxy)
        return LeaderApp(proxy, FastAPI(), Authenticator(), admission, None, trusted=trusted)

    resolver = Engines(upstreams)
    async with running_proxy(
        resolver, ProxyMetrics(), admission=admission, wrap=wrap, **options
    ) as url:
        yield url, admission, built


@contextlib.asynccontextmanager
async def sdk(url: str, key: str = "sk-plain") -> AsyncIterator[anthropic.AsyncAnthropic]:
    """The Anthropic SDK's client of ``url`` with ``key`` (no retries), closed after."""
    async with anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0) as client:
        yield client


#: The ``anthropic-version`` the SDK sends.
SDK_VERSION = anthropic.Anthropic(api_key="x").default_headers["anthropic-version"]


def ledger(admission: Admission) -> list[tuple[str, int, int, int, int, int]]:
    """(key, requests, errors, prompt, completion, estimated tokens) per ledger row."""
    return [
        (r.key_id, r.requests, r.errors, r.prompt_tokens, r.completion_tokens, r.estimated_tokens)
        for r in admission.ledger.pending
    ]


async def test_create_is_passed_through_with_its_version_and_counted_as_the_engine_said(
    engine: StandinEngine,
) -> None:
    engine.script(json_reply(message("hello there", usage=(5, 3, 2))))
    async with leader([local(engine)]) as (url, admission, (proxy,)), sdk(url) as client:
        answer = await client.messages.create(**ASK)
    assert answer.content[0].text == "hello there"  # type: ignore[union-attr]
    assert (answer.usage.input_tokens, answer.usage.cache_read_input_tokens) == (5, 2)
    sent = engine.requests[0]
    assert sent.path == "/v1/messages" and sent.json() == ASK
    # the SDK's version, passed through
    assert sent.headers["anthropic-version"] == SDK_VERSION
    assert "x-api-key" not in sent.headers  # a client's credentials never reach an engine
    assert ledger(admission) == [("k-plain", 1, 0, 7, 3, 0)]
    assert admission.ledger.pending[0].cached_tokens == 2  # berth usage's CACHED
    (entry,) = proxy.request_log.after()
    assert (entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens) == (7, 3, 2)


async def test_a_stream_is_relayed_event_by_event_and_its_usage_counted(
    engine: StandinEngine,
) -> None:
    engine.script(sse_reply(message_events(["Hel", "lo", "!"], usage=(1, 4, 30)), pause_s=0.01))
    async with (
        leader([local(engine)]) as (url, admission, _),
        sdk(url) as client,
        client.messages.stream(**ASK) as stream,
    ):
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "Hello!" == final.content[0].text  # type: ignore[union-attr]
    assert final.usage.output_tokens == 4
    assert ledger(admission) == [("k-plain", 1, 0, 31, 4, 0)]


async def test_count_tokens_is_passed_through_and_uses_no_tokens(engine: StandinEngine) -> None:
    engine.script(json_reply({"input_tokens": 12}))
    async with leader([local(engine)]) as (url, admission, _), sdk(url) as client:
        counted = await client.messages.count_tokens(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
    assert counted.input_tokens == 12
    assert engine.requests[0].path == "/v1/messages/count_tokens"
    assert ledger(admission) == [("k-plain", 1, 0, 0, 0, 0)]  # not estimated either


async def test_a_wrong_key_a_missing_model_and_a_keys_limit_raise_the_sdks_own_errors(
    engine: StandinEngine,
) -> None:
    engine.default = json_reply(message("ok"))
    async with (
        leader([local(engine)]) as (url, _, _),
        sdk(url, "sk-wrong") as wrong,
        sdk(url) as client,
        sdk(url, "sk-limited") as limited,
    ):
        with pytest.raises(anthropic.AuthenticationError) as bad_key:
            await wrong.messages.create(**ASK)
        with pytest.raises(anthropic.NotFoundError) as no_model:
            await client.messages.create(**{**ASK, "model": "nope"})
        await limited.messages.create(**ASK)
        await limited.messages.create(**ASK)
        with pytest.raises(anthropic.RateLimitError) as limit:
            await limited.messages.create(**ASK)
    assert bad_key.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }
    assert no_model.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert limit.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(limit.value.response.headers["retry-after"]) > 0
    assert int(limit.value.response.headers["retry-after-ms"]) > 0
    assert len(engine.requests) == 2  # the refused ones never reached it


async def test_an_engine_that_does_not_serve_it_is_skipped_or_a_token_count_refused(
    engine: StandinEngine,
) -> None:
    engine.default = json_reply(message("from llama"))
    async with StandinEngine() as sglang:
        both = [local(sglang, "sglang", "d-sg"), local(engine, "llamacpp", "d-ll")]
        async with leader(both) as (url, _, _), sdk(url) as client:
            for _ in range(3):  # passed through where it can be, not translated
                answer = await client.messages.create(**ASK)
                assert answer.content[0].text == "from llama"  # type: ignore[union-attr]
        only = [local(sglang, "sglang", "d-sg")]
        async with leader(only) as (url, admission, _), sdk(url) as client:
            with pytest.raises(anthropic.BadRequestError) as refused:
                await client.messages.count_tokens(model="m", messages=ASK["messages"])
        assert sglang.requests == []
    assert refused.value.body["error"] == {  # type: ignore[index]
        "type": "invalid_request_error",
        "message": "deployment d-sg's engine (sglang) does not serve /v1/messages/count_tokens; "
        "a token count is not translated to /v1/chat/completions, which counts none",
    }
    assert ledger(admission) == []  # refused before any engine: no ledger row


async def test_engine_errors_and_unknown_paths_are_anthropic_shaped_and_openai_paths_unchanged(
    engine: StandinEngine,
) -> None:
    engine.script(error_reply(400, "messages must be an array"))
    async with (
        leader([local(engine)]) as (url, _, _),
        httpx.AsyncClient(base_url=url) as http,
        sdk(url) as client,
    ):
        with pytest.raises(anthropic.BadRequestError) as relayed:
            await client.messages.create(**ASK)
        unknown = await http.post("/v1/messages/batches", headers={"x-api-key": "sk-plain"})
        # x-api-key authenticates the OpenAI paths too; their errors stay OpenAI-shaped.
        openai_shaped = await http.post(
            "/v1/chat/completions", headers={"x-api-key": "sk-plain"}, json={"model": "nope"}
        )
    assert relayed.value.body["error"] == {  # type: ignore[index]
        "type": "invalid_request_error",
        "message": "messages must be an array",
    }
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"
    assert openai_shaped.status_code == 404
    assert openai_shaped.json()["error"]["code"] == "model_not_found"


async def test_through_an_agents_tunnel(linked: Linked) -> None:
    linked.engine.script(sse_reply(message_events(["over ", "the link"], usage=(3, 2, 0))))
    tunneled = Upstream("", DEPLOYMENT, "n-1", "m", engine="vllm", remote=True)
    async with (
        leader([tunneled], tunnels=OneLink(linked)) as (url, admission, _),
        sdk(url) as client,
        client.messages.stream(**ASK) as stream,
    ):
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "over the link" == final.content[0].text  # type: ignore[union-attr]
    received = linked.engine.requests[0]
    assert received.path == "/v1/messages"
    assert received.headers["anthropic-version"] == SDK_VERSION
    assert ledger(admission) == [("k-plain", 1, 0, 3, 2, 0)]


async def test_over_the_direct_path_to_an_agent(pki: Pki) -> None:
    sides = direct_leader(pki)
    side = await anext(sides)
    try:
        await wait_for_async(lambda: side.path() == "direct", EVENT_TIMEOUT_S, "the direct path")
        side.side.engine.script(sse_reply(message_events(["went ", "direct"], usage=(4, 2, 1))))
        upstream = Upstream(
            "",
            DIRECT_DEPLOYMENT,
            side.node_id,
            "m",
            engine="llamacpp",
            remote=True,
        )
        async with (
            leader([upstream], tunnels=side.paths) as (url, admission, _),
            sdk(url) as client,
            client.messages.stream(**ASK) as stream,
        ):
            texts = [text async for text in stream.text_stream]
        assert "".join(texts) == "went direct"
        assert side.tunnel.opened == 0  # not through the tunnel
        received = side.side.engine.requests[0]
        assert received.path == "/v1/messages"
        assert received.headers["anthropic-version"] == SDK_VERSION
        assert ledger(admission) == [("k-plain", 1, 0, 5, 2, 0)]
    finally:
        await sides.aclose()


async def test_over_the_unix_sockets_listener_no_key_is_needed(engine: StandinEngine) -> None:
    engine.script(json_reply(message("for the CLI", usage=(2, 1, 0))))
    async with (
        leader([local(engine)], trusted=True) as (url, admission, _),
        sdk(url, "ignored") as client,
    ):
        answer = await client.messages.create(**ASK)
    assert answer.content[0].text == "for the CLI"  # type: ignore[union-attr]
    assert ledger(admission) == [("socket:cli", 1, 0, 2, 1, 0)]


async def test_a_stream_the_engine_breaks_off_ends_with_an_anthropic_error_event(
    engine: StandinEngine,
) -> None:
    events = message_events(["never ", "finished"])
    engine.script(sse_reply(events, die_after=3))
    async with (
        leader([local(engine)]) as (url, admission, _),
        sdk(url) as client,
        client.messages.stream(**ASK) as stream,
    ):
        with pytest.raises(anthropic.APIStatusError) as broken:
            async for _ in stream.text_stream:
                pass
    assert broken.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "the engine failed while streaming the answer"},
    }
    (row,) = ledger(admission)
    assert row[:3] == ("k-plain", 1, 1)  # one request, an error
