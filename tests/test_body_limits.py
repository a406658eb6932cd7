"""What a ``/v1`` body may hold (issue 38): its JSON elements counted as it arrives
(:class:`~berth.gateway.body_limits.ElementCounter`, checked against a reference count made
character by character, whatever the chunks), its messages and content parts, the 413s that
name each limit, the key's bound on body bytes in flight, and the settings that set them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime

import httpx
import pytest

from berth.admission import Admission, ManualClock, QuotaExceededError, UsageLedger
from berth.config import TierTable
from berth.config.settings import Settings
from berth.gateway.body_limits import BodyLimits, ElementCounter, check_shape
from berth.gateway.request import read_body
from berth.observability.metrics import ProxyMetrics
from berth.paths import BerthHome
from berth.routing.errors import InvalidRequestError, RequestTooLargeError
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import ApiKeyRecord, UsageRecord
from support.proxy_fixtures import StaticResolver, running_proxy
from support.standin_engine import StandinEngine

# -- the element counter -------------------------------------------------------------------


def reference_count(text: bytes) -> int:
    """Commas and opening brackets outside strings, one character at a time."""
    count = 0
    in_string = escaped = False
    for byte in text:
        char = chr(byte)
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in ",[{":
            count += 1
    return count


BODIES = {
    "chat": json.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": 'Answer in JSON: {"a": [1, 2], "b": {}}'},
                {"role": "user", "content": [{"type": "text", "text": "x, y [z] {w}"}]},
            ],
            "temperature": 0.5,
        }
    ).encode(),
    "escapes": rb'{"a":"\\","b":"\\\"[,{","c":["\\\\\"",",",1],"d":"\u005c\"x"}',
    "arrays": b'{"model":"x","messages":[' + b",".join([b"[]"] * 50) + b"]}",
    "unicode": json.dumps({"s": "caf\u00e9, [\U0001f600]", "t": ["\u4e2c", "a,b"]}).encode(),
    "not json": b'{"a": [1, 2, "unterminated, [',
}


@pytest.mark.parametrize("name", list(BODIES))
@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1_000_000])
def test_elements_are_counted_outside_strings_whatever_the_chunks(name: str, size: int) -> None:
    text = BODIES[name]
    counter = ElementCounter()
    for start in range(0, len(text), size):
        counter.feed(text[start : start + size])
    assert counter.count == reference_count(text)


def test_an_escape_cut_at_a_chunks_end_is_read_with_the_next() -> None:
    counter = ElementCounter()
    for piece in (b'{"a":"x\\', b'"', b",[", b'",', b'{"b":1}}'):  # "x\"," then [ ... ]
        counter.feed(piece)
    # the quote after the cut backslash is escaped: ',[' stays in the string
    assert counter.count == reference_count(b'{"a":"x\\",[",{"b":1}}') == 3


def test_a_body_not_in_utf8_is_counted_at_least_as_high() -> None:
    text = json.dumps({"model": "m", "prompt": "a, [b] {c}", "n": [1, 2, 3]})
    exact = reference_count(text.encode())
    for encoding in ("utf-16-le", "utf-16", "utf-32"):
        counter = ElementCounter(utf8=False)
        counter.feed(text.encode(encoding))
        assert counter.count >= exact


class Flood:
    """A client request whose body is the issue's flood (five million empty arrays, 15 MB),
    arriving in 64 KiB chunks."""

    def __init__(self) -> None:
        self.body = b'{"model":"nosuch","messages":[' + b"[]," * 5_000_000 + b"[]]}"
        self.sent = 0

    async def read_chunk(self) -> bytes:
        chunk = self.body[self.sent : self.sent + 65_536]
        self.sent += len(chunk)
        return chunk

    def watch_disconnect(self, callback: object) -> None: ...


async def test_five_million_empty_arrays_are_refused_after_reading_little_of_them() -> None:
    client = Flood()
    with pytest.raises(InvalidRequestError) as refused:
        await read_body(client, None, 32 * 1024 * 1024, max_elements=500_000)
    assert (refused.value.http_status, refused.value.error_code) == (413, "too_many_elements")
    assert "500000" in str(refused.value) and "max_body_elements" in str(refused.value)
    assert client.sent < 2 * 1024 * 1024  # of 15 MB


# -- messages and content parts ------------------------------------------------------------

LIMITS = BodyLimits(max_elements=1_000, max_messages=3, max_content_parts=2)


@pytest.mark.parametrize(
    ("path", "body", "code", "param"),
    [
        ("/v1/chat/completions", {"messages": [{}] * 4}, "too_many_messages", "messages"),
        ("/v1/messages", {"messages": [{}] * 4}, "too_many_messages", "messages"),
        ("/v1/responses", {"input": [{}] * 4}, "too_many_messages", "input"),
        (
            "/v1/chat/completions",
            {"messages": [{"content": "x"}, {"content": [{}, {}, {}]}]},
            "too_many_content_parts",
            "messages[1].content",
        ),
    ],
)
def test_too_many_messages_or_parts_are_refused_413_naming_the_limit(
    path: str, body: dict[str, object], code: str, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        check_shape(path, body, LIMITS, 10_000)
    error = refused.value
    assert (error.http_status, error.error_code, error.param) == (413, code, param)
    setting = "max_messages" if code == "too_many_messages" else "max_content_parts"
    assert setting in str(error)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{}] * 3}),
        ("/v1/chat/completions", {"messages": [{"content": [{}, {}]}] * 3}),
        ("/v1/embeddings", {"input": [[1]] * 10}),  # not messages
        ("/v1/completions", {"prompt": ["a"] * 10}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/chat/completions", {"messages": "not a list"}),  # the engine says what is wrong
    ],
)
def test_bodies_within_the_limits_pass(path: str, body: dict[str, object]) -> None:
    check_shape(path, body, LIMITS, 10_000)


# -- the proxy: 413s, and the key's body bytes ---------------------------------------------


class Keyed:
    """The proxy with every request made by ``KEY``."""

    def __init__(self, proxy: object) -> None:
        self.proxy = proxy

    async def __call__(self, request: object, writer: object) -> None:
        await self.proxy.handle(request, writer, KEY)


KEY = ApiKeyRecord(
    "k-body",
    "body",
    "standard",
    "sk-berth-body",
    datetime(2025, 1, 1, tzinfo=UTC),
    None,
    LimitOverrides(),
)


class NoSink:
    def add_usage(self, batch: Iterable[UsageRecord]) -> int:
        return 0


async def test_the_proxy_answers_413_naming_each_limit(
    engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    limits = BodyLimits(max_elements=1_000, max_messages=10, max_content_parts=5)
    resolver = StaticResolver({"m": engine.base_url})
    async with (
        running_proxy(resolver, metrics, body_limits=limits) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        flood = b'{"model":"m","messages":[' + b",".join([b"[]"] * 2_000) + b"]}"
        parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}] * 6}]}
        answers = [
            await http.post("/v1/chat/completions", content=flood),
            await http.post("/v1/chat/completions", json={"model": "m", "messages": [{}] * 11}),
            await http.post("/v1/chat/completions", json=parts),
            await http.post("/v1/chat/completions", json={"model": "m", "prompt": "x" * 5_000}),
        ]
    assert [a.status_code for a in answers] == [413, 413, 413, 200]
    codes = [a.json()["error"]["code"] for a in answers[:3]]
    assert codes == ["too_many_elements", "too_many_messages", "too_many_content_parts"]
    assert len(engine.requests) == 1


async def test_a_keys_bodies_in_flight_are_bounded_in_bytes() -> None:
    admission = Admission(
        TierTable(), UsageLedger(NoSink()), clock=ManualClock(), max_body_bytes_per_key=1_000
    )
    first, second = admission.hold_body(KEY), admission.hold_body(KEY)
    assert first is not None and second is not None
    first.take(600)
    with pytest.raises(QuotaExceededError) as refused:
        second.take(500)
    assert (refused.value.http_status, refused.value.error_code) == (429, "body_bytes_exceeded")
    assert "max_body_bytes_per_key" in str(refused.value)
    assert admission.refusals[(KEY.id, "body_bytes_exceeded")] == 1  # counted as others are
    second.take(400)  # nothing was taken by the refusal
    assert admission.use_of(KEY.id).body_bytes == 1_000
    first.release()
    first.release()  # a second release gives back nothing more
    assert admission.use_of(KEY.id).body_bytes == 400
    second.release()
    assert admission.use_of(KEY.id).body_bytes == 0
    assert admission.hold_body(None) is None  # the CLI's requests are not bounded


async def test_read_body_holds_the_announced_bytes_before_reading() -> None:
    admission = Admission(
        TierTable(), UsageLedger(NoSink()), clock=ManualClock(), max_body_bytes_per_key=1_000
    )
    hold = admission.hold_body(KEY)

    class Silent:
        async def read_chunk(self) -> bytes:
            raise AssertionError("read before the bytes were held")

        def watch_disconnect(self, callback: object) -> None: ...

    with pytest.raises(QuotaExceededError):
        await read_body(Silent(), b"1001", 10_000, hold=hold)
    with pytest.raises(RequestTooLargeError):
        await read_body(Silent(), b"10001", 10_000, hold=hold)
    assert admission.use_of(KEY.id).body_bytes == 0


# -- the settings --------------------------------------------------------------------------


def test_the_settings_defaults_are_the_body_limits_defaults(home: BerthHome) -> None:
    settings = Settings.load(home, env={"PATH": ""})
    defaults = BodyLimits()
    assert settings.max_body_elements == defaults.max_elements
    assert settings.max_messages == defaults.max_messages
    assert settings.max_content_parts == defaults.max_content_parts
    assert settings.max_body_bytes_per_key == 4 * settings.max_body_bytes


def test_the_limits_are_set_from_config_toml(home: BerthHome) -> None:
    home.config_file.write_text(
        "[server]\nmax_body_elements = 20000\nmax_messages = 50\n"
        "max_content_parts = 8\nmax_body_bytes_per_key = 100000000\n"
    )
    settings = Settings.load(home, env={})
    assert (settings.max_body_elements, settings.max_messages, settings.max_content_parts) == (
        20_000,
        50,
        8,
    )
    assert settings.max_body_bytes_per_key == 100_000_000
