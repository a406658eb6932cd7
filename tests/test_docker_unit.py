"""The docker runtime in-process: pull progress, Docker's errors in plain words, the real SDK
facing no Docker engine, and a recording stand-in for the SDK that proves no Docker call runs
on the event loop's thread.  The real Docker engine is in ``test_docker_runtime.py``."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from berth.agent.core import AgentCore
from berth.errors import EngineError
from berth.runtime.base import EngineExit, LaunchSpec
from berth.runtime.docker import DockerRuntime, PullProgress, docker_error_text
from berth.runtime.docker.api import (
    ContainerConfig,
    ContainerEnded,
    ContainerInfo,
    ContainerState,
    DockerApi,
    DockerConflict,
    DockerNotFound,
    EngineInfo,
    EngineVersion,
    EventStream,
    ImageInfo,
    NetworkInfo,
    PortBinding,
    PullMessage,
    decode_pull_message,
)
from berth.runtime.engine_container import build_container_spec
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import StaticInventory
from berth.runtime.process import ProcessRuntime
from berth.vocab.deployment_request import DeploymentRequest
from support.waiting import EVENT_TIMEOUT_S, wait_for_async


class RecordingDocker:
    """A Docker engine in memory, written against the ``DockerApi`` Protocol.

    Every call records the thread it ran on.  ``pull_messages`` is what a pull streams (as
    Docker's JSON objects); ``exit_code_on_start``, when set, makes a container exit with that
    code as soon as it starts.
    """

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.present: set[str] = set()
        self.pull_messages: list[dict[str, Any]] = []
        #: when set, a pull stalls after its first message until this is set
        self.pull_gate: threading.Event | None = None
        self.pull_closed = threading.Event()
        self.pull_thread: threading.Thread | None = None
        self.containers_by_id: dict[str, ContainerInfo] = {}
        self.configs: dict[str, ContainerConfig] = {}
        self.networks: dict[str, NetworkInfo] = {}
        self.exit_code_on_start: int | None = None
        self._ids = itertools.count(1)
        #: the ``die`` events Docker would stream (``None`` ends the stream)
        self.ends: queue.Queue[ContainerEnded | None] = queue.Queue()

    def _seen(self) -> None:
        self.threads.append(threading.get_ident())

    def version(self) -> EngineVersion:
        self._seen()
        return EngineVersion("99.0", "1.99")

    def info(self) -> EngineInfo:
        self._seen()
        return EngineInfo(frozenset({"runc"}))

    def inspect_image(self, image: str) -> ImageInfo | None:
        self._seen()
        return ImageInfo("sha256:" + "0" * 64, 1_000) if image in self.present else None

    def pull(self, image: str) -> Generator[PullMessage, None, None]:
        self._seen()
        self.pull_thread = threading.current_thread()
        try:
            for index, message in enumerate(self.pull_messages):
                yield decode_pull_message(message)
                if index == 0 and self.pull_gate is not None:
                    self.pull_gate.wait(10)
        except GeneratorExit:
            self.pull_closed.set()
            raise
        self.present.add(image)

    def create_container(self, config: ContainerConfig) -> str:
        self._seen()
        container_id = f"c{next(self._ids):063d}"
        if config.network is not None and config.network not in self.networks:
            raise DockerNotFound(f"network {config.network} not found", status_code=404)
        self.configs[container_id] = config
        self.containers_by_id[container_id] = ContainerInfo(
            id=container_id,
            name=config.name,
            labels=dict(config.labels),
            state=ContainerState(running=False),
            networks=(config.network,) if config.network else (),
        )
        return container_id

    def start_container(self, container_id: str) -> None:
        self._seen()
        created = self._existing(container_id)
        if self.exit_code_on_start is not None:  # gone before anyone looks: no port left
            state = ContainerState(running=False, exit_code=self.exit_code_on_start)
            self.containers_by_id[container_id] = replace(created, state=state)
            return
        self.containers_by_id[container_id] = replace(
            created,
            state=ContainerState(running=True, pid=4242),
            ports={"8080/tcp": (PortBinding("127.0.0.1", 49153),)},
        )

    def inspect_container(self, container: str) -> ContainerInfo | None:
        self._seen()
        for info in self.containers_by_id.values():
            if container in (info.id, info.name):
                return info
        return None

    def list_containers(self, labels: Sequence[str]) -> list[str]:
        self._seen()

        def carries(info: ContainerInfo, label: str) -> bool:
            key, has_value, value = label.partition("=")
            return key in info.labels and (not has_value or info.labels[key] == value)

        return [
            info.id
            for info in self.containers_by_id.values()
            if all(carries(info, label) for label in labels)
        ]

    def stop_container(self, container_id: str, timeout_s: int) -> None:
        self._seen()
        stopped = ContainerState(running=False, exit_code=143)
        self.containers_by_id[container_id] = replace(self._existing(container_id), state=stopped)

    def remove_container(self, container_id: str) -> None:
        self._seen()
        self._existing(container_id)
        del self.containers_by_id[container_id]

    def inspect_network(self, name: str) -> NetworkInfo | None:
        self._seen()
        return self.networks.get(name)

    def create_network(
        self, name: str, *, options: Mapping[str, str], labels: Mapping[str, str]
    ) -> str:
        self._seen()
        if name in self.networks:
            raise DockerConflict(f"network with name {name} already exists", status_code=409)
        network_id = f"n{len(self.networks):063d}"
        self.networks[name] = NetworkInfo(network_id, name, "bridge", dict(options), dict(labels))
        return network_id

    def logs(
        self, container_id: str, *, since: float | None = None, tail: int | None = None
    ) -> bytes:
        self._seen()
        return b"engine output\n"

    def follow_logs(self, container_id: str, *, since: float | None = None) -> Iterator[bytes]:
        self._seen()
        return iter([b"engine output\n"])

    def container_ends(self, labels: Sequence[str]) -> EventStream:
        self._seen()
        ends = self.ends

        class Stream:
            def __iter__(self) -> Iterator[ContainerEnded]:
                while (ended := ends.get()) is not None:
                    yield ended

            def close(self) -> None:
                ends.put(None)

        return Stream()

    def die(self, container_id: str, exit_code: int) -> None:
        """The container's process ends by itself (killed, crashed): Docker says so."""
        stopped = ContainerState(running=False, exit_code=exit_code)
        self.containers_by_id[container_id] = replace(self._existing(container_id), state=stopped)
        self.ends.put(ContainerEnded(container_id, exit_code))

    def close(self) -> None:
        self._seen()

    def _existing(self, container_id: str) -> ContainerInfo:
        if container_id not in self.containers_by_id:
            raise DockerNotFound(f"no such container: {container_id}", status_code=404)
        return self.containers_by_id[container_id]


@pytest.fixture
def fake() -> RecordingDocker:
    return RecordingDocker()


def _spec(tmp_path: Path, image: str = "example/engine:1") -> LaunchSpec:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    request = DeploymentRequest(
        deployment_id="d-00000d0c",
        model_name="m",
        model_path=model,
        engine="llamacpp",
        port=0,
        log_path=tmp_path / "engine.log",
    )
    return build_container_spec(request, image, shm_size="1g")


def _runtime(tmp_path: Path, fake: RecordingDocker) -> DockerRuntime:
    def connect(_host: str) -> DockerApi:
        return fake  # mypy checks here that the stand-in is a whole DockerApi

    return DockerRuntime(
        host="unix:///fake.sock", home=tmp_path, node_id="local", client_factory=connect
    )


async def test_no_docker_call_runs_on_the_event_loop(tmp_path: Path, fake: RecordingDocker) -> None:
    loop_thread = threading.get_ident()
    runtime = _runtime(tmp_path, fake)
    spec = _spec(tmp_path)
    progress: list[str] = []
    handle = await runtime.start(spec, progress.append)  # pulls, creates, starts
    assert (handle.port, handle.pid, handle.runtime) == (49153, 4242, "docker")
    assert await runtime.poll(handle) and runtime.is_alive(handle)
    assert await runtime.owned() == ["d-00000d0c"]
    assert await runtime.attach("d-00000d0c", spec.log_path) is not None
    assert (await runtime.status()).available
    await runtime.stop(handle, grace_s=1)
    assert not await runtime.poll(handle)
    assert fake.threads, "the stand-in saw no call"
    assert loop_thread not in fake.threads
    assert progress[-1] == "pulled example/engine:1"


async def test_a_pull_error_fails_the_start_with_dockers_reason(
    tmp_path: Path, fake: RecordingDocker
) -> None:
    fake.pull_messages = [
        {"status": "Pulling from example/engine", "id": "1"},
        {"error": "manifest for example/engine:1 not found: manifest unknown"},
    ]
    runtime = _runtime(tmp_path, fake)
    spec = _spec(tmp_path)
    progress: list[str] = []
    with pytest.raises(EngineError) as failure:
        await runtime.start(spec, progress.append)
    assert str(failure.value) == (
        "cannot pull image example/engine:1: manifest for example/engine:1 not found: "
        "manifest unknown"
    )
    assert progress == ["pulling example/engine:1"]
    assert fake.containers_by_id == {}
    assert "manifest unknown" in spec.log_path.read_text()


def test_pull_progress_sums_the_layers() -> None:
    progress = PullProgress("vllm/vllm-openai:latest")
    assert progress.line() == "pulling vllm/vllm-openai:latest"
    for message in (
        {"status": "Pulling from vllm/vllm-openai", "id": "latest"},
        {"status": "Pulling fs layer", "id": "a"},
        {"status": "Pulling fs layer", "id": "b"},
        {"status": "Downloading", "id": "a", "progressDetail": {"current": 500, "total": 1000}},
        {"status": "Downloading", "id": "b", "progressDetail": {"current": 1_000_000,
                                                                "total": 2_000_000_000}},
        {"status": "Download complete", "id": "a"},
        {"status": "Extracting", "id": "a", "progressDetail": {"current": 10, "total": 1000}},
        {"status": "Pull complete", "id": "a"},
    ):  # fmt: skip
        progress.feed(decode_pull_message(message))
    assert progress.line() == "pulling vllm/vllm-openai:latest: 1.0 MB of 2.0 GB, 1/2 layers done"


async def test_no_docker_engine_is_reported_with_the_reason(tmp_path: Path) -> None:
    runtime = DockerRuntime(host=f"unix://{tmp_path}/docker.sock", home=tmp_path, node_id="local")
    status = await runtime.status()
    assert not status.available
    assert status.detail == (
        f"no Docker engine at unix://{tmp_path}/docker.sock: its socket does not exist "
        "(is dockerd running?)"
    )
    with pytest.raises(EngineError, match="no Docker engine at"):
        await runtime.start(_spec(tmp_path))


def test_docker_errors_in_plain_words() -> None:
    refused = docker.errors.DockerException("Error while fetching server API version")
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    assert docker_error_text(refused) == "connection refused"
    denied = docker.errors.DockerException("boom")
    denied.__cause__ = PermissionError(13, "Permission denied")
    assert "docker group" in docker_error_text(denied)
    assert docker_error_text(RuntimeError("other")) == "other"


async def test_a_stop_during_the_pull_cancels_it_and_leaves_nothing(
    tmp_path: Path, fake: RecordingDocker
) -> None:
    fake.pull_messages = [
        {"status": "Pulling fs layer", "id": "a"},
        {"status": "Downloading", "id": "a", "progressDetail": {"current": 1, "total": 9}},
    ]
    fake.pull_gate = threading.Event()
    runtime = _runtime(tmp_path, fake)
    core = AgentCore(
        ProcessRuntime(),
        EngineBinaries(None, None, ""),
        StaticInventory(),
        logs_dir=tmp_path,
        docker=runtime,
    )
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    request = DeploymentRequest(
        deployment_id="d-0000057a",
        model_name="m",
        model_path=model,
        engine="llamacpp",
        port=0,
        log_path=Path(),
        runtime="docker",
        image="example/engine:1",
    )
    progress: list[str] = []
    start = asyncio.create_task(core.start(request, 30, on_progress=progress.append))
    await wait_for_async(lambda: progress, EVENT_TIMEOUT_S, "the pull's first progress line")
    assert progress == ["pulling example/engine:1"]
    await core.stop("d-0000057a", grace_s=1)  # returns once the start is gone
    assert start.cancelled()
    fake.pull_gate.set()  # Docker sends its next message: the pull thread sees the stop
    assert await asyncio.to_thread(fake.pull_closed.wait, EVENT_TIMEOUT_S)
    assert fake.pull_thread is not None
    await asyncio.to_thread(fake.pull_thread.join, EVENT_TIMEOUT_S)  # all it did is done
    assert not fake.pull_thread.is_alive()
    assert fake.containers_by_id == {}
    assert core.engines() == []
    assert progress == ["pulling example/engine:1"]  # nothing after the stop


async def test_a_container_that_exits_at_once_reports_how(
    tmp_path: Path, fake: RecordingDocker
) -> None:
    fake.present.add("example/engine:1")
    fake.exit_code_on_start = 2
    runtime = _runtime(tmp_path, fake)
    spec = _spec(tmp_path)
    handle = await runtime.start(spec)
    assert handle.port == 0 and not runtime.is_alive(handle)
    with pytest.raises(EngineError, match="container exited with code 2") as failure:
        await runtime.wait_healthy(handle, spec, timeout_s=5)
    assert "engine output" in (failure.value.log_tail or "")


async def test_a_container_that_dies_is_reported_from_the_events_stream(
    tmp_path: Path, fake: RecordingDocker
) -> None:
    """Its end is heard from Docker's events as it happens (no poll), with its exit code; a
    container stopped on purpose is not reported."""
    runtime = _runtime(tmp_path, fake)
    try:
        handle = await runtime.start(_spec(tmp_path))
        heard: list[EngineExit | None] = []
        runtime.watch_exit(handle, heard.append)
        assert handle.container_id is not None
        await asyncio.to_thread(fake.die, handle.container_id, 137)
        await wait_for_async(lambda: heard, EVENT_TIMEOUT_S, "the container's end")
        assert heard == [EngineExit(code=137)]
        assert not runtime.is_alive(handle)

        stopped = await runtime.start(_spec(tmp_path))
        runtime.watch_exit(stopped, heard.append)
        runtime.unwatch_exit(stopped)  # stopping it: not news
        await runtime.stop(stopped, grace_s=1)
        marker = await runtime.start(_spec(tmp_path))
        runtime.watch_exit(marker, heard.append)
        assert stopped.container_id is not None and marker.container_id is not None
        fake.ends.put(ContainerEnded(stopped.container_id, 143))
        await asyncio.to_thread(fake.die, marker.container_id, 1)  # after it, in order
        await wait_for_async(lambda: len(heard) == 2, EVENT_TIMEOUT_S, "the marker's end")
        assert heard == [EngineExit(code=137), EngineExit(code=1)]
    finally:
        runtime.close()
