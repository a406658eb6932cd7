"""Traces from real processes: a leader daemon and an agent, each told the collector only by
its settings (``BERTH_TRACING_ENDPOINT``), export over OTLP/HTTP to an in-process collector
(``http.server`` on loopback, decoding with opentelemetry-proto); a request streamed
through the agent's tunnel to the fake engine is one trace across both processes, and the
leader's ``/metrics`` carries the export's counters."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from support.cluster_harness import started_cluster
from support.fake_llama_server import ANSWER
from support.waiting import wait_for

pytestmark = pytest.mark.slow


class Collected:
    """The spans a collector received, with their process's ``service.name``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, Span]] = []

    def named(self, name: str) -> list[tuple[str, Span]]:
        with self.lock:
            return [(service, span) for service, span in self.spans if span.name == name]


def _handler(collected: Collected) -> type[BaseHTTPRequestHandler]:
    class Export(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            export = ExportTraceServiceRequest()
            export.ParseFromString(body)
            with collected.lock:
                for resource_spans in export.resource_spans:
                    service = next(
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    )
                    for scope_spans in resource_spans.scope_spans:
                        collected.spans.extend((service, s) for s in scope_spans.spans)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Export


@pytest.fixture
def thread_collector() -> Iterator[tuple[str, Collected]]:
    """An OTLP/HTTP collector on loopback in a thread: its base URL and what it received."""
    collected = Collected()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(collected))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", collected
    finally:
        server.shutdown()
        server.server_close()


def test_a_request_through_a_real_agent_is_one_trace_across_both_processes(
    tmp_path: Path, thread_collector: tuple[str, Collected]
) -> None:
    url, collected = thread_collector
    settings = {
        "BERTH_TRACING_ENDPOINT": url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms between the export thread's batches
    }
    with started_cluster(tmp_path, settings) as cluster:
        agent = cluster.add_agent("gpu-t")
        cluster.deploy("tiny-traced", cluster.root / "tiny.gguf", agent)
        with cluster.openai() as client:
            stream = client.chat.completions.create(
                model="tiny-traced",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
                ANSWER
            )

        def both_exported() -> bool:
            return bool(collected.named("berth.agent.relay")) and any(
                span.attributes and service == "berth-leader"
                for service, span in collected.named("POST /v1/chat/completions")
            )

        wait_for(both_exported, 30, "the leader's and the agent's spans")
        with cluster.http() as http:
            metrics = http.get("/metrics").text
    ((leader, server),) = collected.named("POST /v1/chat/completions")
    ((relay_service, relay),) = collected.named("berth.agent.relay")
    (attempt,) = [s for _, s in collected.named("berth.attempt") if s.trace_id == server.trace_id]
    assert (leader, relay_service) == ("berth-leader", "berth-agent")
    assert relay.trace_id == server.trace_id
    assert attempt.parent_span_id == server.span_id
    assert relay.parent_span_id == attempt.span_id
    assert "berth_tracing_spans_dropped_total 0.0" in metrics
