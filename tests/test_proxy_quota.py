"""The proxy with admission, in front of the scripted stand-in engine on loopback: the key's
rate-limit headers on every kind of answer, streams asked for usage on the client's behalf
with the extra event kept from the client (the rest byte for byte), the usage each answer
settles in the ledger, and the estimate when an engine reports none."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from berth.admission import Admission, ManualClock, Ticket, UsageLedger
from berth.config import TierTable
from berth.gateway.proxy import OpenAIProxy
from berth.observability.metrics import ProxyMetrics
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import ApiKeyRecord, UsageRecord
from support.proxy_fixtures import StaticResolver, running_proxy
from support.standin_engine import (
    StandinEngine,
    chat_chunks,
    chat_completion,
    error_reply,
    json_reply,
    responses_events,
    sse_event,
    sse_reply,
)

LIMITED = ApiKeyRecord(
    "k-limited",
    "limited",
    "standard",
    "sk-berth-abcd",
    datetime(2025, 1, 1, tzinfo=UTC),
    None,
    LimitOverrides(rpm=10, tpm=10_000),
)
MESSAGES = [{"role": "user", "content": "hi"}]


class NoSink:
    def add_usage(self, batch: Iterable[UsageRecord]) -> int:
        return 0


class KeyedHandler:
    """The proxy behind a stand-in for the listener's auth: ``x-test-key: limited`` makes
    the request ``LIMITED``'s; without it the request is the Unix socket's (no key)."""

    def __init__(self, proxy: OpenAIProxy) -> None:
        self.proxy = proxy

    async def __call__(self, request: Any, writer: Any) -> None:
        key = LIMITED if (b"x-test-key", b"limited") in request.headers else None
        await self.proxy.handle(request, writer, key)


@pytest.fixture
def quota_admission() -> Admission:
    return Admission(TierTable(), UsageLedger(NoSink()), clock=ManualClock())


@pytest.fixture
async def quota_client(
    engine: StandinEngine, metrics: ProxyMetrics, quota_admission: Admission
) -> AsyncIterator[httpx.AsyncClient]:
    resolver = StaticResolver({"m": engine.base_url})
    async with (
        running_proxy(resolver, metrics, admission=quota_admission, wrap=KeyedHandler) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        yield http


def ledger(admission: Admission) -> list[tuple[str, int, int, int, int, int]]:
    """(key, requests, errors, prompt, completion, estimated tokens) per ledger row."""
    return [
        (r.key_id, r.requests, r.errors, r.prompt_tokens, r.completion_tokens, r.estimated_tokens)
        for r in admission.ledger.pending
    ]


async def test_a_stream_that_did_not_ask_gets_the_engines_bytes_without_the_usage_event(
    quota_client: httpx.AsyncClient, engine: StandinEngine, quota_admission: Admission
) -> None:
    events = chat_chunks(["one two three"], usage=(7, 5))
    engine.script(sse_reply(events, pause_s=0.01))
    answer = await quota_client.post(
        "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True}
    )

    sent = engine.requests[0].json()
    assert sent["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in sent.items() if k != "stream_options"} == {
        "model": "m",
        "messages": MESSAGES,
        "stream": True,
    }
    usage_event = events[-2]
    assert b'"choices": []' in usage_event
    assert answer.content == b"".join(e for e in events if e is not usage_event)
    assert ledger(quota_admission) == [("socket:cli", 1, 0, 7, 5, 0)]


async def test_a_stream_that_asked_for_usage_is_relayed_whole_and_its_body_unchanged(
    quota_client: httpx.AsyncClient, engine: StandinEngine, quota_admission: Admission
) -> None:
    events = chat_chunks(["one two"], usage=(3, 2))
    engine.script(sse_reply(events))
    body = json.dumps(
        {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    ).encode()
    answer = await quota_client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )

    assert engine.requests[0].body == body
    assert answer.content == b"".join(events)
    assert ledger(quota_admission) == [("socket:cli", 1, 0, 3, 2, 0)]


async def test_other_stream_options_are_kept_when_usage_is_asked_for(
    quota_client: httpx.AsyncClient, engine: StandinEngine
) -> None:
    engine.script(sse_reply(chat_chunks(["x"])))
    options = {"include_usage": False, "continuous_usage_stats": False}
    await quota_client.post(
        "/v1/completions",
        json={"model": "m", "prompt": "hi", "stream": True, "stream_options": options},
    )

    assert engine.requests[0].json()["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": False,
    }


async def test_usage_riding_on_a_chunk_with_text_is_counted_and_left_in_place(
    quota_client: httpx.AsyncClient, engine: StandinEngine, quota_admission: Admission
) -> None:
    # llama-server's completions streams put usage on the last chunk, beside its text.
    last = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
            "usage": {"completion_tokens": 3, "prompt_tokens": 1, "total_tokens": 4}}  # fmt: skip
    events = [sse_event({"choices": [{"text": "a", "index": 0}]}), sse_event(last)]
    events.append(b"data: [DONE]\n\n")
    engine.script(sse_reply(events))
    answer = await quota_client.post(
        "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}
    )

    assert answer.content == b"".join(events)
    assert ledger(quota_admission) == [("socket:cli", 1, 0, 1, 3, 0)]


async def test_a_responses_stream_keeps_its_completed_event(
    quota_client: httpx.AsyncClient, engine: StandinEngine, quota_admission: Admission
) -> None:
    events = responses_events("hello", usage=(11, 3))
    engine.script(sse_reply(events))
    answer = await quota_client.post(
        "/v1/responses", json={"model": "m", "input": "hi", "stream": True}
    )

    assert "stream_options" not in engine.requests[0].json()
    assert answer.content == b"".join(events)
    assert ledger(quota_admission) == [("socket:cli", 1, 0, 11, 3, 0)]


async def test_every_answer_to_a_limited_key_carries_its_rate_limit_headers(
    quota_client: httpx.AsyncClient, engine: StandinEngine
) -> None:
    keyed = {"x-test-key": "limited"}
    engine.script(
        json_reply(chat_completion("hi")),
        sse_reply(chat_chunks(["a b"])),
        error_reply(500, "the engine broke"),
    )
    answers = [
        await quota_client.post("/v1/chat/completions", json={"model": "m"}, headers=keyed),
        await quota_client.post(
            "/v1/chat/completions", json={"model": "m", "stream": True}, headers=keyed
        ),
        await quota_client.post("/v1/chat/completions", json={"model": "m"}, headers=keyed),
        await quota_client.post("/v1/chat/completions", json={"model": "nope"}, headers=keyed),
    ]

    assert [a.status_code for a in answers] == [200, 200, 500, 404]
    for remaining, answer in zip(("9", "8", "7", "6"), answers, strict=True):
        assert answer.headers["x-ratelimit-limit-requests"] == "10"
        assert answer.headers["x-ratelimit-remaining-requests"] == remaining
        assert answer.headers["x-ratelimit-limit-tokens"] == "10000"
        assert answer.headers["x-ratelimit-reset-tokens"].endswith("s")
    unlimited = await quota_client.post("/v1/chat/completions", json={"model": "m"})
    assert "x-ratelimit-limit-requests" not in unlimited.headers


async def test_a_refusal_says_when_to_retry_in_seconds_and_milliseconds(
    quota_client: httpx.AsyncClient, engine: StandinEngine
) -> None:
    keyed = {"x-test-key": "limited"}
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 60_000}]}
    await quota_client.post("/v1/chat/completions", json=big, headers=keyed)
    refused = await quota_client.post("/v1/chat/completions", json=big, headers=keyed)

    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "tpm_exceeded")
    retry_ms = int(refused.headers["retry-after-ms"])
    assert int(refused.headers["retry-after"]) == -(-retry_ms // 1000)
    # The first one reserved its estimate (15,000, more than the bucket) and settled at the
    # engine's 9; one that large waits for a full bucket.
    assert refused.headers["x-ratelimit-remaining-tokens"] == "9991"
    assert len(engine.requests) == 1  # the refused one never reached the engine


async def test_an_engine_without_usage_is_estimated_and_an_error_costs_nothing(
    quota_client: httpx.AsyncClient, engine: StandinEngine, quota_admission: Admission
) -> None:
    plain = chat_completion("hello")
    del plain["usage"]
    no_usage = chat_chunks(["a b c"], usage=None)
    engine.script(json_reply(plain), sse_reply(no_usage), error_reply(503, "busy"))
    body = {"model": "m", "messages": MESSAGES}
    await quota_client.post("/v1/chat/completions", json=body)
    await quota_client.post("/v1/chat/completions", json={**body, "stream": True})
    await quota_client.post("/v1/chat/completions", json=body)

    ((key, requests, errors, prompt, completion, estimated),) = ledger(quota_admission)
    sent = [len(r.body) for r in engine.requests]
    sent[1] -= len(b',"stream_options":{"include_usage":true}')  # as the client sent it
    json_answer = len(json.dumps(plain))
    assert (key, requests, errors) == ("socket:cli", 3, 1)
    assert prompt == -(-sent[0] // 4) + -(-sent[1] // 4)  # one token per 4 bytes
    assert completion == -(-json_answer // 4) + len(no_usage) - 1  # one per event but [DONE]
    assert estimated == prompt + completion


async def test_a_chat_completions_cached_prompt_tokens_are_counted_apart(
    quota_client: httpx.AsyncClient, engine: StandinEngine, quota_admission: Admission
) -> None:
    answer = chat_completion("hello", usage=(30, 2))
    answer["usage"]["prompt_tokens_details"] = {"cached_tokens": 24}  # vLLM, llama.cpp
    engine.script(json_reply(answer))
    await quota_client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    (row,) = quota_admission.ledger.pending
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (30, 2, 24)


class MaxTokensSeen(Admission):
    """Admission that keeps the ``max_tokens`` each request was admitted with."""

    def __init__(self) -> None:
        super().__init__(TierTable(), UsageLedger(NoSink()), clock=ManualClock())
        self.max_tokens: list[int | None] = []

    def admit(
        self, key: Any, model: str, request_bytes: int, max_tokens: int | None = None
    ) -> Ticket:
        self.max_tokens.append(max_tokens)
        return super().admit(key, model, request_bytes, max_tokens)


async def test_a_requests_max_tokens_reaches_admission_for_the_budgets_reservation(
    engine: StandinEngine, metrics: ProxyMetrics
) -> None:
    watching = MaxTokensSeen()
    engine.script(*(json_reply(chat_completion("hi")) for _ in range(4)))
    resolver = StaticResolver({"m": engine.base_url})
    keyed = {"x-test-key": "limited"}
    async with (
        running_proxy(resolver, metrics, admission=watching, wrap=KeyedHandler) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        for extra in ({"max_tokens": 64}, {"max_completion_tokens": 32}, {}, {"max_tokens": "9"}):
            body = {"model": "m", "messages": MESSAGES, **extra}
            answer = await http.post("/v1/chat/completions", json=body, headers=keyed)
            assert answer.status_code == 200
    assert watching.max_tokens == [64, 32, None, None]  # a string is no number of tokens
