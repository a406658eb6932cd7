"""The docker runtime on a real Docker engine: a locally built llama-server image serving
SmolLM2 in a container, an image that cannot be pulled, a container that exits, and a new
runtime finding a running container by its labels."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from berth.errors import EngineError
from berth.runtime.base import EngineExit, LaunchSpec
from berth.runtime.bundled import smollm2_gguf
from berth.runtime.docker import DockerRuntime, resolve_docker_host
from berth.runtime.docker.network import ENGINE_NETWORK
from berth.runtime.engine_container import build_container_spec
from berth.vocab.deployment_request import DeploymentRequest
from support.docker_support import berth_containers
from support.installed import check_needs
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

pytestmark = [pytest.mark.slow, pytest.mark.docker]


@pytest.fixture
def runtime(tmp_path: Path, docker_client: Any) -> Iterator[DockerRuntime]:
    runtime = DockerRuntime(
        host=resolve_docker_host(None), home=tmp_path, node_id="local", poll_interval_s=0.1
    )
    yield runtime
    for container in berth_containers(docker_client, home=str(tmp_path)):
        container.remove(force=True)  # nothing a failed test started outlives it
    runtime.close()


def _spec(tmp_path: Path, image: str, *extra: str, api_key: str | None = None) -> LaunchSpec:
    check_needs(("smollm2",))
    model = smollm2_gguf()
    assert model is not None
    request = DeploymentRequest(
        deployment_id=f"d-{secrets.token_hex(4)}",
        model_name="smollm2",
        model_path=model,
        engine="llamacpp",
        port=0,
        log_path=tmp_path / "engine.log",
        ctx=2048,
        extra_args=extra,
        api_key=api_key,
    )
    return build_container_spec(request, image, shm_size="256m")


async def test_an_engine_container_serves_and_is_removed_on_stop(
    runtime: DockerRuntime, docker_client: Any, engine_image: str, tmp_path: Path
) -> None:
    key = f"berth-ek-{secrets.token_urlsafe(16)}"
    spec = _spec(tmp_path, engine_image, api_key=key)
    handle = await runtime.start(spec)
    await runtime.wait_healthy(handle, spec, timeout_s=120)
    container = docker_client.containers.get(handle.container_id)
    assert container.name == f"berth-{spec.deployment_id}"
    # On berth's network, where containers cannot reach each other.
    assert list(container.attrs["NetworkSettings"]["Networks"]) == [ENGINE_NETWORK]
    network = docker_client.networks.get(ENGINE_NETWORK).attrs
    assert network["Driver"] == "bridge"
    assert network["Options"]["com.docker.network.bridge.enable_icc"] == "false"
    assert key not in " ".join(container.attrs["Config"]["Cmd"])
    assert container.labels["berth.deployment"] == spec.deployment_id
    assert container.labels["berth.model"] == "smollm2"
    assert container.labels["berth.node"] == "local"
    assert container.labels["berth.home"] == str(tmp_path)
    host_config = container.attrs["HostConfig"]
    assert host_config["PortBindings"] == {"8080/tcp": [{"HostIp": "127.0.0.1", "HostPort": ""}]}
    assert host_config["ShmSize"] == 256 * 1024 * 1024
    [mount] = container.attrs["Mounts"]
    assert (mount["Destination"], mount["RW"]) == ("/models", False)
    assert handle.host == "127.0.0.1" and handle.port > 0 and handle.pid > 0
    assert runtime.is_alive(handle)

    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    async with httpx.AsyncClient(base_url=handle.base_url, trust_env=False) as http:
        assert (await http.get("/health")).status_code == 200
        for path in ("/props", "/slots"):
            assert (await http.get(path)).status_code == 401, path
        refused = await http.post("/v1/chat/completions", json=chat, timeout=60)
        assert refused.status_code == 401
        answer = await http.post(
            "/v1/chat/completions",
            json=chat,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
    assert answer.status_code == 200, answer.text
    assert await runtime.check_health(handle, "/health", 5.0)
    assert answer.json()["choices"][0]["message"]["content"]

    await runtime.stop(handle, grace_s=5)
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(handle.container_id)
    assert not runtime.is_alive(handle)
    log_text = spec.log_path.read_text()
    assert (
        f"container berth-{spec.deployment_id} from {engine_image} on network {ENGINE_NETWORK}"
        in (log_text)
    )
    assert key not in log_text
    assert "slot" in log_text  # the engine's own output
    await runtime.stop(handle, grace_s=5)  # a container already gone is not an error


async def test_an_image_that_cannot_be_pulled_fails_with_the_reason_and_leaves_nothing(
    runtime: DockerRuntime, docker_client: Any, tmp_path: Path
) -> None:
    spec = _spec(tmp_path, "berth-test/never-built-anywhere:1")
    progress: list[str] = []
    with pytest.raises(EngineError, match="cannot pull image berth-test/never-built-anywhere:1"):
        await runtime.start(spec, progress.append)
    assert progress and progress[0].startswith("pulling berth-test/never-built-anywhere:1")
    assert berth_containers(docker_client, deployment=spec.deployment_id) == []
    assert "cannot pull image" in spec.log_path.read_text()


async def test_a_container_that_exits_fails_with_its_exit_code_and_output(
    runtime: DockerRuntime, docker_client: Any, engine_image: str, tmp_path: Path
) -> None:
    spec = _spec(tmp_path, engine_image, "--no-such-flag")
    handle = await runtime.start(spec)
    with pytest.raises(EngineError, match="container exited with code") as failure:
        await runtime.wait_healthy(handle, spec, timeout_s=60)
    assert "no-such-flag" in (failure.value.log_tail or "")
    await runtime.stop(handle, grace_s=1)
    assert berth_containers(docker_client, deployment=spec.deployment_id) == []


async def test_a_new_runtime_finds_a_running_container_by_its_labels(
    runtime: DockerRuntime, docker_client: Any, engine_image: str, tmp_path: Path
) -> None:
    spec = _spec(tmp_path, engine_image)
    handle = await runtime.start(spec)
    await runtime.wait_healthy(handle, spec, timeout_s=120)
    host = resolve_docker_host(None)
    after_restart = DockerRuntime(host=host, home=tmp_path, node_id="local")
    assert await after_restart.owned() == [spec.deployment_id]
    found = await after_restart.attach(spec.deployment_id, tmp_path / "engine.log")
    assert found is not None
    assert (found.container_id, found.port, found.pid) == (
        handle.container_id,
        handle.port,
        handle.pid,
    )
    assert after_restart.is_alive(found)
    # Another home (another leader or agent on this host) owns none of it.
    stranger = DockerRuntime(host=host, home=tmp_path / "other", node_id="local")
    assert await stranger.owned() == []
    assert await stranger.attach(spec.deployment_id, tmp_path / "other.log") is None
    await after_restart.stop(found, grace_s=5)
    assert berth_containers(docker_client, deployment=spec.deployment_id) == []
    assert await after_restart.attach(spec.deployment_id, tmp_path / "engine.log") is None


async def test_a_container_killed_is_heard_from_the_events_stream(
    runtime: DockerRuntime, docker_client: Any, engine_image: str, tmp_path: Path
) -> None:
    """``docker kill`` of a ready engine's container: the runtime hears Docker's ``die``
    event, with the exit code (137: SIGKILL), without a poll (issue 37)."""
    spec = _spec(tmp_path, engine_image)
    handle = await runtime.start(spec)
    await runtime.wait_healthy(handle, spec, timeout_s=120)
    heard: list[EngineExit | None] = []
    runtime.watch_exit(handle, heard.append)
    docker_client.containers.get(handle.container_id).kill()
    await wait_for_async(lambda: heard, EVENT_TIMEOUT_S, "the container's die event")
    assert heard == [EngineExit(code=137)]
    assert not runtime.is_alive(handle)
    await runtime.stop(handle, grace_s=1)
