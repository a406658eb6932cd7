"""The engines' own cache signals correcting the prefix record: llama.cpp's ``/slots``,
vLLM's and SGLang's ``/metrics`` parsed, the corrections they make, and the probe cycle's
reading through the proxy's engine client from a small fake engine (and, slow, a real
llama-server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace

import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI
from fastapi.testclient import TestClient

from berth.admin.routing import build_routing_router
from berth.api import RoutingExplanation
from berth.gateway.engine_client import EngineClient
from berth.routing.cache_probe import CacheProbe
from berth.routing.cache_signals import (
    CacheSignal,
    Correction,
    capacity_blocks,
    correct,
    parse_metrics,
    parse_slots,
)
from berth.routing.errors import EngineSignalError
from berth.routing.prefix_blocks import BLOCK_BYTES, prompt_blocks
from berth.routing.prefix_index import PrefixIndex
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.runtime.bundled import smollm2_gguf
from berth.runtime.engines import EngineBinaries

SYSTEM = "You are a careful assistant. " * 40  # about 1,160 bytes: 5 blocks

# One idle slot that served a task, one never used: the shape of llama.cpp's
# server_slot::to_json (tools/server/server-context.cpp), as the real one answers.
SLOTS = [
    {
        "id": 0,
        "n_ctx": 2048,
        "speculative": False,
        "is_processing": False,
        "id_task": 7,
        "n_prompt_tokens": 311,
        "n_prompt_tokens_processed": 12,
        "n_prompt_tokens_cache": 299,
        "params": {},
        "next_token": [{"has_next_token": False, "n_remain": -1, "n_decoded": 8}],
    },
    {"id": 1, "n_ctx": 2048, "speculative": False, "is_processing": False},
]

VLLM_METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3000.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 4000.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="512"} 1.0
"""

SGLANG_METRICS = """\
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 8.128902e+06
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.28
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.5
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 161721.0
"""


# -- parsing -----------------------------------------------------------------------------------


def test_llama_cpp_slots_give_the_tokens_held_and_the_largest_task() -> None:
    signal = parse_slots(json.dumps(SLOTS).encode())
    assert signal == CacheSignal("llama.cpp /slots", cached_tokens=311, epoch=7, slots=2)
    assert signal.describe() == "llama.cpp /slots: 311 tokens cached in 2 slots"
    fresh = parse_slots(json.dumps([{"id": 0, "n_ctx": 2048}]).encode())
    assert fresh.holds_nothing and fresh.epoch is None


def test_vllm_metrics_give_usage_hit_rate_capacity_and_the_prompt_counter() -> None:
    signal = parse_metrics("vllm", VLLM_METRICS)
    assert signal == CacheSignal(
        "vLLM /metrics",
        served_tokens=4000,
        epoch=4000,
        capacity_tokens=512 * 16,
        usage=0.25,
        hit_rate=0.75,
    )
    assert signal.describe() == (
        "vLLM /metrics: KV cache 25% in use, prefix hit rate 75%, capacity 8,192 tokens, "
        "4,000 prompt tokens served"
    )


def test_sglang_metrics_give_usage_hit_rate_and_capacity() -> None:
    signal = parse_metrics("sglang", SGLANG_METRICS)
    assert (signal.capacity_tokens, signal.usage, signal.hit_rate) == (161721, 0.28, 0.5)
    assert signal.served_tokens == signal.epoch == 8128902


@pytest.mark.parametrize(
    ("parse", "body", "says"),
    [
        (lambda b: parse_slots(b), b"<html>", "not JSON"),
        (lambda b: parse_slots(b), b'{"id": 0}', "not a list"),
        (lambda b: parse_slots(b), b'[{"id": 0, "n_prompt_tokens": -1}]', "n_prompt_tokens"),
        (lambda b: parse_metrics("vllm", b.decode()), b"no metrics here {", "Prometheus"),
        (lambda b: parse_metrics("sglang", b.decode()), VLLM_METRICS.encode(), "no sglang:"),
    ],
)
def test_an_answer_that_is_not_the_engine_s_signal_is_refused(
    parse: object, body: bytes, says: str
) -> None:
    with pytest.raises(EngineSignalError, match=says):
        parse(body)  # type: ignore[operator]


# -- corrections -------------------------------------------------------------------------------

LLAMA = "llama.cpp /slots"


@pytest.mark.parametrize(
    ("previous", "current", "in_flight", "expected"),
    [
        (None, CacheSignal(LLAMA, cached_tokens=300, epoch=7), 0, Correction()),
        (
            CacheSignal(LLAMA, cached_tokens=300, epoch=90),
            CacheSignal(LLAMA, cached_tokens=40, epoch=3),
            1,
            Correction(
                True,
                None,
                "the engine restarted (largest task id fell from 90 to 3): its cache is empty",
            ),
        ),
        (
            None,
            CacheSignal(LLAMA, cached_tokens=0),
            0,
            Correction(True, None, "the engine holds no cached prompt tokens"),
        ),
        # a request just sent may not be in a slot yet: nothing is dropped for it
        (None, CacheSignal(LLAMA, cached_tokens=0), 1, Correction()),
        (
            CacheSignal("vLLM /metrics", served_tokens=9000, epoch=9000),
            CacheSignal("vLLM /metrics", served_tokens=10, epoch=10, capacity_tokens=8192),
            0,
            Correction(
                True,
                128,
                "the engine restarted (prompt tokens fell from 9,000 to 10): its cache is empty",
            ),
        ),
        (
            None,
            CacheSignal("SGLang /metrics", served_tokens=5, epoch=5, capacity_tokens=6400),
            0,
            Correction(False, 100, "at most 100 blocks (its cache's capacity)"),
        ),
    ],
)
def test_correct(
    previous: CacheSignal | None, current: CacheSignal, in_flight: int, expected: Correction
) -> None:
    assert correct(previous, current, in_flight=in_flight) == expected


def test_the_capacity_in_blocks_uses_the_record_s_bytes_per_token() -> None:
    assert capacity_blocks(8192) == 8192 * 4 // BLOCK_BYTES == 128
    assert capacity_blocks(1) == 1


def test_trimming_keeps_a_deployment_s_most_recent_blocks_and_no_one_else_s() -> None:
    index = PrefixIndex()
    for i in range(3):
        index.record("a", prompt_blocks({"messages": [{"role": "user", "content": f"{i}" * 1000}]}))
    index.record("b", prompt_blocks({"messages": [{"role": "user", "content": "b" * 1000}]}))
    assert (index.entries_of("a"), index.entries_of("b")) == (12, 4)
    assert index.trim({"a": 4, "b": 10}) == {"a": 8}
    assert (index.entries_of("a"), index.entries_of("b")) == (4, 4)
    newest = prompt_blocks({"messages": [{"role": "user", "content": "2" * 1000}]})
    assert index.matches(newest, ["a"]) == {"a": 4}  # the last prompt served is what is left
    assert index.trim({"a": 4}) == {}


# -- the probe cycle, through the engine client ------------------------------------------------


class FakeCacheEngine:
    """An engine answering ``GET /slots`` (llama.cpp's shape) and ``GET /metrics`` from
    ``slots`` and ``metrics``, checking ``Authorization: Bearer key`` as llama-server does."""

    def __init__(self, key: str = "engine-key") -> None:
        self.key = key
        self.slots: list[dict[str, object]] = [dict(s) for s in SLOTS]
        self.metrics = VLLM_METRICS
        self.paths: list[str] = []
        self.port = 0

    async def _handle(self, request: web.Request) -> web.Response:
        self.paths.append(f"{request.method} {request.path}")
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": "Invalid API Key"}, status=401)
        if request.path == "/slots":
            return web.json_response(self.slots)
        if request.path == "/metrics":
            return web.Response(text=self.metrics)
        return web.json_response({"error": "not found"}, status=404)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[FakeCacheEngine]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        try:
            yield self
        finally:
            await runner.cleanup()


class Pair:
    """Model ``m`` on two engines of node ``local``."""

    def __init__(self, ports: list[int], engine: str) -> None:
        self.upstreams = [
            Upstream(f"http://127.0.0.1:{p}", f"d-{i}", "local", "m", engine=engine)
            for i, p in enumerate(ports)
        ]

    def candidates(self, model: str) -> list[Upstream]:
        return list(self.upstreams)

    def models(self) -> list[str]:
        return ["m"]


@contextlib.asynccontextmanager
async def _engine_client(key: str) -> AsyncIterator[EngineClient]:
    client = EngineClient(
        tunnels=None,
        connect_timeout_s=2,
        read_timeout_s=5,
        max_connections=8,
        engine_auth=lambda _d: (b"authorization", f"Bearer {key}".encode()),
    )
    await client.startup()
    try:
        yield client
    finally:
        await client.shutdown()


def _serve(router: Router, content: str) -> Upstream:
    payload = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    }
    plan, key = router.plan_request("m", [], payload)
    router.succeeded(key, plan[0])
    return plan[0]


def _explain(router: Router) -> RoutingExplanation:
    app = FastAPI()
    app.include_router(build_routing_router(router))
    with TestClient(app) as http:
        answer = http.get("/admin/routing/m")
    assert answer.status_code == 200, answer.text
    return RoutingExplanation.model_validate_json(answer.content)


async def test_an_engine_whose_slots_emptied_is_no_longer_a_match() -> None:
    async with (
        FakeCacheEngine().running() as one,
        FakeCacheEngine().running() as two,
        _engine_client("engine-key") as client,
    ):
        fleet = Pair([one.port, two.port], "llamacpp")
        router = Router(fleet, policy="prefix")
        probe = CacheProbe(router, client, timeout_s=2)
        held = _serve(router, "q1")
        assert _serve(router, "q2").deployment_id == held.deployment_id  # the match wins
        engine = one if held.deployment_id == "d-0" else two
        await probe.read_round(fleet.upstreams)
        assert router.prefixes.entries_of(held.deployment_id) > 0  # it still holds 311 tokens
        assert engine.paths[-1] == "GET /slots"
        engine.slots = [{"id": 0, "n_ctx": 2048}, {"id": 1, "n_ctx": 2048}]  # restarted
        await probe.read_round(fleet.upstreams)
        assert router.prefixes.entries_of(held.deployment_id) == 0
        explained = _explain(router)
        shown = {c.deployment_id: c.cache_signal for c in explained.candidates}
        assert shown[held.deployment_id] == (
            "llama.cpp /slots: 0 tokens cached in 2 slots; the engine holds no cached prompt tokens"
        )
        # the next request has no match anywhere: the least loaded takes it
        payload = {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q3"}]
        }
        router.plan_request("m", [], payload)
        assert router.last_decisions["m"].outcome == "no_match"


async def test_a_vllm_engine_that_restarted_loses_its_entries_and_capacity_caps_them() -> None:
    async with FakeCacheEngine().running() as one, _engine_client("engine-key") as client:
        fleet = Pair([one.port, one.port], "vllm")  # two deployments, one fake: same answers
        router = Router(fleet, policy="prefix")
        probe = CacheProbe(router, client, timeout_s=2)
        held = _serve(router, "q1")
        one.metrics = VLLM_METRICS.replace('num_gpu_blocks="512"', 'num_gpu_blocks="12"')
        await probe.read_round(fleet.upstreams)
        assert router.prefixes.entries_of(held.deployment_id) == 3  # 12 x 16 tokens: 3 blocks
        one.metrics = VLLM_METRICS.replace("4000.0", "12.0")  # its counters started again
        await probe.read_round(fleet.upstreams)
        assert router.prefixes.entries_of(held.deployment_id) == 0
        assert "restarted (prompt tokens fell from 4,000 to 12)" in (
            _explain(router).candidates[0].cache_signal
        )


async def test_a_failed_reading_keeps_the_estimate_and_least_load_reads_nothing() -> None:
    async with FakeCacheEngine().running() as one, _engine_client("wrong-key") as client:
        fleet = Pair([one.port, one.port], "llamacpp")
        router = Router(fleet, policy="prefix")
        probe = CacheProbe(router, client, timeout_s=2)
        held = _serve(router, "q1")
        with pytest.raises(EngineSignalError, match="GET /slots answered 401"):
            await probe.read(fleet.upstreams[0])
        await probe.read_round(fleet.upstreams)  # logged, never raised
        assert router.prefixes.entries_of(held.deployment_id) > 0
        router.policy = "least-load"
        before = len(one.paths)
        await probe.read_round(fleet.upstreams)
        assert len(one.paths) == before


# -- a real llama-server -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _llama_server(port: int, key: str) -> Iterator[None]:
    server = EngineBinaries.detect().llama_server
    model = smollm2_gguf()
    assert server is not None and model is not None
    argv = [server, "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
            "--parallel", "2", "-c", "4096", "--slots", "--api-key", key, "-t", "1"]  # fmt: skip
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become healthy (exit {child.poll()})")
            time.sleep(0.2)
        yield
    finally:
        child.terminate()
        child.wait(30)


@pytest.mark.slow
@pytest.mark.needs("llama-server", "smollm2")
async def test_a_real_llama_server_s_slots_after_a_request_and_after_a_restart() -> None:
    port, key = _free_port(), "real-key"
    upstream = Upstream(f"http://127.0.0.1:{port}", "d-real", "local", "m", engine="llamacpp")
    fleet = SimpleNamespace(candidates=lambda _m: [upstream, upstream], models=lambda: ["m"])
    router = Router(fleet, policy="prefix")  # type: ignore[arg-type]
    async with _engine_client(key) as client:
        probe = CacheProbe(router, client, timeout_s=5)
        with _llama_server(port, key):
            before = await probe.read(upstream)
            assert before.holds_nothing and before.slots == 2
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
            body = {"messages": messages, "max_tokens": 4, "cache_prompt": True}
            answer = await asyncio.to_thread(
                httpx.post, f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                headers={"Authorization": f"Bearer {key}"}, timeout=120,
            )  # fmt: skip
            assert answer.status_code == 200, answer.text
            _serve(router, "Hi")
            await probe.read_round([upstream])
            signal, correction = router.cache_signals["d-real"]
            assert signal.cached_tokens is not None and signal.cached_tokens > 200, signal
            assert not correction.drop and router.prefixes.entries_of("d-real") > 0
            print(f"\nreal /slots after one request: {signal.describe()}", file=sys.stderr)
        with _llama_server(port, key):  # the same engine, restarted: its cache is empty
            await probe.read_round([upstream])
            signal, correction = router.cache_signals["d-real"]
            assert correction.drop and router.prefixes.entries_of("d-real") == 0
            print(f"after a restart: {signal.describe()}; {correction.reason}", file=sys.stderr)
