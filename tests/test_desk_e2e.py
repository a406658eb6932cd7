"""End to end on real parts: ``berth desk register`` and ``berth desk serve`` as CLI processes,
the stand-in desk over real TLS, a real leader, and llama.cpp's ``llama-server`` on SmolLM2
answering a plain and a sealed job through the leader's router.

One engine start for the module; the jobs are queued before ``serve`` starts, so they are
claimed at once. The finish must carry the engine's own token counts, and no file under the
home (logs, database, desk files) may hold either prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from berth.runtime.bundled import smollm2_gguf
from berth.runtime.engines import find_free_port
from support.berth_cli import Berth
from support.cluster_harness import clean_env
from support.desk_harness import DeskServe, files_containing
from support.desk_standin import ThreadedDeskStandin

pytestmark = [pytest.mark.slow, pytest.mark.needs("llama-server", "smollm2")]

PLAIN_PROMPT = "Name one colour of the rainbow. (plain marker 5d0c)"
SEALED_PROMPT = "Name one planet of the solar system. (sealed marker e61b)"


@pytest.fixture(scope="module")
def desk_e2e_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("desk-e2e")


@pytest.fixture(scope="module")
def real_desk_leader(
    desk_e2e_dir: Path, tls_desk: tuple[ThreadedDeskStandin, Path]
) -> Iterator[Berth]:
    _, ca_file = tls_desk
    berth = Berth(
        desk_e2e_dir / "home", env=clean_env({"SSL_CERT_FILE": str(ca_file)}), cwd=desk_e2e_dir
    )
    berth("daemon", "start", "--public-port", str(find_free_port()),
          "--cluster-port", str(find_free_port()))  # fmt: skip
    try:
        berth("models", "add", "smollm2", "--path", str(smollm2_gguf()))
        # A job carries no max_tokens (the protocol leaves it to the caller), and SmolLM2
        # sampled at the server's default temperature now and then rambles to the end of its
        # context (about 1 answer in 200: minutes at CI's speed); the engine's own cap keeps
        # every answer short, as an operator would set it.
        berth("run", "smollm2", "--engine", "llamacpp", "-x", "--n-predict", "-x", "96")
        yield berth
    finally:
        berth("daemon", "stop", check=False)


def prompt_tokens_of(berth: Berth, prompt: str) -> int:
    """What the engine counts for ``prompt`` as a job sends it (asked directly)."""
    transport = httpx.HTTPTransport(uds=str(berth.home / "berth.sock"))
    with httpx.Client(transport=transport, base_url="http://berth", timeout=60) as client:
        answer = client.post("/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1, "stream": False,
        })  # fmt: skip
    answer.raise_for_status()
    return int(answer.json()["usage"]["prompt_tokens"])


def test_register_and_serve_answer_plain_and_sealed_jobs_on_llama_cpp(
    real_desk_leader: Berth, tls_desk: tuple[ThreadedDeskStandin, Path], desk_e2e_dir: Path
) -> None:
    standin, _ = tls_desk
    registered = real_desk_leader("desk", "register", "--pool-url", standin.url, "--price", "90")
    assert "smollm2: registered, node code N001, price 90 cents" in registered.stdout

    plain = standin.add_job("smollm2", PLAIN_PROMPT)
    sealed = standin.add_job("smollm2", SEALED_PROMPT, sealed=True)
    serve = DeskServe(real_desk_leader, desk_e2e_dir / "serve.out")
    try:
        outcomes = {job: standin.wait_outcome(job, timeout_s=120) for job in (plain, sealed)}
    finally:
        code = serve.stop()
    output = serve.text()
    assert code == 0, output

    for job, prompt in ((plain, PLAIN_PROMPT), (sealed, SEALED_PROMPT)):
        outcome = outcomes[job]
        assert outcome.kind == "finish", output
        assert outcome.body["output"].strip()
        assert outcome.body["completion_tokens"] > 0
        assert outcome.body["prompt_tokens"] == prompt_tokens_of(real_desk_leader, prompt)
        assert f"job {job} (smollm2): finished: {outcome.body['prompt_tokens']} prompt + " \
            f"{outcome.body['completion_tokens']} completion tokens" in output  # fmt: skip

    pulses = standin.node_for("smollm2").pulses
    assert pulses and pulses[0]["slots"] == 1 and pulses[0]["models"] == ["smollm2"]
    gpus = json.loads(real_desk_leader("nodes", "show", "local", "--json").stdout)["gpus"]
    assert (pulses[0]["chip"] is None) == (not gpus)

    for marker in ("5d0c", "e61b"):
        assert marker not in output
        assert files_containing(real_desk_leader.home, marker) == [], "a prompt was written to disk"
