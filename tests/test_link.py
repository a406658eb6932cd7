"""The agent link end to end in one process: the leader's ``RemoteLink`` and an agent's
``AgentService`` joined by an in-memory WebSocket pair, with a real stand-in engine on
loopback behind the agent. Fast; ``test_cluster.py`` does the same over real TLS sockets."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from berth.cluster.link.connection import LinkConnection, RemoteOpError
from berth.cluster.link.tunnel_stream import TunnelStream
from berth.cluster.protocol.errors import CloseCode, LinkError, ProtocolError
from berth.cluster.protocol.frames import (
    Hello,
    ResetCode,
    StreamOpen,
    StreamReset,
    decode_frame,
    encode_frame,
)
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.limits import LinkLimits
from berth.cluster.protocol.ops import PROBE, NoArgs, Op, ProbeArgs
from berth.cluster.protocol.payloads import Inventory
from berth.cluster.protocol.session import LinkSession, Role
from berth.engine_http.errors import UpstreamConnectError, UpstreamTimeoutError
from berth.engine_http.request import EngineRequest
from berth.errors import EngineError
from berth.gateway.engine_client import EngineClient
from berth.routing.resolver import Upstream
from berth.vocab.deployment_request import DeploymentRequest
from support.fakes import memory_socket_pair
from support.link_pair import DEPLOYMENT, ENGINE_KEY, LeaderSide, Linked
from support.standin_engine import Head, Reply, Stall, Write, chat_chunks, json_reply, sse_reply


def _start_request() -> DeploymentRequest:
    return DeploymentRequest(
        deployment_id=DEPLOYMENT,
        model_name="m",
        model_path=Path("/m.gguf"),
        engine="llamacpp",
        port=0,
        log_path=Path(),
    )


async def _ask(linked: Linked, body: bytes = b'{"model": "m"}') -> Any:
    request = EngineRequest(
        "/v1/chat/completions", b"", [(b"content-type", b"application/json")], body
    )
    return await linked.link.open_http(DEPLOYMENT, request, 5.0)


async def test_a_json_exchange_crosses_the_link(linked: Linked) -> None:
    response = await _ask(linked)
    assert response.status == 200
    assert b'"hello"' in await response.read()
    assert response.at_eof
    response.close()
    received = linked.engine.requests[0]
    assert received.path == "/v1/chat/completions"
    assert received.headers["content-type"] == "application/json"
    assert received.headers["authorization"] == f"Bearer {ENGINE_KEY}"  # the agent added it


async def test_a_body_larger_than_the_window_arrives_whole(linked: Linked) -> None:
    body = b'{"model": "m", "pad": "' + b"x" * (900 * 1024) + b'"}'
    response = await _ask(linked, body)
    answer = await response.read()
    response.close()
    assert response.status == 200, answer
    assert linked.engine.requests[0].body == body


async def test_sse_events_arrive_as_the_engine_writes_them(linked: Linked) -> None:
    linked.engine.script(sse_reply(chat_chunks(["a", "b", "c"]), pause_s=0.05))
    response = await _ask(linked)
    assert response.header(b"content-type").startswith(b"text/event-stream")
    chunks = []
    while chunk := await response.read_chunk():
        chunks.append(chunk)
    response.close()
    assert len(chunks) > 1, "the stream was buffered instead of relayed"
    assert b"".join(chunks).endswith(b"data: [DONE]\n\n")


async def test_closing_an_unfinished_answer_reaches_the_engine(linked: Linked) -> None:
    linked.engine.script(sse_reply(chat_chunks(["x"] * 200), pause_s=0.05))
    response = await _ask(linked)
    await response.read_chunk()
    response.close()
    received = await linked.engine.wait_for_request()
    await asyncio.wait_for(received.disconnected.wait(), 5)
    assert not received.completed


async def test_engine_errors_are_relayed_with_their_status(linked: Linked) -> None:
    linked.engine.script(json_reply({"error": {"message": "bad"}}, status=400))
    response = await _ask(linked)
    assert response.status == 400
    assert b"bad" in await response.read()
    response.close()


async def test_an_unknown_deployment_is_a_connect_error(linked: Linked) -> None:
    with pytest.raises(UpstreamConnectError):
        await linked.link.open_http("d-99999999", EngineRequest("/v1/x", b"", [], b"{}"), 5.0)


async def test_control_ops_and_progress(linked: Linked) -> None:
    spawned: list[tuple[int, int]] = []

    async def on_spawned(pid: int, port: int) -> None:
        spawned.append((pid, port))

    request = _start_request()
    endpoint = await linked.link.start_deployment(request, 10.0, on_spawned)
    # a remote engine has no URL of its own: it is reached through the agent
    assert (endpoint.base_url, endpoint.remote, endpoint.port) == ("", True, linked.core.port)
    assert spawned == [(4321, linked.core.port)]
    assert linked.core.requests[-1].runtime == "process"
    assert await linked.link.probe(DEPLOYMENT) == "healthy"
    assert [e.deployment_id for e in await linked.link.engines()] == [DEPLOYMENT]
    assert (await linked.link.inventory()).hostname == "gpu-host"
    logs = b"".join([c async for c in linked.link.logs(DEPLOYMENT, tail_lines=10, follow=False)])
    assert logs == b"engine line 1\nengine line 2\n"
    await linked.link.stop_deployment(DEPLOYMENT, 1.0)
    assert linked.core.stopped == [DEPLOYMENT]


async def test_a_docker_start_carries_its_image_and_progress(linked: Linked) -> None:
    lines: list[str] = []
    request = replace(_start_request(), runtime="docker", image="example/engine:1")
    with pytest.raises(EngineError, match="offers no docker runtime"):
        await linked.link.start_deployment(request, 10.0)  # the agent did not advertise it
    linked.link.capabilities = linked.link.capabilities | {"runtime.docker"}
    await linked.link.start_deployment(request, 10.0, on_progress=lines.append)
    sent = linked.core.requests[-1]
    assert (sent.runtime, sent.image) == ("docker", "example/engine:1")
    assert lines == ["pulling example/engine:1: 3/7 layers done"]


async def test_a_slow_start_does_not_hold_up_other_traffic(linked: Linked) -> None:
    linked.core.start_delay_s = 2.0
    request = _start_request()
    start = asyncio.create_task(linked.link.start_deployment(request, 10.0))
    await asyncio.sleep(0.05)
    response = await asyncio.wait_for(_ask(linked), 1.0)
    await response.read()
    response.close()
    assert await asyncio.wait_for(linked.link.probe(DEPLOYMENT), 1.0) == "healthy"
    assert not start.done()
    await start


async def test_an_unknown_op_is_answered_unsupported(linked: Linked) -> None:
    defragment = Op("defragment", NoArgs, NoArgs)  # an op from a newer leader
    with pytest.raises(RemoteOpError) as caught:
        await linked.leader.call(defragment, NoArgs(), 5.0)
    assert caught.value.info.code == "unsupported"


async def test_a_lost_link_fails_waiting_requests_and_streams(linked: Linked) -> None:
    linked.core.start_delay_s = 30.0
    request = _start_request()
    start = asyncio.create_task(linked.link.start_deployment(request, 60.0))
    await asyncio.sleep(0.05)
    await linked.agent.close(4503, "going away")
    with pytest.raises(EngineError, match=r"lost|closed"):
        await asyncio.wait_for(start, 5)
    with pytest.raises(UpstreamConnectError):
        await _ask(linked)
    with pytest.raises(LinkError):
        await linked.leader.call(PROBE, ProbeArgs(deployment_id=DEPLOYMENT), 1.0)


# -- the handshake, as both ends run it -----------------------------------------------------------


def _hello(low: int = 1, high: int = 1) -> Hello:
    inventory = Inventory(hostname="gpu-host")
    return Hello(protocol_min=low, protocol_max=high, agent_version="t", inventory=inventory)


class Idle(LeaderSide):
    """A handler that holds each stream open until the link ends."""

    async def on_stream(self, conn: LinkConnection, stream: TunnelStream) -> None:
        await asyncio.Event().wait()


def _ends(agent_limits: LinkLimits | None = None) -> tuple[LinkConnection, LinkConnection]:
    agent_ws, leader_ws = memory_socket_pair()
    agent = LinkConnection(Role.AGENT, agent_ws, Idle(), peer="leader", limits=agent_limits)
    leader = LinkConnection(Role.LEADER, leader_ws, LeaderSide(), peer="n-1")
    return agent, leader


async def test_the_handshake_gives_each_end_the_others_greeting() -> None:
    agent, leader = _ends()
    admitted: list[str] = []

    async def admit(hello: Hello) -> None:
        admitted.append(hello.inventory.hostname)

    terms = WelcomeTerms(node_id="n-1", leader_version="9.9", heartbeat_interval_s=2.0)
    welcome, hello = await asyncio.gather(
        agent.handshake(_hello(), timeout_s=5.0),
        leader.handshake(terms, timeout_s=5.0, admit=admit, clock=lambda: 1234.5),
    )
    assert (welcome.node_id, welcome.leader_version, welcome.server_time) == ("n-1", "9.9", 1234.5)
    assert welcome.heartbeat_interval_s == 2.0
    assert hello.agent_version == "t" and admitted == ["gpu-host"]
    assert agent.protocol_version == leader.protocol_version == 1
    await agent.close(1000, "done")
    await asyncio.gather(agent.run(), leader.run())


async def test_a_refused_admission_closes_with_its_code_and_sends_no_welcome() -> None:
    agent, leader = _ends()

    async def admit(hello: Hello) -> None:
        raise LinkError("node n-1 was removed", code=CloseCode.NODE_REMOVED)

    terms = WelcomeTerms(node_id="n-1", leader_version="t")
    agent_end, leader_end = await asyncio.gather(
        agent.handshake(_hello(), timeout_s=5.0),
        leader.handshake(terms, timeout_s=5.0, admit=admit),
        return_exceptions=True,
    )
    assert isinstance(leader_end, LinkError) and leader_end.code is CloseCode.NODE_REMOVED
    assert isinstance(agent_end, LinkError) and not isinstance(agent_end, ProtocolError)
    assert agent.close_code == CloseCode.NODE_REMOVED
    assert agent.close_reason == "node n-1 was removed"
    assert agent.closed and leader.closed


async def test_no_common_version_closes_the_link_with_its_code_on_both_ends() -> None:
    agent, leader = _ends()
    terms = WelcomeTerms(node_id="n-1", leader_version="t")
    agent_end, leader_end = await asyncio.gather(
        agent.handshake(_hello(7, 9), timeout_s=5.0),
        leader.handshake(terms, timeout_s=5.0),
        return_exceptions=True,
    )
    assert isinstance(leader_end, ProtocolError)
    assert leader_end.code is CloseCode.UNSUPPORTED_VERSION
    assert isinstance(agent_end, LinkError)
    assert agent.close_code == CloseCode.UNSUPPORTED_VERSION


async def test_a_silent_leader_fails_the_agents_handshake_with_a_protocol_error() -> None:
    agent, leader = _ends()
    with pytest.raises(ProtocolError, match="did not answer Hello"):
        await agent.handshake(_hello(), timeout_s=0.05)
    assert agent.closed and agent.close_code == CloseCode.PROTOCOL_ERROR
    assert leader.ws.close_code == CloseCode.PROTOCOL_ERROR  # the leader hears why


async def test_a_stream_over_the_limit_is_refused_at_once() -> None:
    """The agent's session refuses a STREAM_OPEN over ``max_streams`` by itself; the reset
    goes out at once, not with whatever the link sends next."""
    agent_ws, leader_ws = memory_socket_pair()
    agent = LinkConnection(
        Role.AGENT, agent_ws, Idle(), peer="leader", limits=LinkLimits(max_streams=1)
    )
    leader = LinkSession(Role.LEADER)  # driven by hand: a leader that ignores the limit
    handshake = asyncio.create_task(agent.handshake(_hello(), timeout_s=5.0))
    leader.receive_message((await leader_ws.receive()).data)
    leader.accept(WelcomeTerms(node_id="n-1", leader_version="t"), server_time=0.0)
    for message in leader.data_to_send():
        await leader_ws.send_bytes(message)
    await handshake
    reader = asyncio.create_task(agent.run())
    held = StreamOpen(id=1, kind="logs", deployment_id="d")
    await leader_ws.send_bytes(encode_frame(held))
    await leader_ws.send_bytes(encode_frame(StreamOpen(id=2, kind="logs", deployment_id="d")))
    reply = await asyncio.wait_for(leader_ws.receive(), 5.0)
    refused = StreamReset(id=2, code=ResetCode.REFUSED, message="too many open streams")
    assert decode_frame(reply.data) == refused
    assert agent.open_streams == 1
    await agent.close(1000, "done")
    await reader


# -- pushed answers: from the link reader to a sink, no task per frame ------------------------


class _Collected:
    """A :class:`~berth.engine_http.answer.BodySink` that keeps what the link hands it."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.failure: Exception | None = None
        self.over = asyncio.Event()

    def body_received(self, data: bytes, end: bool) -> None:
        self.pieces.append(data)
        if end:
            self.over.set()

    def body_failed(self, error: Exception) -> None:
        self.failure = error
        self.over.set()


async def test_a_paused_pushed_answer_holds_the_engine_back_through_the_link(
    linked: Linked,
) -> None:
    event = b"data: " + b"x" * (16 * 1024 - 8) + b"\n\n"
    count = 1024  # 16 MiB, far more than the window and every buffer on the way
    linked.engine.script(Reply((Head(200, "text/event-stream"), *[Write(event)] * count)))
    response = await _ask(linked)
    record = await linked.engine.wait_for_request()
    sink = _Collected()
    response.push_body(sink)
    response.pause_body()  # a slow client: no credit goes back to the agent

    still, written = 0, -1
    while still < 50:  # the engine held up by backpressure, not a byte more for 50 polls
        assert not record.completed, "the whole answer crossed a link that granted no credit"
        if record.writing and record.bytes_written == written:
            still += 1
        else:
            still, written = 0, record.bytes_written
        await asyncio.sleep(0.01)
    assert written < count * len(event) // 2

    response.resume_body()
    await asyncio.wait_for(sink.over.wait(), 20.0)
    response.close()
    assert sink.failure is None
    assert b"".join(sink.pieces) == event * count
    assert record.completed


async def test_a_pushed_answer_silent_past_the_read_timeout_fails_and_reaches_the_engine(
    linked: Linked,
) -> None:
    linked.engine.script(Reply((Head(200, "text/event-stream"), Write(b"data: 1\n\n"), Stall(5.0))))
    request = EngineRequest("/v1/chat/completions", b"", [], b'{"model": "m"}')
    response = await linked.link.open_http(DEPLOYMENT, request, 0.2)
    sink = _Collected()
    response.push_body(sink)
    await asyncio.wait_for(sink.over.wait(), 5.0)
    assert b"".join(sink.pieces) == b"data: 1\n\n"
    assert isinstance(sink.failure, UpstreamTimeoutError)
    response.close()  # as the proxy does: the stream is reset, the agent closes the engine's
    record = linked.engine.requests[0]
    await asyncio.wait_for(record.disconnected.wait(), 5.0)
    assert not record.completed


async def test_the_engine_client_reads_a_cache_signal_through_the_tunnel(linked: Linked) -> None:
    class OverTheLink:
        async def open_http(self, node_id: str, deployment_id: str, *rest: Any) -> Any:
            return await linked.link.open_http(deployment_id, *rest)

    client = EngineClient(
        tunnels=OverTheLink(), connect_timeout_s=2, read_timeout_s=5, max_connections=4
    )
    await client.startup()
    try:
        linked.engine.script(json_reply([{"id": 0, "n_ctx": 2048}]))
        upstream = Upstream("", DEPLOYMENT, "n1", "m", engine="llamacpp", remote=True)
        body = await client.get(upstream, "/slots", limit_bytes=1024, timeout_s=5)
    finally:
        await client.shutdown()
    assert body == b'[{"id": 0, "n_ctx": 2048}]'
    (seen,) = linked.engine.requests
    assert (seen.method, seen.path) == ("GET", "/slots")
    assert seen.headers["authorization"] == f"Bearer {ENGINE_KEY}"  # the agent added it
    assert linked.service.meter.deployments() == []  # not a client's request


async def test_a_remote_upstream_is_reached_through_its_agent_whatever_its_base_url(
    linked: Linked,
) -> None:
    """Local or remote is the upstream's field, not its URL's scheme: a remote upstream with
    a plain http:// base URL (nothing listens there) still goes through the link."""

    class OverTheLink:
        def __init__(self) -> None:
            self.requests: list[EngineRequest] = []

        async def open_http(
            self, node_id: str, deployment_id: str, request: EngineRequest, timeout: float | None
        ) -> Any:
            self.requests.append(request)
            return await linked.link.open_http(deployment_id, request, timeout)

    opener = OverTheLink()
    client = EngineClient(tunnels=opener, connect_timeout_s=2, read_timeout_s=5, max_connections=4)
    await client.startup()
    try:
        linked.engine.script(json_reply({"ok": True}))
        upstream = Upstream("http://127.0.0.1:9", DEPLOYMENT, "n1", "m", remote=True)
        request = EngineRequest("/v1/chat/completions", b"x=1", [(b"x-a", b"\xe9")], b"{}")
        answer = await client.open(upstream, request)
        try:
            assert answer.status == 200
        finally:
            answer.close()
    finally:
        await client.shutdown()
    assert opener.requests == [request]
    (seen,) = linked.engine.requests
    assert (seen.method, seen.path, seen.query) == ("POST", "/v1/chat/completions", "x=1")
    # the header's one byte as it was sent (aiohttp reads it as UTF-8, surrogate-escaped)
    assert seen.headers["x-a"].encode("utf-8", "surrogateescape") == b"\xe9"
