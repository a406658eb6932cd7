"""The whole cluster with real parts: a leader and two agents (separate processes and
``BERTH_HOME``s) on loopback with real TLS, enrolled by URI, each running llama.cpp's
``llama-server`` with SmolLM2-135M, and the OpenAI SDK streaming through the leader to each.
Then ``berth nodes remove`` cuts a live agent off, and a killed agent restarted rejoins.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator

import anthropic
import openai
import pytest

from berth.agent.exit_status import EXIT_REENROLL
from berth.runtime.bundled import smollm2_gguf
from support.cluster_harness import Cluster, started_cluster

pytestmark = [pytest.mark.slow, pytest.mark.needs("llama-server", "smollm2")]

LABELS = ("gpu-a", "gpu-b")


@pytest.fixture(scope="module")
def smollm2_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = smollm2_gguf()
    assert model is not None
    with started_cluster(tmp_path_factory.mktemp("e2e-cluster"), fake_engine=False) as cluster:
        for label in LABELS:
            agent = cluster.add_agent(label)
            cluster.deploy(f"smollm2-{label}", model, agent, "--ctx", "2048")
        yield cluster


@pytest.mark.parametrize("label", LABELS)
def test_the_openai_sdk_streams_a_real_model_through_each_agent(
    smollm2_cluster: Cluster, label: str
) -> None:
    with smollm2_cluster.openai() as client:
        stream = client.chat.completions.create(
            model=f"smollm2-{label}",
            messages=[{"role": "user", "content": "Say hello in three words."}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text.strip(), "the model produced no text"
    assert usage is not None and usage.completion_tokens > 0


def test_the_anthropic_sdk_creates_and_streams_through_an_agent(
    smollm2_cluster: Cluster,
) -> None:
    # llama-server answers /v1/messages itself: berth passes it through the agent's tunnel.
    cluster = smollm2_cluster
    ask = {"model": "smollm2-gpu-a", "max_tokens": 8,
           "messages": [{"role": "user", "content": "Count to three."}]}  # fmt: skip
    with anthropic.Anthropic(
        base_url=cluster.base_url,
        api_key=cluster.api_key,
        http_client=anthropic.DefaultHttpxClient(verify=cluster.tls()),
        max_retries=0,
    ) as client:
        whole = client.messages.create(**ask)  # type: ignore[arg-type]
        with client.messages.stream(**ask) as stream:  # type: ignore[arg-type]
            texts = list(stream.text_stream)
            final = stream.get_final_message()
        counted = client.messages.count_tokens(model="smollm2-gpu-a", messages=ask["messages"])  # type: ignore[arg-type]
    assert whole.type == "message" and whole.content[0].text  # type: ignore[union-attr]
    assert texts and "".join(texts) == final.content[0].text  # type: ignore[union-attr]
    assert counted.input_tokens > 0 and whole.usage.output_tokens > 0


def test_remove_cuts_a_live_agent_off(smollm2_cluster: Cluster) -> None:
    agent = smollm2_cluster.agents["gpu-a"]
    assert agent.process is not None
    started = time.monotonic()
    smollm2_cluster.berth("nodes", "remove", "gpu-a")
    agent.process.wait(timeout=30)
    elapsed = time.monotonic() - started
    sys.stderr.write(f"agent exited {elapsed:.2f} s after 'berth nodes remove'\n")
    assert agent.process.returncode == EXIT_REENROLL  # its unit does not restart it
    agent.process = None
    with smollm2_cluster.http() as http:
        refused = http.post(
            "/v1/chat/completions",
            json={"model": "smollm2-gpu-a", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert refused.status_code == 503


def test_a_killed_agent_restarted_rejoins_and_serves(smollm2_cluster: Cluster) -> None:
    agent = smollm2_cluster.agents["gpu-b"]
    assert agent.process is not None
    agent.process.send_signal(signal.SIGKILL)
    agent.process.wait()
    smollm2_cluster.wait_node(agent.node_id, "unreachable")

    smollm2_cluster.start_agent(agent)

    deadline = time.monotonic() + 30
    while True:
        with smollm2_cluster.openai() as client:
            try:
                answer = client.chat.completions.create(
                    model="smollm2-gpu-b",
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=8,
                )
                break
            except openai.APIStatusError as exc:  # 503 until the node is routed to again
                if exc.status_code != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    assert answer.choices[0].message.content
