"""What admission adds to the proxy's CPU per request, in one process, without sockets.

``bench_proxy.py --limits`` measures the same thing through real sockets, where the machine's
noise (other processes on the same cores) moves a cell by more than admission costs. This one
runs :class:`berth.gateway.proxy.OpenAIProxy.handle` in a loop, with an in-memory client
request and answer writer and an engine answer made in memory, for the proxy without
admission and the proxy with it (the key of ``bench_proxy.py --limits``: every limit set, none
reached; the usage ledger; the fair admission gate with free slots; the leader's bound on a key's
body bytes in flight, where the tree has one), and prints the best
``time.process_time`` per request of several rounds, the two in turn. The engine is reached
the way a remote node's is, through the proxy's tunnel opener, which answers from memory.
Then the admission code alone: ``admit`` and ``settle``, the rate-limit headers, the gate's
free slot taken and given back.

Command (about a minute)::

    PYTHONPATH=src python scripts/bench_admission.py
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import uvloop
from bench_proxy import add_limited_key

from berth.admission import Admission, SlotGate, UsageLedger
from berth.cluster.leader.remote_link import tunnel_url
from berth.config import TierTable
from berth.engine_http.request import EngineRequest
from berth.gateway.proxy import OpenAIProxy
from berth.observability.metrics import ProxyMetrics
from berth.routing.resolver import Upstream
from berth.store import Store
from berth.vocab.records import ApiKeyRecord

MODEL = "bench"
#: Whether this tree's admission bounds a key's body bytes in flight (issue 38): a tree
#: before it is measured as it is.
_BODY_BOUND = "max_body_bytes_per_key" in inspect.signature(Admission).parameters
USAGE = {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def _event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


ANSWER = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there!"},
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }
).encode()
TEXT_EVENTS = [_event({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})] * 4
USAGE_EVENT = _event({"choices": [], "usage": USAGE})
DONE_EVENT = b"data: [DONE]\n\n"


class MemoryAnswer:
    """An engine's answer made in memory: JSON whole, or a stream event by event (its usage
    event only when the request asked for it, as engines do)."""

    def __init__(self, streamed: bool, usage_asked: bool) -> None:
        self.status = 200
        if streamed:
            self.headers = [(b"content-type", b"text/event-stream")]
            self.content_length: int | None = None
            self._chunks = [*TEXT_EVENTS, *([USAGE_EVENT] if usage_asked else []), DONE_EVENT]
        else:
            self.headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(ANSWER)),
            ]
            self.content_length = len(ANSWER)
            self._chunks = [ANSWER]

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)

    @property
    def at_eof(self) -> bool:
        return not self._chunks

    async def read_chunk(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""

    async def read(self, limit_bytes: int | None = None) -> bytes:
        data, self._chunks = b"".join(self._chunks), []
        return data

    def close(self) -> None:
        pass


class MemoryEngine:
    """The proxy's tunnel opener, answering every request from memory: a stream when the
    request asks for one, its usage event only when it asks for usage."""

    async def open_http(
        self, node_id: str, deployment_id: str, request: EngineRequest, read_timeout_s: float | None
    ) -> MemoryAnswer:
        body = request.body
        streamed = b'"stream": true' in body or b'"stream":true' in body
        return MemoryAnswer(streamed, b"include_usage" in body)


class MemoryRequest:
    """A client's ``POST /v1/chat/completions`` with ``body``."""

    method = "POST"
    path = "/v1/chat/completions"
    query = b""

    def __init__(self, body: bytes) -> None:
        self._body = body
        self.headers = [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
        ]

    async def read_chunk(self) -> bytes:
        body, self._body = self._body, b""
        return body

    def watch_disconnect(self, callback: Callable[[], None] | None) -> None:
        pass


class MemoryWriter:
    """Writes the answer's head as berth's server does (a line per header, joined once) and
    drops the body."""

    buffers_writes = True

    async def start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        parts = [b"HTTP/1.1 %d\r\n" % status]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"\r\n")
        self.head = b"".join(parts)

    async def write(self, data: bytes) -> None:
        pass

    async def end(self, data: bytes = b"") -> None:
        pass


class Bench:
    """A proxy without admission (``limits`` false), or with it: the key whose requests it
    admits, its :class:`Admission` and its :class:`SlotGate`."""

    def __init__(
        self,
        proxy: OpenAIProxy,
        key: ApiKeyRecord | None = None,
        admission: Admission | None = None,
        gate: SlotGate | None = None,
    ) -> None:
        self.proxy, self.key, self.admission, self.gate = proxy, key, admission, gate


def build(limits: bool) -> Bench:
    """The proxy without admission, or with it (see :class:`Bench`)."""
    url = tunnel_url("n-bench", "d-bench")
    upstream = Upstream(url, "d-bench", "n-bench", MODEL, remote=True)
    options: dict[str, Any] = {"tunnels": MemoryEngine()}
    key = admission = gate = None
    if limits:
        upstream = Upstream(url, "d-bench", "n-bench", MODEL, slots=1_000_000)
        store = Store(f"sqlite:///{tempfile.mkdtemp(prefix='bench-admission-')}/berth.db")
        store.migrate()
        key = add_limited_key(store, MODEL)
        # The leader's bound on a key's body bytes in flight, where this tree has one.
        bound = {"max_body_bytes_per_key": 64 * 1024 * 1024} if _BODY_BOUND else {}
        admission = Admission(TierTable(), UsageLedger(store), **bound)
        admission.load([key], {})
        gate = SlotGate()
        options |= {"admission": admission, "slots": gate}

    class Resolver:
        def candidates(self, model: str) -> list[Upstream]:
            return [upstream]

        def models(self) -> list[str]:
            return [MODEL]

    return Bench(OpenAIProxy(Resolver(), ProxyMetrics(), **options), key, admission, gate)


def request_body(streamed: bool, asks_usage: bool) -> bytes:
    stream = ""
    if streamed:
        stream = ', "stream": true'
        if asks_usage:
            stream += ', "stream_options": {"include_usage": true}'
    return (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Say hello."}}],'
        f' "max_tokens": 16{stream}}}'
    ).encode()


async def cpu_us_per_request(bench: Bench, streamed: bool, asks_usage: bool, count: int) -> float:
    body = request_body(streamed, asks_usage)
    proxy, key, writer = bench.proxy, bench.key, MemoryWriter()
    begun = time.process_time()
    for _ in range(count):
        await proxy.handle(MemoryRequest(body), writer, key)
    return (time.process_time() - begun) / count * 1e6


def best_us(run: Callable[[int], None], count: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        begun = time.process_time()
        run(count)
        best = min(best, time.process_time() - begun)
    return best / count * 1e6


def admission_alone(bench: Bench, rounds: int) -> None:
    admission, gate, key = bench.admission, bench.gate, bench.key
    assert admission is not None and gate is not None and key is not None
    plan = [Upstream("http://127.0.0.1:1", "d-bench", "local", MODEL, slots=1_000_000)]
    quota = admission.admit(key, MODEL, 120).quota

    def admit_settle(count: int) -> None:
        for _ in range(count):
            ticket = admission.admit(key, MODEL, 120)
            admission.settle(
                ticket,
                node_id="local",
                error=False,
                prompt_tokens=5,
                completion_tokens=6,
                estimated=False,
            )

    def headers(count: int) -> None:
        for _ in range(count):
            quota.headers()

    def gate_free_slot(count: int) -> None:
        for _ in range(count):
            held = gate.take_free(plan)
            assert isinstance(held, str)
            gate.release(held)

    print("\nadmission alone, best of", rounds, "rounds of 200,000:")
    print(f"- admit + settle: {best_us(admit_settle, 200_000, rounds):.2f} µs")
    print(f"- of which the rate-limit headers: {best_us(headers, 200_000, rounds):.2f} µs")
    gate_us = best_us(gate_free_slot, 200_000, rounds)
    print(f"- the gate's free slot taken and given back: {gate_us:.2f} µs")


async def main(args: argparse.Namespace) -> None:
    off, on = build(False), build(True)
    await off.proxy.startup()
    await on.proxy.startup()
    gc.collect()
    gc.freeze()  # as the leader does once started
    cells = {
        "json": (False, True),
        "stream": (True, True),
        "stream, usage not asked": (True, False),
    }
    print(f"each cell: {args.rounds} rounds of {args.requests:,} requests, off and on in turn\n")
    print("| answer | CPU µs/req, limits off | CPU µs/req, limits on | added µs/req |")
    print("| --- | ---: | ---: | ---: |")
    for name, (streamed, asks) in cells.items():
        await cpu_us_per_request(off, streamed, asks, 1000)  # warm up
        await cpu_us_per_request(on, streamed, asks, 1000)
        without, with_ = float("inf"), float("inf")
        for _ in range(args.rounds):
            without = min(without, await cpu_us_per_request(off, streamed, asks, args.requests))
            with_ = min(with_, await cpu_us_per_request(on, streamed, asks, args.requests))
        print(f"| {name} | {without:.2f} | {with_:.2f} | {with_ - without:+.2f} |", flush=True)
    admission_alone(on, args.rounds)
    await off.proxy.shutdown()
    await on.proxy.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=15_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=9, help="rounds per cell (best kept)")
    uvloop.run(main(parser.parse_args()))
