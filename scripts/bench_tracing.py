"""What tracing costs the proxy per request, in one process, without client sockets.

Runs :class:`berth.gateway.proxy.OpenAIProxy.handle` in a loop with the in-memory client
request, answer writer and engine of ``scripts/bench_admission.py`` (the engine reached as a
remote node's is, through the tunnel opener), for four proxies measured in turn, round after
round, keeping each one's best ``time.process_time`` per request (every thread of this
process: the SDK's export thread included):

* ``off``: no tracer, as with no ``[tracing]`` endpoint (every hook one ``is not None`` test);
* ``off (control)``: a second proxy exactly like it, to show the noise between two equal
  cells on this machine;
* ``on, not sampled``: a tracer whose sampler records nothing (ratio 0): spans are
  non-recording, the ``traceparent`` is still made for the engine;
* ``on, recorded``: every request sampled, its spans made and handed to the batch processor,
  whose exporter throws them away (what the request path pays, without the encoding);
* ``on, exported``: every request sampled (``always_on``), its spans (request, attempt,
  stream or answer: 3 spans, 2 or 3 events) exported in batches by the SDK's OTLP/HTTP exporter to a
  collector stand-in in another process on loopback (answers 200, decodes nothing).

The exported cell's queue holds every span of a round, and each round ends with the export
flushed, so that all of its spans' export is in its CPU (none dropped; the count printed).

Command (about a minute)::

    PYTHONPATH=src python scripts/bench_tracing.py
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time
from typing import Any

import uvloop
from bench_admission import MemoryEngine, MemoryRequest, MemoryWriter, request_body
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from berth.cluster.leader.remote_link import tunnel_url
from berth.gateway.proxy import OpenAIProxy
from berth.observability.metrics import ProxyMetrics
from berth.observability.tracing import Tracing, build_tracing
from berth.observability.tracing_config import TracingConfig
from berth.routing.resolver import Upstream

MODEL = "bench"
#: The collector stand-in: answers every POST with an empty 200 and decodes nothing.
SINK = """
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class Discard(SpanExporter):
    """An exporter that takes every batch and sends nothing."""

    def export(self, spans: object) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def build(tracing: Tracing | None) -> OpenAIProxy:
    upstream = Upstream(tunnel_url("n-bench", "d-bench"), "d-bench", "n-bench", MODEL, remote=True)

    class Resolver:
        def candidates(self, model: str) -> list[Upstream]:
            return [upstream]

        def models(self) -> list[str]:
            return [MODEL]

    options: dict[str, Any] = {"tunnels": MemoryEngine()}
    if tracing is not None:
        options["tracer"] = tracing.requests()
    return OpenAIProxy(Resolver(), ProxyMetrics(), **options)


async def cpu_us_per_request(
    proxy: OpenAIProxy, streamed: bool, count: int, tracing: Tracing | None = None
) -> float:
    """CPU per request of ``count`` requests; with ``tracing``, the export of their spans
    is waited for and counted too."""
    body = request_body(streamed, True)
    writer = MemoryWriter()
    begun = time.process_time()
    for _ in range(count):
        await proxy.handle(MemoryRequest(body), writer, None)
    if tracing is not None:
        tracing.force_flush()
    return (time.process_time() - begun) / count * 1e6


async def main(args: argparse.Namespace) -> None:
    sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    endpoint = f"http://127.0.0.1:{sink.stdout.readline().strip()}/v1/traces"
    # a queue for every span of a round: all of them exported, none dropped, in the cell's CPU
    queue = args.requests * 8
    exported = build_tracing(
        TracingConfig(endpoint=endpoint, sampler="always_on", queue_spans=queue)
    )
    unsampled = build_tracing(TracingConfig(endpoint=endpoint, sampler="always_off"))
    recorded = build_tracing(
        TracingConfig(endpoint=endpoint, sampler="always_on", queue_spans=queue),
        exporter=Discard(),
    )
    proxies = {
        "off": build(None),
        "off (control)": build(None),
        "on, not sampled": build(unsampled),
        "on, recorded": build(recorded),
        "on, exported": build(exported),
    }
    try:
        for proxy in proxies.values():
            await proxy.startup()
        gc.collect()
        gc.freeze()  # as the leader does once started
        print(f"each cell: best of {args.rounds} rounds of {args.requests:,} requests, "
              "the proxies in turn\n")  # fmt: skip
        print("| answer | " + " | ".join(f"{name} µs/req" for name in proxies) + " |")
        print("| --- |" + " ---: |" * len(proxies))
        for name, streamed in (("json", False), ("stream", True)):
            best = dict.fromkeys(proxies, float("inf"))
            for proxy in proxies.values():
                await cpu_us_per_request(proxy, streamed, 1000)  # warm up
            for _ in range(args.rounds):
                for label, proxy in proxies.items():
                    flushed = {"on, exported": exported, "on, recorded": recorded}.get(label)
                    spent = await cpu_us_per_request(proxy, streamed, args.requests, flushed)
                    best[label] = min(best[label], spent)
            cells = " | ".join(f"{best[label]:.1f}" for label in proxies)
            print(f"| {name} | {cells} |", flush=True)
        exported.force_flush()
        print(f"\nspans dropped (queue full): {exported.dropped}")
    finally:
        for proxy in proxies.values():
            await proxy.shutdown()
        exported.shutdown()
        unsampled.shutdown()
        recorded.shutdown()
        sink.terminate()
        sink.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per cell (best kept)")
    uvloop.run(main(parser.parse_args()))
