"""Engines only berth can reach: each engine's own API key, how each engine is told it (never
on its command line), the header berth's client and the agent's relay send (never the
client's own credential), the journal that keeps keys for a restarted agent (mode 0600), and
adopted servers told their key.  The core-level tests run the fake llama-server, which checks
the key as llama-server does."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from berth.agent.adopted import AdoptedWatcher, load_adopted, read_api_key, store_api_key
from berth.agent.core import AgentCore
from berth.agent.engine_launch import ENGINE_KEY_PREFIX, new_engine_key
from berth.agent.journal import EngineJournal, JournalEntry
from berth.engine_http.auth import bearer_header, with_engine_key
from berth.errors import ConfigError
from berth.runtime.base import REDACTED, printable_command
from berth.runtime.engine_container import build_container_spec
from berth.runtime.engines import (
    CONTAINER_KEY_FILE,
    EngineBinaries,
    build_launch_spec,
    find_free_port,
)
from berth.runtime.gpu import StaticInventory
from berth.runtime.process import ProcessRuntime
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import EngineName
from support.cluster_harness import FAKE_ENGINE, fake_engine_wrapper

KEY = "berth-ek-Secret_Key-0123456789"
BINARIES = EngineBinaries(llama_server="/bin/llama-server", vllm="/bin/vllm", sglang_python="py")


def _request(tmp_path: Path, engine: EngineName, **fields: object) -> DeploymentRequest:
    model = tmp_path / ("m.gguf" if engine == "llamacpp" else "checkpoint")
    if engine == "llamacpp":
        model.write_bytes(b"GGUF")
    else:
        model.mkdir(exist_ok=True)
    values: dict[str, object] = {
        "deployment_id": "d-0000beef",
        "model_name": "m",
        "model_path": model,
        "engine": engine,
        "port": 41000,
        "log_path": tmp_path / "engine.log",
        "api_key": KEY,
    }
    values.update(fields)
    return DeploymentRequest(**values)  # type: ignore[arg-type]


# -- how each engine is told its key ---------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "variable"), [("llamacpp", "LLAMA_API_KEY"), ("vllm", "VLLM_API_KEY")]
)
def test_llamacpp_and_vllm_read_the_key_from_their_environment(
    tmp_path: Path, engine: EngineName, variable: str
) -> None:
    spec = build_launch_spec(_request(tmp_path, engine), BINARIES)

    assert spec.environment()[variable] == KEY
    assert spec.api_key == KEY
    assert all(KEY not in arg for arg in spec.argv)
    assert KEY not in repr(spec) and KEY not in repr(_request(tmp_path, engine))


def test_sglang_reads_the_key_from_a_config_file_named_on_its_command_line(
    tmp_path: Path,
) -> None:
    spec = build_launch_spec(_request(tmp_path, "sglang"), BINARIES, secrets_dir=tmp_path / "k")

    (secret,) = spec.secret_files
    assert secret.path.parent == tmp_path / "k"
    assert secret.content == f'api-key: "{KEY}"\n'
    assert spec.argv[spec.argv.index("--config") + 1] == str(secret.path)
    assert all(KEY not in arg for arg in spec.argv) and not spec.secret_env
    assert KEY not in repr(spec)


def test_containers_get_the_key_in_their_environment_or_a_mounted_file(
    tmp_path: Path,
) -> None:
    llama = build_container_spec(_request(tmp_path, "llamacpp"), "img:1", shm_size="1g")
    sglang = build_container_spec(
        _request(tmp_path, "sglang"), "img:1", shm_size="1g", secrets_dir=tmp_path / "k"
    )

    assert llama.environment() == {"LLAMA_API_KEY": KEY}
    assert all(KEY not in arg for arg in llama.argv)
    (secret,) = sglang.secret_files
    assert sglang.container is not None
    mount = sglang.container.mounts[-1]
    assert (mount.source, mount.target, mount.read_only) == (secret.path, CONTAINER_KEY_FILE, True)
    assert sglang.argv[sglang.argv.index("--config") + 1] == CONTAINER_KEY_FILE


@pytest.mark.parametrize(
    ("engine", "extra"),
    [
        ("llamacpp", ("--api-key", "mine")),
        ("vllm", ("--api-key=mine",)),
        ("sglang", ("--config", "my.yaml")),
    ],
)
def test_extra_arguments_cannot_set_the_engines_key(
    tmp_path: Path, engine: EngineName, extra: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError, match="is refused"):
        build_launch_spec(
            _request(tmp_path, engine, extra_args=extra), BINARIES, secrets_dir=tmp_path
        )


def test_printed_command_lines_hide_key_values() -> None:
    shown = printable_command(["llama-server", "--api-key", "k1", "--api-key=k2", "--port", "1"])

    assert shown == f"llama-server --api-key {REDACTED} --api-key={REDACTED} --port 1"


def test_new_keys_are_distinct_and_fit_in_a_header() -> None:
    first, second = new_engine_key(), new_engine_key()

    assert first != second and first.startswith(ENGINE_KEY_PREFIX)
    assert bearer_header(first) == (b"authorization", b"Bearer " + first.encode())
    with pytest.raises(ValueError):
        bearer_header("two words")


def test_a_clients_credentials_are_replaced_by_the_engines_key() -> None:
    received = [
        (b"Authorization", b"Bearer sk-berth-client"),
        (b"x-api-key", b"sk-berth-client"),
        (b"Cookie", b"session=1"),
        (b"content-type", b"application/json"),
    ]

    sent = with_engine_key(received, bearer_header(KEY))

    assert sent == [(b"content-type", b"application/json"), bearer_header(KEY)]
    assert with_engine_key(received, None) == [(b"content-type", b"application/json")]


# -- the journal -------------------------------------------------------------------------------


def test_the_journal_keeps_keys_and_cgroups_readable_only_by_its_owner(tmp_path: Path) -> None:
    journal = EngineJournal(tmp_path / "agent-engines.json")
    entry = JournalEntry(4242, 41000, "/health", api_key=KEY, cgroup="/berth/d-0000beef")

    journal.save({"d-0000beef": entry})

    assert stat.S_IMODE(journal.path.stat().st_mode) == 0o600
    assert journal.load() == {"d-0000beef": entry}
    assert KEY not in repr(entry)
    old = json.dumps({"d-1": {"pid": 1, "port": 2, "health_path": "/health"}}).encode()
    journal.path.write_bytes(old)
    assert journal.load()["d-1"].api_key is None


# -- the agent core with the fake llama-server -----------------------------------------------


def _core(tmp_path: Path) -> AgentCore:
    binaries = EngineBinaries(
        llama_server=str(fake_engine_wrapper(tmp_path)), vllm=None, sglang_python=sys.executable
    )
    return AgentCore(
        ProcessRuntime(poll_interval_s=0.05),
        binaries,
        StaticInventory([]),
        logs_dir=tmp_path / "logs",
        journal_path=tmp_path / "agent-engines.json",
    )


async def test_an_engine_answers_only_with_its_key_which_survives_a_restart(
    tmp_path: Path,
) -> None:
    core = _core(tmp_path)
    request = _request(tmp_path, "llamacpp", port=0, api_key=None, deployment_id="d-0000c0de")
    handle = await core.start(request, health_timeout_s=20)
    try:
        auth = core.engine_auth("d-0000c0de")
        assert auth is not None and handle.api_key is not None
        assert auth == bearer_header(handle.api_key)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=handle.base_url, trust_env=False) as client:
            assert (await client.get("/health")).status_code == 200
            for path in ("/props", "/slots", "/v1/models"):
                assert (await client.get(path)).status_code == 401, path
            refused = await client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 401
            headers = {"Authorization": auth[1].decode()}
            answered = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert answered.status_code == 200
        assert await core.probe("d-0000c0de") == "healthy"
        cmdline = Path(f"/proc/{handle.pid}/cmdline").read_bytes()
        assert handle.api_key.encode() not in cmdline
        assert handle.api_key not in core.log_path("d-0000c0de").read_text()
        journal = tmp_path / "agent-engines.json"
        assert stat.S_IMODE(journal.stat().st_mode) == 0o600
        assert json.loads(journal.read_text())["d-0000c0de"]["api_key"] == handle.api_key
        core.close()

        restarted = _core(tmp_path)  # the agent restarts; the engine runs on
        assert await restarted.restore() == ["d-0000c0de"]
        assert restarted.engine_auth("d-0000c0de") == auth
        assert await restarted.probe("d-0000c0de") == "healthy"
        await restarted.stop("d-0000c0de", grace_s=5)
        restarted.close()
    finally:
        # The first core still holds the engine as its child (reaped here, not leaked).
        await core.stop_all(grace_s=5)


async def test_two_engines_get_different_keys(tmp_path: Path) -> None:
    core = _core(tmp_path)
    try:
        for deployment_id in ("d-0000aaaa", "d-0000bbbb"):
            request = _request(tmp_path, "llamacpp", port=0, deployment_id=deployment_id)
            await core.start(request, health_timeout_s=20)
        assert core.engine_auth("d-0000aaaa") != core.engine_auth("d-0000bbbb")
        assert core.engine_auth("d-unknown0") is None
    finally:
        await core.stop_all(grace_s=5)
        core.close()


# -- adopted servers ---------------------------------------------------------------------------


def test_an_adopted_servers_key_is_read_from_its_file_and_kept_private(tmp_path: Path) -> None:
    given = tmp_path / "given.key"
    given.write_text("# the key of my vLLM\n\n  sk-outside-1  \n")

    key = read_api_key(given)
    kept = store_api_key(tmp_path / "adopted-keys", "outside", key)

    assert key == "sk-outside-1"
    assert kept.read_text() == "sk-outside-1\n"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    empty = tmp_path / "empty.key"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        read_api_key(empty)


async def test_the_watcher_probes_an_adopted_server_with_its_key(tmp_path: Path) -> None:
    port = find_free_port()
    engine = await _serve_fake(tmp_path, port, key="sk-outside-2")
    try:
        kept = store_api_key(tmp_path / "adopted-keys", "outside", "sk-outside-2")
        adopted = tmp_path / "adopted.yaml"
        adopted.write_text(
            f"- name: outside\n  host: 127.0.0.1\n  port: {port}\n  served_model_name: smol\n"
            f"  engine_model: smol\n  api_key_file: {kept}\n"
        )
        assert load_adopted(adopted)[0].api_key_file == str(kept)
        watcher = AdoptedWatcher(adopted)

        await watcher.check_once()

        assert [s.alive for s in watcher.states()] == [True]
        assert watcher.auth("adopted:outside") == bearer_header("sk-outside-2")
        assert watcher.auth("adopted:other") is None

        kept.write_text("sk-wrong\n")
        mistaken = AdoptedWatcher(adopted)
        await mistaken.check_once()
        assert [s.alive for s in mistaken.states()] == [False]
    finally:
        engine.terminate()
        engine.wait()


async def _serve_fake(tmp_path: Path, port: int, *, key: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, str(FAKE_ENGINE), "-m", "x.gguf", "--port", str(port), "--alias", "smol"],
        stdout=subprocess.DEVNULL,
        env={**os.environ, "LLAMA_API_KEY": key},
    )
    async with httpx.AsyncClient(trust_env=False) as client:
        for _ in range(200):
            try:
                await client.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.TransportError:
                await asyncio.sleep(0.05)
    return process
