"""The translation of Anthropic's Messages API to and from OpenAI's chat completions, pure:
requests field by field (what is carried, what is ignored, what is refused), answers
(content, stop reasons, usage with cached tokens) and the stream's state machine; and the
answer wrappers over an engine's answer cut in any pieces."""

from __future__ import annotations

import json
from typing import Any

import pytest

from berth.engine_http.errors import UpstreamProtocolError
from berth.gateway.anthropic_answer import (
    AnswerNotTranslatableError,
    stop_reason,
    translate_answer,
    usage_counts,
)
from berth.gateway.anthropic_chat import Translated, translate_request
from berth.gateway.anthropic_stream import ChatToMessagesStream
from berth.gateway.messages_bridge import TranslatedAnswer, TranslatedStream
from berth.routing.errors import InvalidRequestError
from berth.routing.resolver import Upstream
from support.standin_engine import chat_chunks, chat_completion

BASE: dict[str, Any] = {
    "model": "m",
    "max_tokens": 32,
    "messages": [{"role": "user", "content": "hi"}],
}

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}


def chat(payload: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request ``payload`` (a Messages request) translates to."""
    parsed: dict[str, Any] = json.loads(translate_request(payload).body)
    return parsed


# -- requests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, {"messages": [{"role": "user", "content": "hi"}]}),
        (
            {"system": "be brief"},
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                ]
            },
        ),
        (
            {
                "system": [
                    {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "be kind"},
                ]
            },
            {
                "messages": [
                    {"role": "system", "content": "be brief\nbe kind"},
                    {"role": "user", "content": "hi"},
                ]
            },
        ),
        ({"stop_sequences": ["END", "##"]}, {"stop": ["END", "##"]}),
        (
            {"temperature": 0.2, "top_p": 0.9, "top_k": 40},
            {"temperature": 0.2, "top_p": 0.9, "top_k": 40},
        ),
        ({"metadata": {"user_id": "u-1"}, "service_tier": "auto"}, {}),  # ignored
        ({"thinking": {"type": "disabled"}}, {}),
        ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}),
        (
            {"tools": [WEATHER_TOOL]},
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "parameters": WEATHER_TOOL["input_schema"],
                            "description": "The weather in a city",
                        },
                    }
                ]
            },
        ),
        ({"tool_choice": {"type": "auto"}}, {"tool_choice": "auto"}),
        ({"tool_choice": {"type": "any"}}, {"tool_choice": "required"}),
        ({"tool_choice": {"type": "none"}}, {"tool_choice": "none"}),
        (
            {
                "tool_choice": {
                    "type": "tool",
                    "name": "get_weather",
                    "disable_parallel_tool_use": True,
                }
            },
            {
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "parallel_tool_calls": False,
            },
        ),
    ],
    ids=[
        "plain",
        "system-string",
        "system-blocks",
        "stop-sequences",
        "sampling",
        "metadata-ignored",
        "thinking-disabled",
        "stream",
        "tools",
        "choice-auto",
        "choice-any",
        "choice-none",
        "choice-tool",
    ],
)
def test_a_request_is_translated_field_by_field(
    extra: dict[str, Any], expected: dict[str, Any]
) -> None:
    translated = chat({**BASE, **extra})
    assert translated == {"model": "m", "max_tokens": 32, "messages": BASE["messages"], **expected}


def test_blocks_become_parts_and_a_tool_round_trip_becomes_tool_calls_and_tool_messages() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is here, and the weather?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                },
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},  # an earlier turn's
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {
                    "type": "tool_use",
                    "id": "call_2",
                    "name": "get_weather",
                    "input": {"city": "Oslo"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "here you go"},
                {"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "call_2",
                    "content": [{"type": "text", "text": "no such city"}],
                    "is_error": True,
                },
            ],
        },
    ]
    assert chat({**BASE, "messages": messages})["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is here, and the weather?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                },
            ],
        },
        # tool messages right after the assistant's calls, the rest of the turn after them
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Error: no such city"},
        {"role": "user", "content": "here you go"},
    ]


def test_an_assistant_turn_of_tool_calls_alone_has_no_text() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "c", "name": "w", "input": {}}],
        },
    ]
    (_, assistant) = chat({**BASE, "messages": messages})["messages"]
    assert (
        assistant["content"] is None and assistant["tool_calls"][0]["function"]["arguments"] == "{}"
    )


def test_the_translation_remembers_the_clients_model_and_stop_sequences() -> None:
    translated = translate_request({**BASE, "stop_sequences": ["END"], "stream": True})
    assert (translated.model, translated.stop_sequences, translated.streamed) == (
        "m",
        ("END",),
        True,
    )


DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}


@pytest.mark.parametrize(
    ("extra", "param", "what"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "extended thinking"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools.0.type",
            "the server tool 'web_search_20250305'",
        ),
        (
            {"tools": [{**WEATHER_TOOL, "defer_loading": True}]},
            "tools.0.defer_loading",
            "the tool field 'defer_loading'",
        ),
        (
            {"messages": [{"role": "user", "content": [DOCUMENT]}]},
            "messages.0.content.0",
            "a 'document' content block",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ]
            },
            "messages.0.content.0.source",
            "an image from a 'file' source",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "c",
                                "content": [{"type": "image", "source": {}}],
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.content.0",
            "a 'image' block in a tool_result",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": [{"type": "server_tool_use", "id": "s", "name": "web_search"}],
                    },
                ]
            },
            "messages.1.content.0",
            "a 'server_tool_use' block in an assistant turn",
        ),
        ({"system": [DOCUMENT]}, "system.0", "a 'document' block in the system prompt"),
        ({"mcp_servers": []}, "mcp_servers", "the request field 'mcp_servers'"),
        ({"container": "c-1"}, "container", "the request field 'container'"),
    ],
)
def test_what_is_not_translated_is_refused_naming_where(
    extra: dict[str, Any], param: str, what: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        translate_request({**BASE, **extra})
    error = refused.value
    assert (error.http_status, error.error_code, error.param) == (400, "not_translated", param)
    assert str(error).startswith(
        f"{what} is not supported: this model's engine has no /v1/messages"
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            "messages.0.content.0",
        ),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"tools": [{"name": "no schema"}]}, "tools.0"),
    ],
)
def test_a_malformed_request_is_refused_as_invalid(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        translate_request({**BASE, **extra})
    assert (refused.value.error_code, refused.value.param) == ("invalid_request", param)


# -- answers --------------------------------------------------------------------------------

TRANSLATED = Translated(b"{}", {}, "public-name", ("END",))


def message_of(answer: dict[str, Any], translated: Translated = TRANSLATED) -> dict[str, Any]:
    data = json.dumps(answer).encode()
    parsed: dict[str, Any] = json.loads(translate_answer(data, translated, fallback_id="r-1"))
    return parsed


def test_a_chat_completion_becomes_a_message_with_the_clients_model_and_anthropics_usage() -> None:
    answer = chat_completion("hello there", usage=(12, 3))
    answer["usage"]["prompt_tokens_details"] = {"cached_tokens": 8}
    assert message_of(answer) == {
        "id": "msg_chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "model": "public-name",
        "content": [{"type": "text", "text": "hello there"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 4,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 8,
            "output_tokens": 3,
        },
    }


def test_tool_calls_become_tool_use_blocks_after_the_text() -> None:
    answer = chat_completion("Checking.")
    answer["choices"][0]["finish_reason"] = "tool_calls"
    answer["choices"][0]["message"]["tool_calls"] = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "w", "arguments": '{"city":"Paris"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "w", "arguments": "not json"}},
    ]
    message = message_of(answer)
    assert message["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "w", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "w", "input": {}},
    ]
    assert message["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("finish", "matched", "called", "expected"),
    [
        ("stop", None, False, ("end_turn", None)),
        ("length", None, False, ("max_tokens", None)),
        ("tool_calls", None, True, ("tool_use", None)),
        ("stop", None, True, ("tool_use", None)),  # some engines say "stop" after calls
        ("length", None, True, ("max_tokens", None)),
        ("content_filter", None, False, ("refusal", None)),
        ("stop", "END", False, ("stop_sequence", "END")),  # vLLM names the stop string
        ("stop", "other", False, ("end_turn", None)),
        ("stop", 2, False, ("end_turn", None)),  # vLLM: an EOS token id
        (None, None, False, ("end_turn", None)),
    ],
)
def test_finish_reasons_become_stop_reasons(
    finish: str | None, matched: object, called: bool, expected: tuple[str, str | None]
) -> None:
    assert stop_reason(finish, matched, ["END"], called_tools=called) == expected


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (
            {"prompt_tokens": 10, "completion_tokens": 2},
            {
                "input_tokens": 10,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 2,
            },
        ),
        (
            {
                "prompt_tokens": 10,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 6},
            },
            {
                "input_tokens": 4,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 6,
                "output_tokens": 2,
            },
        ),
        (
            {
                "prompt_tokens": 3,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 9},
            },
            {
                "input_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 3,
                "output_tokens": 2,
            },
        ),
        ({"completion_tokens": 2}, None),
        (None, None),
    ],
)
def test_usage_counts_cached_prompt_tokens_as_cache_reads(
    usage: object, expected: dict[str, int] | None
) -> None:
    assert usage_counts(usage) == expected


@pytest.mark.parametrize(
    "data", [b"not json", b"[1]", b'{"choices": []}', b'{"choices": [{"index": 0}]}']
)
def test_an_answer_that_is_not_a_chat_completion_is_not_translated(data: bytes) -> None:
    with pytest.raises(AnswerNotTranslatableError):
        translate_answer(data, TRANSLATED, fallback_id="r-1")


# -- streams --------------------------------------------------------------------------------


def translate_stream(
    chunks: list[bytes], translated: Translated = TRANSLATED
) -> list[dict[str, Any]]:
    """The Messages events (as ``{"event": kind, **data}``) for the chat stream ``chunks``."""
    stream = ChatToMessagesStream(translated, fallback_id="r-1")
    out = b""
    for chunk in chunks:
        data = chunk.decode().removeprefix("data: ").strip()
        out += stream.feed(data)
    out += stream.finish()
    assert stream.ended
    events = []
    for raw in out.decode().split("\n\n")[:-1]:
        kind_line, data_line = raw.split("\n")
        kind = kind_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == kind
        events.append(data)
    return events


def test_a_text_stream_becomes_one_text_block_with_the_usage_at_the_end() -> None:
    events = translate_stream(chat_chunks(["Hello there friend"], usage=(9, 3)))
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert (start["id"], start["model"], start["content"]) == ("msg_chatcmpl-1", "public-name", [])
    assert start["usage"] == {"input_tokens": 0, "output_tokens": 0}  # not known yet
    assert events[2] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert "".join(e["delta"]["text"] for e in events[3:6]) == "Hello there friend"
    assert events[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {
            "input_tokens": 9,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 3,
        },
    }


def test_a_tool_call_becomes_a_tool_use_block_streaming_its_input_as_json_deltas() -> None:
    events = translate_stream(chat_chunks(["Checking"], tool_call=True))
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert starts == [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {
                "type": "tool_use",
                "id": "call_1",
                "name": "get_weather",
                "input": {},
            },
        },
    ]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == 1]
    assert all(d["type"] == "input_json_delta" for d in deltas)
    assert json.loads("".join(d["partial_json"] for d in deltas)) == {"city": "Paris"}
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]  # the text closed before the tool call opened
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_two_tool_calls_are_two_blocks() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return b"data: " + json.dumps({"id": "c", "choices": [choice]}).encode()

    def call(index: int, ident: str | None, arguments: str) -> dict[str, Any]:
        function = {"arguments": arguments, **({"name": "w"} if ident else {})}
        return {
            "tool_calls": [
                {"index": index, **({"id": ident} if ident else {}), "function": function}
            ]
        }

    events = translate_stream(
        [
            chunk(call(0, "a", '{"x":')),
            chunk(call(0, None, "1}")),
            chunk(call(1, "b", '{"x":2}')),
            chunk({}, "tool_calls"),
            b"data: [DONE]",
        ]
    )
    blocks = [e["content_block"]["id"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["a", "b"]
    assert events[-2]["usage"] == {"output_tokens": 0}  # the engine sent no usage


def test_a_stop_sequence_named_by_the_engine_is_the_stop_reason() -> None:
    chunks = chat_chunks(["cut here"], usage=None)
    finishing = json.loads(chunks[-2].decode().removeprefix("data: "))
    finishing["choices"][0]["stop_reason"] = "END"
    chunks[-2] = b"data: " + json.dumps(finishing).encode()
    events = translate_stream(chunks)
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([b'data: {"error": {"message": "out of memory"}}'], "out of memory"),
        ([b"data: {not json"], "the engine sent an event that is not JSON"),
        (chat_chunks(["half"])[:2], "the engine's stream ended before its answer was finished"),
    ],
    ids=["error-chunk", "not-json", "no-finish"],
)
def test_a_stream_that_fails_ends_with_anthropics_error_event(
    chunks: list[bytes], message: str
) -> None:
    events = translate_stream(chunks)
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": message}}
    assert "message_stop" not in [e["type"] for e in events]


# -- the answer wrappers --------------------------------------------------------------------


class PiecesAnswer:
    """An engine's answer whose body comes in the given pieces (the last with the end)."""

    def __init__(self, pieces: list[bytes], content_type: bytes) -> None:
        self._pieces = list(pieces)
        self.status = 200
        self.headers = [(b"content-type", content_type)]
        self.content_length: int | None = None
        self.closed = False

    def header(self, name: bytes) -> bytes | None:
        return dict(self.headers).get(name)

    @property
    def at_eof(self) -> bool:
        return not self._pieces

    async def read_chunk(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""

    async def read(self, limit_bytes: int | None = None) -> bytes:
        return b"".join([await self.read_chunk() for _ in range(len(self._pieces))])

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
async def test_a_translated_stream_is_the_same_however_the_engines_bytes_are_cut(
    size: int, newline: str
) -> None:
    whole = b"".join(chat_chunks(["cut anywhere at all"], tool_call=True))
    whole = whole.replace(b"\n", newline.encode())
    pieces = [whole[i : i + size] for i in range(0, len(whole), size)]
    translated = Translated(b"{}", {}, "m", (), True)
    upstream = Upstream("http://127.0.0.1:1", "d-1", "local", "m")
    answer = PiecesAnswer(pieces, b"text/event-stream")
    stream = TranslatedStream(answer, translated, upstream, "rid")  # type: ignore[arg-type]
    assert stream.header(b"content-type") == b"text/event-stream"
    out = b""
    while chunk := await stream.read_chunk():
        out += chunk
    assert stream.at_eof
    expected = ChatToMessagesStream(translated, fallback_id="rid")
    reference = b"".join(
        expected.feed(event.decode().removeprefix("data: ").strip())
        for event in chat_chunks(["cut anywhere at all"], tool_call=True)
    )
    assert out == reference + expected.finish()
    stream.close()
    assert answer.closed


async def test_a_whole_answer_is_translated_at_its_first_read() -> None:
    body = json.dumps(chat_completion("whole")).encode()
    translated = Translated(b"{}", {}, "m", (), False)
    upstream = Upstream("http://127.0.0.1:1", "d-1", "local", "m")
    answer = PiecesAnswer([body[:10], body[10:]], b"application/json")
    whole = TranslatedAnswer(answer, translated, upstream, "rid")  # type: ignore[arg-type]
    message = json.loads(await whole.read())
    assert message["content"] == [{"type": "text", "text": "whole"}] and whole.at_eof
    broken = TranslatedAnswer(PiecesAnswer([b"[]"], b"application/json"), translated, upstream, "r")  # type: ignore[arg-type]
    with pytest.raises(UpstreamProtocolError, match="answered what berth cannot translate"):
        await broken.read()
