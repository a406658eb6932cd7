"""The cluster on loopback with real TLS sockets: a leader daemon and agents as processes.

Engines are ``tests/fake_llama_server.py`` behind a ``llama-server`` wrapper, so the module
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

from berth.cluster.protocol.errors import CloseCode
from berth.cluster.protocol.frames import Heartbeat, encode_frame
from cluster_harness import Agent, Cluster, clean_env, fake_engine_wrapper, rss_mb
from fake_llama_server import ANSWER, CLIENT_GONE
from hub_standin import HubStandin

MiB = 1024 * 1024


HUB_REPO = "org/tiny-remote"


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStandin]:
    with HubStandin() as standin:
        standin.add_repo(HUB_REPO, {"tiny.gguf": b"GGUF" + bytes(range(256)) * 4})
        yield standin


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, hub: HubStandin) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    wrapper = fake_engine_wrapper(root)
    (root / "tiny.gguf").write_bytes(b"GGUF" + bytes(60))
    env = clean_env(
        {
            "BERTH_LLAMA_SERVER_BIN": str(wrapper),
            "BERTH_STOP_GRACE_S": "5",
            # Shorter than the 5 s / 15 s defaults so that silence is tested in seconds.
            "BERTH_HEARTBEAT_INTERVAL_S": "0.5",
            "BERTH_NODE_TIMEOUT_S": "2",
            # The leader and the agents pull from the same local hub stand-in.
            "HF_ENDPOINT": hub.url,
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
    )
    cluster = Cluster(root, env)
    cluster.start()
    try:
        for label in ("gpu-a", "gpu-b"):
            agent = cluster.add_agent(label)
            cluster.deploy(f"tiny-{label}", root / "tiny.gguf", agent)
        yield cluster
    finally:
        cluster.close()


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
def test_the_openai_sdk_streams_through_each_agent(cluster: Cluster, label: str) -> None:
    with cluster.openai() as client:
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


def test_nodes_ls_shows_both_agents_ready(cluster: Cluster) -> None:
    listed = json.loads(cluster.berth("nodes", "ls", "--json").stdout)
    status = {node["label"]: node["status"] for node in listed}
    assert status["local"] == "ready"
    assert status["gpu-a"] == status["gpu-b"] == "ready"


def test_an_8_mib_request_body_crosses_the_tunnel(cluster: Cluster) -> None:
    content = "x" * (8 * MiB)
    with cluster.http() as http:
        response = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-gpu-a", "messages": [{"role": "user", "content": content}]},
        )
    assert response.status_code == 200, response.text
    assert response.json()["x_received_bytes"] > 8 * MiB


def test_200_mb_stream_to_a_slow_client_keeps_the_leader_bounded(cluster: Cluster) -> None:
    total = 200 * 1000 * 1000
    leader = cluster.leader_pid()
    body = {"model": "tiny-gpu-b", "messages": [], "stream": True, "x_bulk_bytes": total}
    with (
        cluster.http(timeout_s=120) as http,
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


def test_a_client_that_leaves_cancels_the_engine_request(cluster: Cluster) -> None:
    body = {"model": "tiny-gpu-a", "messages": [], "stream": True, "x_events": 200,
            "x_event_delay_s": 0.05}  # fmt: skip
    with (
        cluster.http() as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert next(response.iter_lines()).startswith("data: ")
    deployment = _deployment_of(cluster, "tiny-gpu-a")
    deadline = time.monotonic() + 10
    while CLIENT_GONE not in cluster.berth("logs", deployment).stdout:
        assert time.monotonic() < deadline, "the engine never saw the client leave"
        time.sleep(0.2)


def _wait_served(cluster: Cluster, model: str, timeout_s: float = 10) -> None:
    """Wait until a chat request for ``model`` gets a 200 (the node is routed to again)."""
    deadline = time.monotonic() + timeout_s
    with cluster.http() as http:
        while True:
            answer = http.post("/v1/chat/completions", json={"model": model, "messages": []})
            if answer.status_code == 200:
                return
            assert time.monotonic() < deadline, f"{model} is still not served: {answer.text}"
            time.sleep(0.2)


def _deployment_of(cluster: Cluster, model: str) -> str:
    for record in cluster.admin("GET", "/admin/deployments"):
        if record["served_model_name"] == model and record["state"] == "ready":
            return str(record["id"])
    raise AssertionError(f"no ready deployment of {model}")


def test_logs_of_a_remote_deployment(cluster: Cluster) -> None:
    logs = cluster.berth("logs", _deployment_of(cluster, "tiny-gpu-b")).stdout
    assert "fake llama-server listening on" in logs


# -- refusals ------------------------------------------------------------------------------------


def test_no_client_certificate_is_refused(cluster: Cluster) -> None:
    code = asyncio.run(_first_close(cluster, _client_tls(cluster, None), None))
    assert code == CloseCode.BAD_CERTIFICATE


def test_a_certificate_from_another_ca_fails_the_tls_handshake(
    cluster: Cluster, tmp_path: Path
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
    tls = _client_tls(cluster, None)
    tls.load_cert_chain(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    upgrade = (
        b"GET /cluster/agent HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    with (
        socket.create_connection(("127.0.0.1", cluster.cluster_port), timeout=10) as raw,
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
    cluster: Cluster, message: bytes, code: int
) -> None:
    agent = cluster.agents["gpu-a"]
    closed = asyncio.run(_first_close(cluster, _client_tls(cluster, agent), message))
    assert closed == code
    # The node's real link was not disturbed.
    assert cluster.node(agent.node_id)["status"] == "ready"
    with cluster.openai() as client:
        answer = client.chat.completions.create(
            model="tiny-gpu-a", messages=[{"role": "user", "content": "hi"}]
        )
    assert answer.choices[0].message.content == ANSWER


def test_remove_cuts_a_live_agent_off_and_its_certificate_stops_working(
    cluster: Cluster,
) -> None:
    agent = cluster.add_agent("gpu-c")
    cluster.deploy("tiny-gpu-c", cluster.root / "tiny.gguf", agent)
    assert agent.process is not None

    status_file = agent.home / "agent-status.json"
    started = time.monotonic()
    cluster.admin("DELETE", "/admin/nodes/gpu-c")
    while "4403" not in json.loads(status_file.read_text() or "{}").get("last_error", ""):
        assert time.monotonic() - started < 10, "the agent was never told it was removed"
        time.sleep(0.01)
    cut_off_s = time.monotonic() - started
    agent.process.wait(timeout=15)
    print(f"link cut {cut_off_s:.3f} s after the removal; agent exited after "
          f"{time.monotonic() - started:.2f} s")  # fmt: skip
    # The bound: a removed node's live link is gone within a second.
    assert cut_off_s < 1.0

    assert agent.process.returncode == 1
    assert "4403" in agent.status(cluster.env)["last_error"]
    record = cluster.deployment(_deployment_id_of(cluster, "tiny-gpu-c"))
    assert record["state"] == "failed" and "removed" in record["failure_reason"]
    with cluster.http() as http:
        answer = http.post("/v1/chat/completions", json={"model": "tiny-gpu-c", "messages": []})
    assert answer.status_code == 503
    code = asyncio.run(_first_close(cluster, _client_tls(cluster, agent), None))
    assert code == CloseCode.NODE_REMOVED
    agent.process = None


def _deployment_id_of(cluster: Cluster, model: str) -> str:
    records = cluster.admin("GET", "/admin/deployments")
    return str(next(r["id"] for r in records if r["served_model_name"] == model))


def test_a_killed_agent_restarted_rejoins_with_its_engines(cluster: Cluster) -> None:
    agent = cluster.agents["gpu-b"]
    deployment = _deployment_of(cluster, "tiny-gpu-b")
    assert agent.process is not None
    agent.process.send_signal(signal.SIGKILL)
    agent.process.wait()
    cluster.wait_node(agent.node_id, "unreachable")
    with cluster.http() as http:
        refused = http.post("/v1/chat/completions", json={"model": "tiny-gpu-b", "messages": []})
    assert refused.status_code == 503
    assert f"unreachable nodes ({agent.node_id})" in refused.json()["error"]["message"]
    listed = cluster.berth("ps").stdout
    assert "gpu-b" in listed and "ready (node unreachable)" in listed

    cluster.start_agent(agent)

    _wait_served(cluster, "tiny-gpu-b")
    assert cluster.deployment(deployment)["state"] == "ready"


def test_a_silent_node_becomes_unreachable_and_returns_when_it_says_hello(
    cluster: Cluster,
) -> None:
    agent = cluster.agents["gpu-a"]
    assert agent.process is not None
    agent.process.send_signal(signal.SIGSTOP)  # alive, connected, and silent
    try:
        cluster.wait_node(agent.node_id, "unreachable", timeout_s=10)
        with cluster.http() as http:
            refused = http.post(
                "/v1/chat/completions", json={"model": "tiny-gpu-a", "messages": []}
            )
        assert refused.status_code == 503
    finally:
        agent.process.send_signal(signal.SIGCONT)
    cluster.wait_node(agent.node_id, "ready", timeout_s=30)
    _wait_served(cluster, "tiny-gpu-a")


def test_a_model_pulled_on_the_leader_is_pulled_by_the_agent_it_runs_on(
    cluster: Cluster,
) -> None:
    agent = cluster.agents["gpu-b"]
    cluster.berth("pull", HUB_REPO)
    ran = cluster.berth("run", HUB_REPO, "--node", "gpu-b", "--engine", "llamacpp")
    assert "ready" in ran.stdout, ran.stdout
    pulled = agent.home / "models" / "org--tiny-remote" / "tiny.gguf"
    assert pulled.read_bytes().startswith(b"GGUF")
    (model,) = [m for m in cluster.admin("GET", "/admin/models") if m["name"] == HUB_REPO]
    assert model["locations"][agent.node_id] == str(pulled.parent), model
    _wait_served(cluster, HUB_REPO)
