"""LoRA adapters on the real engine: llama.cpp's ``llama-server`` with SmolLM2-135M, started
by a real daemon with two LoRA GGUFs the test writes for SmolLM2's shapes (the ``gguf``
package), each asked for by name through the OpenAI SDK.

With all-zero deltas the greedy answer is the base model's, token for token; with random
deltas it is not; and asking for the base model after an adapter still gets the base's.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import openai
import pytest

from berth.runtime.bundled import smollm2_gguf
from support.berth_cli import Berth, running_daemon
from support.cluster_harness import clean_env
from support.lora_gguf import write_lora_gguf

pytestmark = [pytest.mark.slow, pytest.mark.needs("llama-server", "smollm2")]

PROMPT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def lora_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    home = tmp_path_factory.mktemp("adapters-llamacpp")
    base = smollm2_gguf()
    assert base is not None
    zero = write_lora_gguf(base, home / "zero.gguf")
    noisy = write_lora_gguf(base, home / "noisy.gguf", scale=0.3, seed=1)
    berth = Berth(home, env=clean_env({}), cwd=home, timeout_s=600)
    with running_daemon(berth) as port:
        berth("models", "add", "smollm2", "--path", str(base))
        for name, path in (("smollm2-zero", zero), ("smollm2-noisy", noisy)):
            added = berth("adapters", "add", name, "--base", "smollm2", "--path", str(path))
            assert f"added adapter {name} of smollm2 (gguf, rank 8)" in added.stdout
        berth("run", "smollm2", "--engine", "llamacpp", "--ctx", "512")
        key = berth.json("key", "create", "adapters", "--tier", "standard")
        tls = ssl.create_default_context(cafile=str(home / "ca" / "ca.pem"))
        with openai.DefaultHttpxClient(verify=tls) as http:
            yield openai.OpenAI(
                base_url=f"https://127.0.0.1:{port}/v1",
                api_key=key["secret"],
                http_client=http,
                max_retries=0,
            )


def greedy(lora_client: openai.OpenAI, model: str) -> str:
    answer = lora_client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=16, temperature=0, seed=7
    )
    return answer.choices[0].message.content or ""


def test_zero_deltas_answer_as_the_base_and_others_do_not(lora_client: openai.OpenAI) -> None:
    listed = {m.id: (m.model_extra or {}).get("parent") for m in lora_client.models.list()}
    assert listed == {"smollm2": None, "smollm2-zero": "smollm2", "smollm2-noisy": "smollm2"}
    base = greedy(lora_client, "smollm2")
    assert base.strip()
    assert greedy(lora_client, "smollm2-zero") == base
    assert greedy(lora_client, "smollm2-noisy") != base
    assert greedy(lora_client, "smollm2") == base  # the adapter asked for last does not linger
