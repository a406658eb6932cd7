"""The cluster on loopback with real TLS sockets: a leader daemon and agents as processes.

Engines are ``tests/support/fake_llama_server.py`` behind a ``llama-server`` wrapper, so the module
runs in seconds; ``test_e2e_cluster.py`` does the same with the real llama.cpp server.
What is checked is what a user would see: OpenAI SDK traffic through the tunnel, refusals
with typed close codes, large bodies with bounded leader memory, cancellation reaching the
engine, removal and rejoining.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from berth.agent.exit_status import EXIT_REENROLL
from berth.cluster.protocol.errors import CloseCode
from berth.cluster.protocol.frames import Heartbeat, encode_frame
from support.cluster_harness import Agent, Cluster, rss_mb, started_cluster
from support.fake_llama_server import ANSWER, CLIENT_GONE
from support.hub_standin import HubStandin
from support.waiting import EVENT_TIMEOUT_S, wait_for

MiB = 1024 * 1024


HUB_REPO = "org/tiny-remote"  # published by the shared hub fixture (conftest.py)


@pytest.fixture(scope="module")
def two_node_cluster(
    tmp_path_factory: pytest.TempPathFactory, hub: HubStandin
) -> Iterator[Cluster]:
    settings = {
        "BERTH_STOP_GRACE_S": "5",
        # Shorter than the 5 s / 15 s defaults so that silence is tested in seconds, yet
        # several heartbeats long, so that a loaded machine does not drop a live link.
        "BERTH_HEARTBEAT_INTERVAL_S": "1",
        "BERTH_NODE_TIMEOUT_S": "6",
        # The leader and the agents pull from the same local hub stand-in.
        "HF_ENDPOINT": hub.url,
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    with started_cluster(tmp_path_factory.mktemp("cluster"), settings) as cluster:
        for label in ("gpu-a", "gpu-b"):
            agent = cluster.add_agent(label)
            cluster.deploy(f"tiny-{label}", cluster.root / "tiny.gguf", agent)
        yield cluster


def _ws_url(cluster: Cluster) -> str:
    return f"wss://127.0.0.1:{cluster.cluster_port}/cluster/agent"


def _client_tls(cluster: Cluster, agent: Agent | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cluster.leader_home / "ca" / "ca.pem"))
    if agent is not None:
        context.load_cert_chain(str(agent.cert), str(agent.key))
    return context


async def _first_close(cluster: Cluster, tls: ssl.SSLContext, send: bytes | None) -> int | None:
    """Dial the agent endpoint, send one message, return the close code the leader sends."""
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(_ws_url(cluster), ssl=tls, max_msg_size=0) as ws,
    ):
        if send is not None:
            await ws.send_bytes(send)
        message = await ws.receive(timeout=15)
        assert message.type is aiohttp.WSMsgType.CLOSE, message
        code = ws.close_code
    # aiohttp's advice: give SSL transports a moment to shut down before the loop closes.
    await asyncio.sleep(0.25)
    return code


# -- traffic -------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["gpu-a", "gpu-b"])
def test_the_openai_sdk_streams_through_each_agent(two_node_cluster: Cluster, label: str) -> None:
    with two_node_cluster.openai() as client:
        stream = client.chat.completions.create(
            model=f"tiny-{label}",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == ANSWER

        answer = client.chat.completions.create(
            model=f"tiny-{label}", messages=[{"role": "user", "content": "hi"}]
        )
        assert answer.choices[0].message.content == ANSWER


def test_nodes_ls_shows_both_agents_ready(two_node_cluster: Cluster) -> None:
    listed = json.loads(two_node_cluster.berth("nodes", "ls", "--json").stdout)
    status = {node["label"]: node["status"] for node in listed}
    assert status["local"] == "ready"
    assert status["gpu-a"] == status["gpu-b"] == "ready"
    # Agents started without --advertise: their requests travel through the tunnel, and
    # the leader says why.
    path = {node["label"]: node["data_path"] for node in listed}
    assert path == {"local": "local", "gpu-a": "tunnel", "gpu-b": "tunnel"}
    shown = two_node_cluster.berth("nodes", "show", "gpu-a").stdout
    assert "tunnel: the agent advertises no address" in shown


def test_an_8_mib_request_body_crosses_the_tunnel(two_node_cluster: Cluster) -> None:
    content = "x" * (8 * MiB)
    with two_node_cluster.http() as http:
        response = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-gpu-a", "messages": [{"role": "user", "content": content}]},
        )
    assert response.status_code == 200, response.text
    assert response.json()["x_received_bytes"] > 8 * MiB


def test_200_mb_stream_to_a_slow_client_keeps_the_leader_bounded(two_node_cluster: Cluster) -> None:
    total = 200 * 1000 * 1000
    leader = two_node_cluster.leader_pid()
    body = {
        "model": "tiny-gpu-b",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "x_bulk_bytes": total,
    }
    with (
        two_node_cluster.http(timeout_s=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_raw(64 * 1024)
        received = 0
        before = rss_mb(leader)
        peak = before
        # Read slowly for a while: the engine produces far faster than this.
        for _ in range(20):
            received += len(next(chunks))
            time.sleep(0.1)
            peak = max(peak, rss_mb(leader))
        for chunk in chunks:
            received += len(chunk)
    assert received >= total
    growth = peak - before
    print(f"leader RSS {before:.0f} MiB -> peak {peak:.0f} MiB while reading slowly")
    assert growth < 64, f"leader grew {growth:.0f} MiB buffering a slow reader"


def test_a_client_that_leaves_cancels_the_engine_request(two_node_cluster: Cluster) -> None:
    body = {"model": "tiny-gpu-a", "messages": [{"role": "user", "content": "hi"}],
            "stream": True, "x_events": 200, "x_event_delay_s": 0.05}  # fmt: skip
    with (
        two_node_cluster.http() as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert next(response.iter_lines()).startswith("data: ")
    deployment = _deployment_of(two_node_cluster, "tiny-gpu-a")
    wait_for(
        lambda: CLIENT_GONE in two_node_cluster.berth("logs", deployment).stdout,
        EVENT_TIMEOUT_S,
        "the engine to see the client leave",
        interval_s=0.2,
    )


def _wait_served(cluster: Cluster, model: str, timeout_s: float = 60) -> None:
    """Wait until a chat request for ``model`` gets a 200 (the node is routed to again)."""
    with cluster.http() as http:

        def served() -> bool:
            answer = http.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            )
            return answer.status_code == 200

        wait_for(served, timeout_s, f"{model} to be served again", interval_s=0.2)


def _deployment_of(cluster: Cluster, model: str) -> str:
    for record in cluster.admin("GET", "/admin/deployments"):
        if record["served_model_name"] == model and record["state"] == "ready":
            return str(record["id"])
    raise AssertionError(f"no ready deployment of {model}")


def test_logs_of_a_remote_deployment(two_node_cluster: Cluster) -> None:
    logs = two_node_cluster.berth("logs", _deployment_of(two_node_cluster, "tiny-gpu-b")).stdout
    assert "fake llama-server listening on" in logs


# -- refusals ------------------------------------------------------------------------------------


def test_no_client_certificate_is_refused(two_node_cluster: Cluster) -> None:
    code = asyncio.run(_first_close(two_node_cluster, _client_tls(two_node_cluster, None), None))
    assert code == CloseCode.BAD_CERTIFICATE


def test_a_certificate_from_another_ca_fails_the_tls_handshake(
    two_node_cluster: Cluster, tmp_path: Path
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n-00000000")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    tls = _client_tls(two_node_cluster, None)
    tls.load_cert_chain(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    upgrade = (
        b"GET /cluster/agent HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    with (
        socket.create_connection(("127.0.0.1", two_node_cluster.cluster_port), timeout=10) as raw,
        tls.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        # TLS 1.3: the client's side of the handshake ends before the leader checks the
        # certificate; the refusal (an alert, or the connection closed) shows on first read.
        try:
            conn.sendall(upgrade)
            answer = conn.recv(1024)
        except (ssl.SSLError, ConnectionError):
            answer = b""
    assert answer == b"", f"the leader answered a foreign certificate: {answer!r}"


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (b"\x09" + b"\x00" * (2 * MiB), 1009),  # over the 1 MiB frame limit
        (b"\x01\x00\x00\x00\x00\x00\x00\x00\x00\x05{oops", CloseCode.PROTOCOL_ERROR),
        (encode_frame(Heartbeat(sent_at=1.0)), CloseCode.PROTOCOL_ERROR),  # not Hello
    ],
    ids=["oversized", "malformed", "not-hello-first"],
)
def test_a_misbehaving_link_is_closed_and_the_others_carry_on(
    two_node_cluster: Cluster, message: bytes, code: int
) -> None:
    agent = two_node_cluster.agents["gpu-a"]
    closed = asyncio.run(
        _first_close(two_node_cluster, _client_tls(two_node_cluster, agent), message)
    )
    assert closed == code
    # The node's real link was not disturbed.
    assert two_node_cluster.node(agent.node_id)["status"] == "ready"
    with two_node_cluster.openai() as client:
        answer = client.chat.completions.create(
            model="tiny-gpu-a", messages=[{"role": "user", "content": "hi"}]
        )
    assert answer.choices[0].message.content == ANSWER


def test_remove_cuts_a_live_agent_off_and_its_certificate_stops_working(
    two_node_cluster: Cluster,
) -> None:
    agent = two_node_cluster.add_agent("gpu-c")
    two_node_cluster.deploy("tiny-gpu-c", two_node_cluster.root / "tiny.gguf", agent)
    assert agent.process is not None

    status_file = agent.home / "agent-status.json"
    two_node_cluster.admin("DELETE", "/admin/nodes/gpu-c")
    # The live link is cut (close code 4403) at once; how fast is measured by
    # scripts/bench_removal.py, not asserted here.
    wait_for(
        lambda: "4403" in json.loads(status_file.read_text() or "{}").get("last_error", ""),
        EVENT_TIMEOUT_S,
        "the agent to be told it was removed (close code 4403)",
    )
    agent.process.wait(timeout=EVENT_TIMEOUT_S)

    assert agent.process.returncode == EXIT_REENROLL  # its unit does not restart it
    assert "4403" in agent.status(two_node_cluster.env)["last_error"]
    record = two_node_cluster.deployment(_deployment_id_of(two_node_cluster, "tiny-gpu-c"))
    assert record["state"] == "failed" and "removed" in record["failure_reason"]
    with two_node_cluster.http() as http:
        answer = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-gpu-c", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert answer.status_code == 503
    code = asyncio.run(_first_close(two_node_cluster, _client_tls(two_node_cluster, agent), None))
    assert code == CloseCode.NODE_REMOVED
    agent.process = None


def _deployment_id_of(cluster: Cluster, model: str) -> str:
    records = cluster.admin("GET", "/admin/deployments")
    return str(next(r["id"] for r in records if r["served_model_name"] == model))


def test_a_killed_agent_restarted_rejoins_with_its_engines(two_node_cluster: Cluster) -> None:
    agent = two_node_cluster.agents["gpu-b"]
    deployment = _deployment_of(two_node_cluster, "tiny-gpu-b")
    assert agent.process is not None
    agent.process.send_signal(signal.SIGKILL)
    agent.process.wait()
    two_node_cluster.wait_node(agent.node_id, "unreachable")
    with two_node_cluster.http() as http:
        refused = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-gpu-b", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert refused.status_code == 503
    assert f"unreachable nodes ({agent.node_id})" in refused.json()["error"]["message"]
    listed = two_node_cluster.berth("ps").stdout
    assert "gpu-b" in listed and "ready (node unreachable)" in listed

    two_node_cluster.start_agent(agent)

    _wait_served(two_node_cluster, "tiny-gpu-b")
    assert two_node_cluster.deployment(deployment)["state"] == "ready"


def test_a_silent_node_becomes_unreachable_and_returns_when_it_says_hello(
    two_node_cluster: Cluster,
) -> None:
    agent = two_node_cluster.agents["gpu-a"]
    assert agent.process is not None
    agent.process.send_signal(signal.SIGSTOP)  # alive, connected, and silent
    try:
        two_node_cluster.wait_node(agent.node_id, "unreachable")
        with two_node_cluster.http() as http:
            refused = http.post(
                "/v1/chat/completions",
                json={"model": "tiny-gpu-a", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert refused.status_code == 503
    finally:
        agent.process.send_signal(signal.SIGCONT)
    two_node_cluster.wait_node(agent.node_id, "ready")
    _wait_served(two_node_cluster, "tiny-gpu-a")


def test_a_model_pulled_on_the_leader_is_pulled_by_the_agent_it_runs_on(
    two_node_cluster: Cluster,
) -> None:
    agent = two_node_cluster.agents["gpu-b"]
    two_node_cluster.berth("pull", HUB_REPO)
    ran = two_node_cluster.berth("run", HUB_REPO, "--node", "gpu-b", "--engine", "llamacpp")
    assert "ready" in ran.stdout, ran.stdout
    pulled = agent.home / "models" / "org--tiny-remote" / "tiny.gguf"
    assert pulled.read_bytes().startswith(b"GGUF")
    (model,) = [m for m in two_node_cluster.admin("GET", "/admin/models") if m["name"] == HUB_REPO]
    assert model["locations"][agent.node_id] == str(pulled.parent), model
    _wait_served(two_node_cluster, HUB_REPO)
