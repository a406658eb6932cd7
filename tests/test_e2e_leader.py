"""berth's main job on real parts: the real CLI, a real daemon on real TLS sockets, llama.cpp's
llama-server started by berth on the SmolLM2 GGUF, and the official OpenAI SDK with a key."""

from __future__ import annotations

import json
import os
import signal
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from berth.runtime.bundled import smollm2_gguf
from support.berth_cli import Berth, running_daemon
from support.cluster_harness import clean_env
from support.processes import alive, wait_gone

pytestmark = [pytest.mark.slow, pytest.mark.needs("llama-server", "smollm2")]


@pytest.fixture(scope="module")
def real_leader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Berth, int]]:
    home = tmp_path_factory.mktemp("leader-home")
    # A berth run of the real engine waits for it to load: minutes on a loaded machine.
    berth = Berth(home, env=clean_env({}), cwd=home, timeout_s=600)
    with running_daemon(berth) as port:
        yield berth, port


@pytest.fixture(scope="module")
def deployment(real_leader: tuple[Berth, int]) -> dict[str, object]:
    berth, _port = real_leader
    berth("models", "add", "smollm2", "--path", str(smollm2_gguf()))
    berth(
        "run",
        "smollm2",
        "--engine",
        "llamacpp",
        "-x",
        "--embeddings",
        "-x",
        "--pooling",
        "-x",
        "mean",
    )
    (record,) = berth.json("ps")  # type: ignore[misc]
    assert record["state"] == "ready"
    return record  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def openai_client(
    real_leader: tuple[Berth, int], deployment: dict[str, object]
) -> Iterator[object]:
    berth, port = real_leader
    key = berth.json("key", "create", "e2e", "--tier", "standard")
    tls = ssl.create_default_context(cafile=str(berth.home / "ca" / "ca.pem"))
    with openai.DefaultHttpxClient(verify=tls) as http:
        yield openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1",
            api_key=key["secret"],  # type: ignore[index]
            http_client=http,
        )


def test_streamed_chat_completion(openai_client: openai.OpenAI) -> None:
    stream = openai_client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert text.strip()
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0


def test_chat_completion(openai_client: openai.OpenAI) -> None:
    answer = openai_client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=24
    )
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens > 0


def test_completion(openai_client: openai.OpenAI) -> None:
    answer = openai_client.completions.create(model="smollm2", prompt="The sky is", max_tokens=8)
    assert answer.choices[0].text
    assert answer.usage is not None and answer.usage.completion_tokens > 0


def test_embedding(openai_client: openai.OpenAI) -> None:
    result = openai_client.embeddings.create(model="smollm2", input="berth routes requests")
    assert len(result.data[0].embedding) > 100


def test_responses(openai_client: openai.OpenAI) -> None:
    response = openai_client.responses.create(
        model="smollm2", input="Say hello.", max_output_tokens=24
    )
    assert response.output_text
    assert response.usage is not None and response.usage.output_tokens > 0


def test_models_and_errors(openai_client: openai.OpenAI) -> None:
    assert [m.id for m in openai_client.models.list()] == ["smollm2"]
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )


def test_metrics_count_tokens(real_leader: tuple[Berth, int], openai_client: openai.OpenAI) -> None:
    berth, port = real_leader
    openai_client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    key = openai_client.api_key
    tls = ssl.create_default_context(cafile=str(berth.home / "ca" / "ca.pem"))
    with httpx.Client(verify=tls) as http:
        text = http.get(
            f"https://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {key}"}
        ).text
        samples = {
            (sample.name, sample.labels.get("model")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        assert samples[("berth_proxy_prompt_tokens_total", "smollm2")] > 0
        assert samples[("berth_proxy_completion_tokens_total", "smollm2")] > 0
        assert http.get(f"https://127.0.0.1:{port}/metrics").status_code == 401


def test_logs_show_the_engine_output(
    real_leader: tuple[Berth, int], deployment: dict[str, object]
) -> None:
    berth, _port = real_leader
    out = berth("logs", str(deployment["id"]), "--tail", "200").stdout
    # A line only the engine writes: llama-server says where it listens once the model is
    # loaded. berth's own header line ("=== berth ...") holds the command line, which names
    # llama-server and the port, but not this.
    listening = f"listening on http://127.0.0.1:{deployment['port']}"
    engine_lines = [line for line in out.splitlines() if not line.startswith("=== berth")]
    assert any(listening in line for line in engine_lines), out
    missing = berth("logs", "d-00000000", check=False)
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_the_engine_answers_only_berth_which_keeps_its_key_private(
    real_leader: tuple[Berth, int], deployment: dict[str, object], openai_client: openai.OpenAI
) -> None:
    berth, _port = real_leader
    engine = f"http://127.0.0.1:{deployment['port']}"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=engine, trust_env=False, timeout=60) as direct:
        assert direct.get("/health").status_code == 200  # llama-server keeps it public
        for path in ("/props", "/slots", "/v1/models"):
            assert direct.get(path).status_code == 401, path
        assert direct.post("/v1/chat/completions", json=chat).status_code == 401
    through_berth = openai_client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert through_berth.choices[0].message.content is not None

    journal = berth.home / "local-engines.json"
    assert journal.stat().st_mode & 0o777 == 0o600
    key = json.loads(journal.read_text())[str(deployment["id"])]["api_key"]
    with httpx.Client(base_url=engine, trust_env=False, timeout=60) as direct:
        keyed = direct.get("/props", headers={"Authorization": f"Bearer {key}"})
        assert keyed.status_code == 200
    assert key not in berth("ps", "--all", "--json").stdout
    assert key not in berth("logs", str(deployment["id"]), "--tail", "100000").stdout
    assert key.encode() not in Path(f"/proc/{deployment['pid']}/cmdline").read_bytes()
    # Every file under logs/ (engines' empty working folders, engine-cwd/<id>, sit there too).
    for log in (berth.home / "logs").rglob("*"):
        if log.is_file():
            assert key not in log.read_text(errors="replace"), log


def test_the_usage_ledger_equals_what_llama_server_reported(
    real_leader: tuple[Berth, int], deployment: dict[str, object]
) -> None:
    berth, port = real_leader
    secret = berth.json("key", "create", "ledger")["secret"]
    tls = ssl.create_default_context(cafile=str(berth.home / "ca" / "ca.pem"))
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to three."}]}
    ask |= {"max_tokens": 6, "temperature": 0.0, "seed": 1}
    with (
        openai.DefaultHttpxClient(verify=tls) as http,
        openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1", api_key=secret, http_client=http
        ) as client,
    ):
        whole = client.chat.completions.create(**ask).usage
        asked = [
            chunk.usage
            for chunk in client.chat.completions.create(
                **ask, stream=True, stream_options={"include_usage": True}
            )
            if chunk.usage is not None
        ]
        # The same request without asking: berth asks llama-server for the usage and keeps
        # that event from the client; at temperature 0 it is the same count again.
        unasked = list(client.chat.completions.create(**ask, stream=True))
    assert whole is not None and len(asked) == 1
    assert all(chunk.usage is None for chunk in unasked)
    (row,) = berth.json("usage", "--key", "ledger", "--by", "key")["rows"]

    assert row["requests"] == 3 and row["estimated_requests"] == 0
    assert row["prompt_tokens"] == whole.prompt_tokens + 2 * asked[0].prompt_tokens
    assert row["completion_tokens"] == whole.completion_tokens + 2 * asked[0].completion_tokens


def test_crash_reconcile_and_stop_leaves_no_engine(
    real_leader: tuple[Berth, int], deployment: dict[str, object], openai_client: openai.OpenAI
) -> None:
    berth, port = real_leader
    engine_pid = int(deployment["pid"])  # type: ignore[call-overload]
    daemon_pid = int((berth.home / "daemon.pid").read_text())
    os.kill(daemon_pid, signal.SIGKILL)  # a crash: no chance to stop the engine
    assert wait_gone(daemon_pid, 30.0)
    assert alive(engine_pid), "the engine should outlive a crashed daemon"

    berth("daemon", "start", "--public-port", str(port))
    (record,) = berth.json("ps")  # type: ignore[misc]
    assert record["id"] == deployment["id"] and record["state"] == "ready"
    answer = openai_client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content is not None

    berth("daemon", "stop")
    assert wait_gone(engine_pid, 30.0), "stopping the daemon must stop its engines"
    berth("daemon", "start", "--public-port", str(port))
    # Ended a moment ago: still listed by ps, as stopped (none is active any more).
    (listed,) = berth.json("ps")  # type: ignore[misc]
    assert listed["id"] == deployment["id"] and listed["state"] == "stopped"
    (stopped,) = berth.json("ps", "--all")  # type: ignore[misc]
    assert stopped["state"] == "stopped"
