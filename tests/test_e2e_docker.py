"""Engines in containers, end to end on real parts: a leader (real CLI, real TLS) on a real
Docker engine, a llama-server image built locally serving SmolLM2, the OpenAI SDK through the
leader, a daemon killed and restarted with containers left running, an image that cannot be
pulled, and an agent starting a container on its own host."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import docker
import pytest

from berth.runtime.bundled import smollm2_gguf
from support.cluster_harness import Cluster, started_cluster
from support.docker_support import berth_containers
from support.processes import wait_gone

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.needs("smollm2")]

MODEL = "smollm2"


@pytest.fixture(scope="module")
def docker_cluster(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any
) -> Iterator[Cluster]:
    model = smollm2_gguf()
    assert model is not None
    root = tmp_path_factory.mktemp("e2e-docker")
    try:
        with started_cluster(root, fake_engine=False) as cluster:
            cluster.berth("models", "add", MODEL, str(model))
            yield cluster
    finally:
        # Once the cluster has stopped: the containers of every berth home it had.
        for container in berth_containers(docker_client):
            if container.labels.get("berth.home", "").startswith(str(root)):
                container.remove(force=True)


def _run(cluster: Cluster, image: str, *extra: str) -> str:
    ran = cluster.berth("run", MODEL, "--runtime", "docker", "--image", image, "--ctx", "2048",
                        *extra)  # fmt: skip
    found = re.search(r"\bd-[0-9a-f]{8}\b", ran.stdout)
    assert found and "ready" in ran.stdout, ran.stdout
    return found.group(0)


def _chat(cluster: Cluster, model: str = MODEL) -> str:
    with cluster.openai() as sdk:
        answer = sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hello in three words."}],
            max_tokens=12,
            temperature=0,
        )
    text = answer.choices[0].message.content or ""
    assert text.strip()
    return text


def _restart_leader(cluster: Cluster) -> None:
    cluster.berth("daemon", "start", "--public-port", str(cluster.public_port),
                  "--cluster-port", str(cluster.cluster_port))  # fmt: skip


def test_the_banner_and_doctor_say_docker_is_available(docker_cluster: Cluster) -> None:
    info = docker_cluster.admin("GET", "/admin/info")
    runtimes = {r["name"]: r for r in info["runtimes"]}
    assert runtimes["docker"]["available"], runtimes
    assert "unix://" in runtimes["docker"]["detail"] or "tcp://" in runtimes["docker"]["detail"]
    checks = {c["name"]: c for c in json.loads(docker_cluster.berth("doctor", "--json").stdout)}
    assert checks["runtime docker"]["verdict"] == "ok", checks


def test_a_chat_through_the_leader_reaches_the_container_and_stop_removes_it(
    docker_cluster: Cluster, docker_client: Any, engine_image: str
) -> None:
    deployment_id = _run(docker_cluster, engine_image)
    record = docker_cluster.deployment(deployment_id)
    assert (record["runtime"], record["image"], record["state"]) == (
        "docker",
        engine_image,
        "ready",
    )
    [container] = berth_containers(docker_client, deployment=deployment_id)
    assert container.labels["berth.node"] == "local"
    assert container.labels["berth.home"] == str(docker_cluster.leader_home)
    assert _chat(docker_cluster)
    ps = docker_cluster.berth("ps").stdout
    assert deployment_id in ps and "docker" in ps
    logs = docker_cluster.berth("logs", deployment_id, "--tail", "400").stdout
    assert f"container berth-{deployment_id}" in logs and "slot" in logs  # the engine speaks

    docker_cluster.berth("stop", deployment_id)
    assert berth_containers(docker_client, deployment=deployment_id) == []
    assert docker_cluster.deployment(deployment_id)["state"] == "stopped"


def test_a_daemon_restart_reconciles_the_containers_left_running(
    docker_cluster: Cluster, docker_client: Any, engine_image: str
) -> None:
    kept = _run(docker_cluster, engine_image)
    lost = _run(docker_cluster, engine_image, "--served-name", "smollm2-lost")
    leader_pid = docker_cluster.leader_pid()
    os.kill(leader_pid, signal.SIGKILL)
    assert wait_gone(leader_pid, 10)
    # While the leader is down one container disappears, and three that no deployment owns
    # turn up labelled as this leader's: one serving, one publishing no port, one exited.
    berth_containers(docker_client, deployment=lost)[0].remove(force=True)
    model = smollm2_gguf()
    assert model is not None
    serve = ["-m", f"/models/{model.name}", "--host", "0.0.0.0", "--port", "8080"]
    strays = [
        docker_client.containers.run(
            engine_image,
            serve,
            entrypoint=entrypoint,
            name=f"berth-test-stray{index}-{leader_pid}",
            labels={
                "berth.deployment": f"d-0stray0{index}",
                "berth.node": "local",
                "berth.home": str(docker_cluster.leader_home),
            },
            ports=ports,
            volumes={str(model.parent): {"bind": "/models", "mode": "ro"}},
            detach=True,
        )
        for index, (entrypoint, ports) in enumerate(
            [
                (None, {"8080/tcp": ("127.0.0.1",)}),
                (None, {}),
                (["/app/llama-server", "--version"], {}),
            ]
        )
    ]
    assert (
        kept_container := berth_containers(docker_client, deployment=kept)[0]
    ).status == "running"

    _restart_leader(docker_cluster)
    assert docker_cluster.deployment(kept)["state"] == "ready"
    assert berth_containers(docker_client, deployment=kept)[0].id == kept_container.id
    assert _chat(docker_cluster)
    failed = docker_cluster.deployment(lost)
    assert failed["state"] == "failed"
    assert failed["failure_reason"] == "container was gone when the daemon restarted"
    # Containers of this leader that no deployment owns are stopped and removed, and the
    # daemon's log says so.
    for stray in strays:
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(stray.id)
    daemon_log = (docker_cluster.leader_home / "logs" / "daemon.log").read_text()
    assert re.search(r"runs engine d-0stray00 .* no active deployment owns", daemon_log)
    assert "d-0stray01 publishes no engine port: removing it" in daemon_log
    docker_cluster.berth("stop", kept)
    assert berth_containers(docker_client, deployment=kept) == []


def test_an_image_that_cannot_be_pulled_fails_the_deployment_with_the_reason(
    docker_cluster: Cluster, docker_client: Any
) -> None:
    result = docker_cluster.berth(
        "run", MODEL, "--runtime", "docker", "--image", "berth-test/never-built:1", check=False
    )
    assert result.returncode != 0
    assert "cannot pull image berth-test/never-built:1" in result.stderr, result.stderr
    deployment_id = re.search(r"\bd-[0-9a-f]{8}\b", result.stderr)
    assert deployment_id, result.stderr
    record = docker_cluster.deployment(deployment_id.group(0))
    assert record["state"] == "failed"
    assert record["failure_reason"].startswith("cannot pull image berth-test/never-built:1: ")
    listed = docker_cluster.berth("ps", "--all").stdout
    assert f"{deployment_id.group(0)} failed: cannot pull image" in listed
    assert berth_containers(docker_client, deployment=deployment_id.group(0)) == []


def test_an_agent_starts_the_container_on_its_own_host(
    docker_cluster: Cluster, docker_client: Any, engine_image: str
) -> None:
    agent = docker_cluster.add_agent("gpu-docker")
    assert "runtime.docker" in docker_cluster.node(agent.node_id)["capabilities"]
    model = smollm2_gguf()
    assert model is not None
    docker_cluster.berth("models", "add", "smollm2-remote", str(model), "--node", agent.label)
    ran = docker_cluster.berth("run", "smollm2-remote", "--runtime", "docker",
                               "--image", engine_image, "--node", agent.label)  # fmt: skip
    found = re.search(r"\bd-[0-9a-f]{8}\b", ran.stdout)
    assert found and "ready" in ran.stdout, ran.stdout
    deployment_id = found.group(0)
    [container] = berth_containers(docker_client, deployment=deployment_id)
    assert container.labels["berth.node"] == agent.node_id
    assert container.labels["berth.home"] == str(agent.home)
    assert _chat(docker_cluster, "smollm2-remote")
    logs = docker_cluster.berth("logs", deployment_id).stdout
    assert f"container berth-{deployment_id}" in logs
    docker_cluster.berth("stop", deployment_id)
    deadline = time.monotonic() + 10
    while berth_containers(docker_client, deployment=deployment_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert berth_containers(docker_client, deployment=deployment_id) == []


def test_a_container_started_outside_berth_is_adopted_by_name(
    docker_cluster: Cluster, docker_client: Any, engine_image: str
) -> None:
    model = smollm2_gguf()
    assert model is not None
    outside = docker_client.containers.run(
        engine_image,
        ["-m", f"/models/{model.name}", "--host", "0.0.0.0", "--port", "8080",
         "--alias", "smol-container"],
        name=f"berth-test-outside-{os.getpid()}",
        ports={"8080/tcp": ("127.0.0.1",)},
        volumes={str(model.parent): {"bind": "/models", "mode": "ro"}},
        detach=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:  # until the model is loaded and /v1/models answers
            adopt = docker_cluster.berth("agent", "adopt", "--container", outside.name, check=False)
            if adopt.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert adopt.returncode == 0, adopt.stderr
        outside.reload()
        port = int(outside.attrs["NetworkSettings"]["Ports"]["8080/tcp"][0]["HostPort"])
        [entry] = json.loads(docker_cluster.berth("agent", "adopted", "--json").stdout)
        assert (entry["host"], entry["port"], entry["container"]) == (
            "127.0.0.1",
            port,
            outside.name,
        )
        assert entry["served_model_name"] == "smol-container" and entry["alive"]
        deadline = time.monotonic() + 30
        while "smol-container" not in docker_cluster.served_models():
            assert time.monotonic() < deadline, "the adopted container was never listed"
            time.sleep(0.25)
        assert _chat(docker_cluster, "smol-container")
        missing = docker_cluster.berth("agent", "adopt", "--container", "no-such-one", check=False)
        assert missing.returncode != 0 and "container 'no-such-one' not found" in missing.stderr
    finally:
        docker_cluster.berth("agent", "unadopt", "smol-container", check=False)
        outside.remove(force=True)
