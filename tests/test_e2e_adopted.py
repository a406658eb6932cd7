"""Adopted endpoints on real parts: a llama.cpp server started outside berth on an agent's
host (real llama-server, SmolLM2), adopted with the real CLI, answering the OpenAI SDK through
the leader by its served name; killed, it leaves ``/v1/models`` within 30 s and requests get
a 503 naming it; restarted, it serves again.  The leader's own host adopts a server too."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from berth.runtime.bundled import smollm2_gguf
from berth.runtime.engines import EngineBinaries, find_free_port
from support.cluster_harness import FAKE_ENGINE, Agent, Cluster, cli, started_cluster
from support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.needs("llama-server", "smollm2")]

SERVED = "smol-outside"


class OutsideServer:
    """A llama-server berth did not start, on a fixed port so it can come back there."""

    def __init__(self, port: int, log: Path, alias: str = SERVED) -> None:
        self.port = port
        self.log = log
        self.alias = alias
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = EngineBinaries.detect().llama_server
        model = smollm2_gguf()
        assert binary is not None and model is not None
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                 "--alias", self.alias, "-c", "2048"],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        # Adopting asks /v1/models, which llama-server answers 503 while it loads the model:
        # an operator adopts a server that is up, so the test waits for that first.
        wait_for(self._healthy, 60, f"the outside llama-server on port {self.port} to load")

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with started_cluster(tmp_path_factory.mktemp("e2e-adopted"), fake_engine=False) as cluster:
        yield cluster


def _wait_listed(cluster: Cluster, name: str, present: bool, timeout_s: float) -> float:
    started = time.monotonic()
    while (name in cluster.served_models()) != present:
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{name} {'not ' if present else ''}listed after {timeout_s} s")
        time.sleep(0.25)
    return time.monotonic() - started


def _chat(cluster: Cluster, model: str) -> str:
    with cluster.openai() as client:
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
    return answer.choices[0].message.content or ""


def test_an_adopted_server_serves_drops_out_when_killed_and_comes_back(
    real_cluster: Cluster, tmp_path: Path
) -> None:
    agent: Agent = real_cluster.add_agent("gpu-a")
    server = OutsideServer(find_free_port(), tmp_path / "outside.log")
    server.start()
    try:
        adopt = cli(agent.home, "agent", "adopt", "--port", str(server.port), "--model", SERVED,
                    "--gpus", "0", env=real_cluster.env, timeout_s=60)  # fmt: skip
        assert f"as {SERVED}" in adopt.stdout, adopt.stdout
        _wait_listed(real_cluster, SERVED, True, 30)
        assert _chat(real_cluster, SERVED).strip()
        listed = json.loads(
            cli(agent.home, "agent", "adopted", "--json", env=real_cluster.env).stdout
        )
        assert [(e["name"], e["alive"], e["gpus"]) for e in listed] == [(SERVED, True, [0])]

        server.kill()
        gone_after_s = _wait_listed(real_cluster, SERVED, False, 30)
        with pytest.raises(openai.APIStatusError) as refused:
            _chat(real_cluster, SERVED)
        assert refused.value.status_code == 503
        assert f"adopted endpoint does not answer ({SERVED} on node" in str(refused.value)

        server.start()
        _wait_listed(real_cluster, SERVED, True, 40)
        assert _chat(real_cluster, SERVED).strip()
        print(f"dropped out of /v1/models {gone_after_s:.1f} s after it was killed")

        cli(agent.home, "agent", "unadopt", SERVED, env=real_cluster.env)
        _wait_listed(real_cluster, SERVED, False, 20)
        assert server.process is not None and server.process.poll() is None  # never stopped
        missing = cli(agent.home, "agent", "unadopt", SERVED, env=real_cluster.env, check=False)
        assert missing.returncode != 0
        assert f"no adopted server is named '{SERVED}'" in missing.stderr
    finally:
        server.kill()


def test_adopting_where_nothing_listens_is_refused_with_the_reason(real_cluster: Cluster) -> None:
    port = find_free_port()
    refused = real_cluster.berth("agent", "adopt", "--port", str(port), "--model", "x", check=False)
    assert refused.returncode != 0
    assert f"nothing answers at http://127.0.0.1:{port}/v1/models" in refused.stderr
    assert not (real_cluster.leader_home / "adopted.yaml").exists()


def test_the_leaders_own_host_adopts_too(real_cluster: Cluster) -> None:
    port = find_free_port()
    fake = subprocess.Popen(
        [sys.executable, str(FAKE_ENGINE), "-m", "x.gguf", "--port", str(port),
         "--alias", "fake-outside"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            adopt = real_cluster.berth("agent", "adopt", "--port", str(port),
                                       "--model", "fake-outside", "--name", "fake",
                                       check=False)  # fmt: skip
            if adopt.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert adopt.returncode == 0, adopt.stderr
        _wait_listed(real_cluster, "fake-outside", True, 30)
        assert "fake llama-server" in _chat(real_cluster, "fake-outside")
    finally:
        fake.kill()
        fake.wait()
        real_cluster.berth("agent", "unadopt", "fake", check=False)


def test_the_anthropic_sdk_is_translated_to_an_adopted_server(
    real_cluster: Cluster, tmp_path: Path
) -> None:
    """An adopted endpoint's engine kind is not known to serve /v1/messages: the Messages
    API is translated to its /v1/chat/completions, whole and streamed, and the usage ledger
    counts what llama-server reported."""
    alias = "smol-messages"
    server = OutsideServer(find_free_port(), tmp_path / "messages.log", alias)
    server.start()
    try:

        def adopted() -> bool:
            adopt = real_cluster.berth("agent", "adopt", "--port", str(server.port),
                                       "--model", alias, "--name", alias, check=False)  # fmt: skip
            return adopt.returncode == 0

        wait_for(adopted, 120, "llama-server answering /v1/models", interval_s=0.5)
        _wait_listed(real_cluster, alias, True, 30)
        with anthropic.Anthropic(
            base_url=real_cluster.base_url,
            api_key=real_cluster.api_key,
            http_client=anthropic.DefaultHttpxClient(verify=real_cluster.tls()),
            max_retries=0,
        ) as client:
            ask = {
                "model": alias,
                "max_tokens": 8,
                "system": "You answer briefly.",
                "messages": [{"role": "user", "content": "Count to three."}],
            }
            whole = client.messages.create(**ask)  # type: ignore[arg-type]
            with client.messages.stream(**ask) as stream:  # type: ignore[arg-type]
                texts = list(stream.text_stream)
                final = stream.get_final_message()
            with pytest.raises(anthropic.BadRequestError) as refused:
                client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})  # type: ignore[arg-type]
        assert whole.type == "message" and whole.model == alias
        assert whole.stop_reason in ("max_tokens", "end_turn")
        assert whole.content[0].text  # type: ignore[union-attr]
        assert texts and "".join(texts) == final.content[0].text  # type: ignore[union-attr]
        assert final.stop_reason in ("max_tokens", "end_turn")
        assert "extended thinking is not supported" in refused.value.message

        def prompt(usage: anthropic.types.Usage) -> int:
            return usage.input_tokens + (usage.cache_read_input_tokens or 0)

        assert prompt(whole.usage) > 0 and prompt(whole.usage) == prompt(final.usage)
        assert 0 < whole.usage.output_tokens <= 8 and 0 < final.usage.output_tokens <= 8
        report = json.loads(real_cluster.berth("usage", "--model", alias, "--json").stdout)
        total = report["total"]
        assert (total["requests"], total["estimated_requests"]) == (2, 0)
        assert total["prompt_tokens"] == prompt(whole.usage) + prompt(final.usage)
        assert total["completion_tokens"] == whole.usage.output_tokens + final.usage.output_tokens
        cached = (whole.usage.cache_read_input_tokens or 0) + (
            final.usage.cache_read_input_tokens or 0
        )
        assert total["cached_tokens"] == cached
    finally:
        server.kill()
        real_cluster.berth("agent", "unadopt", alias, check=False)
