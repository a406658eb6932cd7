"""On demand with the real parts: a leader daemon running llama.cpp's ``llama-server`` with
SmolLM2-135M, and the OpenAI SDK.

The service is cold (``--min-replicas 0``, the default): the first request through its
route starts the engine, waits at the leader until it is ready, and streams the answer; the
time from the request to the first token is printed (``docs/benchmarks.md``).  After its
idle timeout the controller stops the deployment, the engine process is gone, and the audit
log says why.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from berth.runtime.bundled import smollm2_gguf
from support.cluster_harness import Cluster, started_cluster
from support.processes import wait_gone
from support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.needs("llama-server", "smollm2")]

MESSAGES = [{"role": "user", "content": "Say hello in three words."}]


def first_token_s(cluster: Cluster, model: str) -> tuple[float, str]:
    """Seconds from sending a streamed chat request for ``model`` to its first token, and
    the whole answer."""
    with cluster.openai() as client:
        started = time.monotonic()
        stream = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        first: float | None = None
        parts = []
        for chunk in stream:
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                first = first if first is not None else time.monotonic() - started
                parts.append(text)
    assert first is not None, "the model produced no text"
    return first, "".join(parts)


def test_the_first_sdk_request_loads_a_cold_service_and_its_engine_goes_when_idle(
    tmp_path: Path,
) -> None:
    model = smollm2_gguf()
    assert model is not None
    settings = {"BERTH_SCALING_INTERVAL_S": "0.25"}
    with started_cluster(tmp_path, settings, fake_engine=False) as cluster:
        cluster.berth("models", "add", "smollm2", str(model))
        cluster.berth("service", "create", "smol", "--model", "smollm2", "--ctx", "2048",
                      "--idle-timeout", "4s")  # fmt: skip
        cluster.berth("route", "create", "chat", "--service", "smol")
        assert cluster.admin("GET", "/admin/deployments?active=true") == []

        cold_s, text = first_token_s(cluster, "chat")
        warm_s, _ = first_token_s(cluster, "chat")
        sys.stderr.write(
            f"SmolLM2 on llama-server: first token {cold_s:.2f} s after the request on a cold "
            f"service (the engine loaded on demand), {warm_s:.3f} s once loaded\n"
        )
        assert text.strip()
        (deployment,) = cluster.admin("GET", "/admin/deployments?active=true")
        assert deployment["service"] == "smol" and deployment["state"] == "ready"
        pid = deployment["pid"]
        assert pid

        stopped = wait_for(
            lambda: cluster.deployment(deployment["id"])["state"] == "stopped",
            60,
            "the idle deployment to stop",
        )
        assert stopped
        assert wait_gone(pid, 30), f"engine process {pid} still runs"
        audit_log = cluster.leader_home / "logs" / "audit.log"
        audit = [json.loads(line) for line in audit_log.read_text().splitlines()]
        (unloaded,) = [e for e in audit if e.get("event") == "deployment_unloaded"]
        assert unloaded["deployment"] == deployment["id"] and unloaded["service"] == "smol"
        assert unloaded["reason"].startswith("idle: no request for 4s (idle timeout 4s)")
        shown = cluster.berth("service", "show", "smol").stdout
        assert "replicas: none" in shown and "last decision: stop" in shown
