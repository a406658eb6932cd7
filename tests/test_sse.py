"""Event splitting and usage extraction, with bytes alone."""

from __future__ import annotations

import json

import pytest

from berth.gateway.sse import (
    SSEEvent,
    SSEEventSplitter,
    Usage,
    find_usage,
    has_usage_object,
    last_usage,
    parse_event,
    split_events,
    take_usage_event,
    usage_from_event,
    usage_from_json,
)

CHAT_USAGE_CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}}\n\n'
)


def feed_all(pieces: list[bytes]) -> tuple[list[bytes], bytes]:
    splitter = SSEEventSplitter()
    out = [splitter.feed(piece) for piece in pieces]
    return [o for o in out if o], splitter.take_pending()


@pytest.mark.parametrize(
    ("stream", "events"),
    [
        (b"data: a\n\ndata: b\n\n", [b"data: a\n\n", b"data: b\n\n"]),
        (b"data: a\r\n\r\ndata: b\r\n\r\n", [b"data: a\r\n\r\n", b"data: b\r\n\r\n"]),
        (b"data: a\r\rdata: b\r\r", [b"data: a\r\r", b"data: b\r\r"]),
        (b"event: x\ndata: a\n\n: ping\n\n", [b"event: x\ndata: a\n\n", b": ping\n\n"]),
        (b"data: a\r\n\ndata: b\n\r\n", [b"data: a\r\n\n", b"data: b\n\r\n"]),
    ],
)
def test_every_line_ending_ends_events(stream: bytes, events: list[bytes]) -> None:
    ready, pending = feed_all([stream])
    assert split_events(b"".join(ready)) == events
    assert pending == b""


def dispatched(ready: list[bytes]) -> list[SSEEvent]:
    events = [parse_event(raw) for raw in split_events(b"".join(ready))]
    return [event for event in events if event is not None]


@pytest.mark.parametrize(
    "stream",
    [b"data: a\n\ndata: b\n\n", b"data: a\r\n\r\ndata: b\r\n\r\n", b"data: a\r\rdata: b\r\r"],
)
def test_a_stream_cut_anywhere_gives_the_same_bytes_and_events(stream: bytes) -> None:
    for cut in range(1, len(stream)):
        ready, pending = feed_all([stream[:cut], stream[cut:]])
        assert b"".join(ready) + pending == stream
        assert dispatched(ready) == [SSEEvent(data="a"), SSEEvent(data="b")], cut


def test_a_stream_fed_byte_by_byte_releases_each_event_when_its_blank_line_ends() -> None:
    stream = b"data: one\n\ndata: two\r\n\r\n"
    splitter = SSEEventSplitter()
    released = [(i, out) for i, byte in enumerate(stream) if (out := splitter.feed(bytes([byte])))]
    # A CR alone already ends a line (WHATWG SSE), so the second event is complete at its last
    # CR; the LF that follows travels with whatever comes next and dispatches nothing.
    assert released == [(10, b"data: one\n\n"), (22, b"data: two\r\n\r")]
    assert splitter.take_pending() == b"\n"


def test_a_partial_event_is_held_back_and_its_bytes_kept_exactly() -> None:
    text = 'data: {"content": "héllo 日本"}\n\n'.encode()
    cut = text.index("é".encode()) + 1  # inside the two-byte character
    splitter = SSEEventSplitter()
    assert splitter.feed(text[:cut]) == b""
    assert splitter.pending_bytes == cut
    assert splitter.feed(text[cut:]) == text
    assert parse_event(text) == SSEEvent(data='{"content": "héllo 日本"}')


def test_the_bytes_after_the_last_event_stay_pending() -> None:
    splitter = SSEEventSplitter()
    assert splitter.feed(b"data: a\n\ndata: b") == b"data: a\n\n"
    assert splitter.take_pending() == b"data: b"
    assert splitter.pending_bytes == 0


@pytest.mark.parametrize(
    ("raw", "event"),
    [
        (b"data: hello\n\n", SSEEvent(data="hello")),
        (b"data:no-space\n\n", SSEEvent(data="no-space")),
        (b"data:  two spaces\n\n", SSEEvent(data=" two spaces")),
        (b"data: a\ndata: b\n\n", SSEEvent(data="a\nb")),
        (b"data\n\n", SSEEvent(data="")),
        (b": comment\nevent: done\ndata: x\n\n", SSEEvent(data="x", event="done")),
        (b"id: 7\nretry: 1500\ndata: x\n\n", SSEEvent(data="x", id="7", retry_ms=1500)),
        (b"retry: soon\ndata: x\n\n", SSEEvent(data="x")),
        (b"\xef\xbb\xbfdata: bom\n\n", SSEEvent(data="bom")),
        (b"data: a\r\ndata: b\r\n\r\n", SSEEvent(data="a\nb")),
        (b"data: \xff\n\n", SSEEvent(data="\ufffd")),
    ],
)
def test_parse_event_follows_the_spec(raw: bytes, event: SSEEvent) -> None:
    assert parse_event(raw) == event


@pytest.mark.parametrize("raw", [b": keep-alive\n\n", b"event: ping\n\n", b"\n\n"])
def test_an_event_without_data_dispatches_nothing(raw: bytes) -> None:
    assert parse_event(raw) is None


def test_usage_comes_from_the_last_chat_chunk() -> None:
    assert usage_from_event(CHAT_USAGE_CHUNK) == Usage(12, 34)


@pytest.mark.parametrize(
    "raw",
    [
        b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"no usage"}}]}\n\n',
        b"data: [DONE]\n\n",
        b'data: {"usage": {"prompt_tokens": 1, "completion_\n\n',
        b'data: {"usage": {"prompt_tokens": true, "completion_tokens": 1}}\n\n',
        b'data: {"usage": {"prompt_tokens": -1, "completion_tokens": 1}}\n\n',
        b'data: ["usage"]\n\n',
    ],
)
def test_events_without_valid_usage_give_none(raw: bytes) -> None:
    assert usage_from_event(raw) is None


def test_usage_comes_from_the_responses_api_completed_event() -> None:
    response = {
        "id": "resp_1",
        "usage": {
            "input_tokens": 20,
            "input_tokens_details": {"cached_tokens": 4},
            "output_tokens": 9,
            "total_tokens": 29,
        },
    }
    data = json.dumps({"type": "response.completed", "response": response})
    raw = f"event: response.completed\ndata: {data}\n\n".encode()
    assert usage_from_event(raw) == Usage(20, 9, cached_tokens=4)


USAGE_BODIES = [
    (b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":6}}', Usage(5, 6)),
    (b'{"data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}', Usage(8, 0)),
    (b'{"output":[],"usage":{"input_tokens":3,"output_tokens":4}}', Usage(3, 4)),
    (
        b'{"usage": {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 4},'
        b' "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 2}}}',
        Usage(20, 9, cached_tokens=4),
    ),
    (
        b'{"usage": {"prompt_tokens": 11, "prompt_tokens_details": {"cached_tokens": 3},'
        b' "completion_tokens": 1}}',
        Usage(11, 1, cached_tokens=3),
    ),
    (b'{"choices": [{"text": "the \\"usage\\": {\\"prompt_tokens\\": 9}"}]}', None),
    (b'{"choices":[],"usage":null}', None),
    (b'{"choices":[]}', None),
]


@pytest.mark.parametrize(("body", "usage"), USAGE_BODIES)
def test_usage_from_a_json_body(body: bytes, usage: Usage | None) -> None:
    assert usage_from_json(body) == usage


@pytest.mark.parametrize(("body", "usage"), USAGE_BODIES)
def test_finding_usage_without_parsing_agrees_with_parsing(
    body: bytes, usage: Usage | None
) -> None:
    assert find_usage(body) == usage


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_usage_from_a_body_that_is_no_json_object_is_none(body: bytes) -> None:
    assert usage_from_json(body) is None
    assert find_usage(body) is None


def test_usage_is_found_in_the_tail_of_a_large_body() -> None:
    body = json.dumps(
        {
            "data": [{"embedding": [0.5] * 2000, "index": 0}],
            "usage": {
                "prompt_tokens": 17,
                "prompt_tokens_details": {"cached_tokens": 0},
                "total_tokens": 17,
            },
        }
    ).encode()
    assert find_usage(body[-300:]) == Usage(17, 0)
    assert find_usage(body[:-300]) is None


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_the_last_usage_of_a_run_of_events_wins(newline: bytes) -> None:
    def event(payload: str) -> bytes:
        return b"data: " + payload.encode() + newline + newline

    events = (
        event('{"choices":[{"delta":{"content":"a"}}],"usage":null}')
        + event('{"usage":{"prompt_tokens":1,"completion_tokens":1}}')
        + event('{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}')
        + event('{"choices":[{"delta":{}}],"usage":null}')
        + event("[DONE]")
    )
    assert last_usage(events) == Usage(4, 2)
    assert last_usage(event('{"usage":null}')) is None


@pytest.mark.parametrize(
    ("events", "found"),
    [
        (b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n', True),
        (b'data: {"choices": [], "usage": {"prompt_tokens": 1}}\n\n', True),
        (b'data: {"usage":null}\n\ndata: {"usage": null}\n\n', False),
        (b'data: {"usage":null}\n\ndata: {"usage":{"prompt_tokens":2}}\n\n', True),
        (b'data: {"content":"no counts here"}\n\n', False),
    ],
)
def test_a_usage_object_is_told_from_a_null_one_without_parsing(events: bytes, found: bool) -> None:
    assert has_usage_object(events) is found


def test_the_usage_only_chunk_is_taken_out_and_the_rest_left_byte_for_byte() -> None:
    text = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}\n\n'
    done = b"data: [DONE]\n\n"

    assert take_usage_event(text + usage + done) == (text + done, Usage(7, 5))
    crlf = (text + usage + done).replace(b"\n", b"\r\n")
    assert take_usage_event(crlf) == (
        (text + done).replace(b"\n", b"\r\n"),
        Usage(7, 5),
    )
    riding = (
        b'data: {"choices":[{"text":"","finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":1,"completion_tokens":3}}\n\n'
    )
    assert take_usage_event(text + riding + done) == (text + riding + done, Usage(1, 3))
    assert take_usage_event(text + done) == (text + done, None)
