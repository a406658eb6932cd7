"""Anthropic's Messages API translated to chat completions for an engine without
``/v1/messages``: the Anthropic SDK as the client of the real listener app, the stand-in
engine playing an OpenAI-only endpoint (an adopted one, or SGLang), locally and through an
agent's tunnel. What the engine receives, what the SDK reads (``messages.create``,
``messages.stream``, a tool-use round trip, its own error classes) and what the usage
ledger and request log count."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest

from berth.routing.resolver import Upstream
from support.direct import DEPLOYMENT as DIRECT_DEPLOYMENT
from support.direct import Pki
from support.link_pair import DEPLOYMENT, Linked, OneLink
from support.standin_engine import (
    Head,
    Reply,
    StandinEngine,
    Write,
    chat_chunks,
    chat_completion,
    error_reply,
    json_reply,
    sse_reply,
)
from support.waiting import EVENT_TIMEOUT_S, wait_for_async
from test_direct_path import _leader as direct_leader
from test_messages_api import ASK, leader, ledger, local, sdk

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def adopted(engine: StandinEngine) -> Upstream:
    """An adopted endpoint of model ``m``: its engine's kind is not known."""
    return local(engine, None, "adopted:ext")


def tool_call_answer(text: str, arguments: str) -> dict[str, Any]:
    """A chat completion that calls ``get_weather`` with ``arguments`` after ``text``."""
    answer = chat_completion(text, usage=(40, 9))
    choice = answer["choices"][0]
    choice["finish_reason"] = "tool_calls"
    call = {"name": "get_weather", "arguments": arguments}
    choice["message"]["tool_calls"] = [{"id": "call_7", "type": "function", "function": call}]
    return answer


async def test_create_is_translated_and_counted_with_the_engines_cached_tokens(
    engine: StandinEngine,
) -> None:
    answer = chat_completion("hello from chat", usage=(12, 4))
    answer["usage"]["prompt_tokens_details"] = {"cached_tokens": 10}
    engine.script(json_reply(answer))
    async with leader([adopted(engine)]) as (url, admission, (proxy,)), sdk(url) as client:
        message = await client.messages.create(
            **ASK, system="be brief", stop_sequences=["END"], metadata={"user_id": "u"}
        )
    assert message.content[0].text == "hello from chat"  # type: ignore[union-attr]
    assert (message.model, message.stop_reason, message.role) == ("m", "end_turn", "assistant")
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (2, 10, 4)
    (sent,) = engine.requests
    assert sent.path == "/v1/chat/completions"
    assert sent.json() == {
        "model": "m",
        "max_tokens": 16,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ],
        "stop": ["END"],
    }
    assert ledger(admission) == [("k-plain", 1, 0, 12, 4, 0)]
    assert admission.ledger.pending[0].cached_tokens == 10  # berth usage's CACHED
    (entry,) = proxy.request_log.after()
    assert (entry.prompt_tokens, entry.completion_tokens, entry.cached_tokens) == (12, 4, 10)


async def test_a_stream_is_translated_event_by_event_and_its_deltas_make_the_final_message(
    engine: StandinEngine,
) -> None:
    engine.script(sse_reply(chat_chunks(["one two three four"], usage=(21, 6)), pause_s=0.01))
    async with (
        leader([local(engine, "sglang", "d-sg")]) as (url, admission, _),
        sdk(url) as client,
        client.messages.stream(**ASK) as stream,
    ):
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(texts) == 4  # one delta per chunk the engine sent
    assert "".join(texts) == "one two three four" == final.content[0].text  # type: ignore[union-attr]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (21, 6)
    assert final.stop_reason == "end_turn"
    sent = engine.requests[0].json()
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert ledger(admission) == [("k-plain", 1, 0, 21, 6, 0)]


async def test_a_tool_use_round_trip_through_the_translation(engine: StandinEngine) -> None:
    engine.script(
        json_reply(tool_call_answer("Let me check.", '{"city": "Paris"}')),
        json_reply(chat_completion("It is 18 C in Paris.", usage=(60, 8))),
    )
    ask: dict[str, Any] = {
        **ASK,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "auto"},
    }
    async with leader([adopted(engine)]) as (url, admission, _), sdk(url) as client:
        first = await client.messages.create(**ask)
        assert first.stop_reason == "tool_use"
        text, call = first.content
        assert text.type == "text" and text.text == "Let me check."
        assert call.type == "tool_use"
        assert (call.id, call.name, call.input) == ("call_7", "get_weather", {"city": "Paris"})
        history = [
            *ask["messages"],
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}],
            },
        ]
        second = await client.messages.create(**{**ask, "messages": history})
    assert second.content[0].text == "It is 18 C in Paris."  # type: ignore[union-attr]
    assert second.stop_reason == "end_turn"
    asked = engine.requests[0].json()
    assert asked["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "The weather in a city",
            },
        }
    ]
    assert asked["tool_choice"] == "auto"
    answered = engine.requests[1].json()["messages"]
    assert answered[1:] == [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "18 C"},
    ]
    assert ledger(admission) == [("k-plain", 2, 0, 100, 17, 0)]


async def test_a_streamed_tool_call_arrives_as_a_tool_use_block(engine: StandinEngine) -> None:
    engine.script(sse_reply(chat_chunks(["Checking now"], tool_call=True, usage=(30, 7))))
    async with (
        leader([adopted(engine)]) as (url, _, _),
        sdk(url) as client,
        client.messages.stream(**ASK, tools=[WEATHER]) as stream,  # type: ignore[list-item]
    ):
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "Checking now"
    text, call = final.content
    assert text.type == "text" and text.text == "Checking now"
    assert call.type == "tool_use"
    assert (call.id, call.name, call.input) == ("call_1", "get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use"


async def test_what_is_not_translated_is_refused_before_any_engine(engine: StandinEngine) -> None:
    async with leader([adopted(engine)]) as (url, admission, _), sdk(url) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(**ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    assert refused.value.status_code == 400
    assert refused.value.body == {  # type: ignore[comparison-overlap]
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "extended thinking is not supported: this model's engine has no "
            "/v1/messages, and berth's translation to /v1/chat/completions does not carry it",
        },
    }
    assert engine.requests == []
    assert ledger(admission) == []


async def test_the_sdks_own_errors_on_the_translation_path(engine: StandinEngine) -> None:
    engine.default = json_reply(chat_completion("ok"))
    engine.script(error_reply(500, "the engine fell over", type="server_error"))
    async with (
        leader([adopted(engine)]) as (url, _, _),
        sdk(url, "sk-wrong") as wrong,
        sdk(url) as client,
        sdk(url, "sk-limited") as limited,
    ):
        with pytest.raises(anthropic.InternalServerError) as failed:
            await client.messages.create(**ASK)
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(**ASK)
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(**{**ASK, "model": "nope"})
        await limited.messages.create(**ASK)
        await limited.messages.create(**ASK)
        with pytest.raises(anthropic.RateLimitError) as limit:
            await limited.messages.create(**ASK)
    assert failed.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "the engine fell over"},
    }
    assert int(limit.value.response.headers["retry-after"]) > 0
    assert len(engine.requests) == 3  # the failed one and the two the limit let through


async def test_an_answer_that_is_not_a_chat_completion_is_a_502(engine: StandinEngine) -> None:
    engine.script(json_reply({"object": "list", "data": []}))
    async with leader([adopted(engine)]) as (url, _, _), sdk(url) as client:
        with pytest.raises(anthropic.APIStatusError) as failed:
            await client.messages.create(**ASK)
    assert failed.value.status_code == 502
    assert failed.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "cannot translate" in failed.value.body["error"]["message"]  # type: ignore[index]


async def test_a_translated_stream_through_an_agents_tunnel(linked: Linked) -> None:
    linked.engine.script(sse_reply(chat_chunks(["over the link"], usage=(8, 3))))
    tunneled = Upstream("", DEPLOYMENT, "n-1", "m", engine="sglang", remote=True)
    async with (
        leader([tunneled], tunnels=OneLink(linked)) as (url, admission, _),
        sdk(url) as client,
        client.messages.stream(**ASK) as stream,
    ):
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "over the link" == final.content[0].text  # type: ignore[union-attr]
    received = linked.engine.requests[0]
    assert received.path == "/v1/chat/completions"
    assert json.loads(received.body)["messages"] == [{"role": "user", "content": "hi"}]
    assert ledger(admission) == [("k-plain", 1, 0, 8, 3, 0)]


async def test_an_untranslatable_answer_through_an_agents_tunnel_is_a_502(
    linked: Linked,
) -> None:
    """A remote engine's answer berth cannot translate is the same 502 as a local one's (the
    error names the node: a remote engine has no address the leader connects to)."""
    linked.engine.script(json_reply({"object": "list", "data": []}))
    tunneled = Upstream("", DEPLOYMENT, "n-1", "m", engine="sglang", remote=True)
    async with (
        leader([tunneled], tunnels=OneLink(linked)) as (url, _, _),
        sdk(url) as client,
    ):
        with pytest.raises(anthropic.APIStatusError) as failed:
            await client.messages.create(**ASK)
    assert failed.value.status_code == 502
    assert "cannot translate" in failed.value.body["error"]["message"]  # type: ignore[index]


async def test_a_translated_stream_the_engine_breaks_off_ends_with_an_anthropic_error(
    engine: StandinEngine,
) -> None:
    engine.script(sse_reply(chat_chunks(["never quite finished"]), die_after=3))
    async with (
        leader([adopted(engine)]) as (url, admission, _),
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
    assert row[:3] == ("k-plain", 1, 1)


async def test_an_answer_of_unannounced_length_is_translated_too(engine: StandinEngine) -> None:
    body = json.dumps(chat_completion("chunked " * 50, usage=(9, 100))).encode()
    engine.script(Reply((Head(200, "application/json"), Write(body[:40]), Write(body[40:]))))
    async with leader([adopted(engine)]) as (url, admission, _), sdk(url) as client:
        message = await client.messages.create(**ASK)
    assert message.content[0].text == "chunked " * 50  # type: ignore[union-attr]
    assert ledger(admission) == [("k-plain", 1, 0, 9, 100, 0)]


async def test_a_translated_stream_over_the_direct_path_to_an_agent(pki: Pki) -> None:
    sides = direct_leader(pki)
    side = await anext(sides)
    try:
        await wait_for_async(lambda: side.path() == "direct", EVENT_TIMEOUT_S, "the direct path")
        side.side.engine.script(sse_reply(chat_chunks(["went direct"], usage=(6, 2))))
        upstream = Upstream(
            "",
            DIRECT_DEPLOYMENT,
            side.node_id,
            "m",
            engine="sglang",
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
        assert side.side.engine.requests[0].path == "/v1/chat/completions"
        assert ledger(admission) == [("k-plain", 1, 0, 6, 2, 0)]
    finally:
        await sides.aclose()  # type: ignore[attr-defined]
