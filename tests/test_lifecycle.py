"""The lifecycle manager against an in-memory link and a real SQLite store."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from berth.cluster.leader.agent_link import EngineEndpoint
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.protocol.payloads import AdoptedState
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.errors import ConfigError, ConflictError, EngineError, NotFoundError, StoreError
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.resolver import Upstream
from berth.store import Store
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState
from support.fakes import FakeLink
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

# The shared ``store`` fixture (conftest.py), with a model file that exists.
pytestmark = pytest.mark.store_models(("tiny", "tiny.gguf"))


@pytest.fixture
def link() -> FakeLink:
    return FakeLink()


@pytest.fixture
async def manager(store: Store, link: FakeLink):  # type: ignore[no-untyped-def]
    seen: list[DeploymentState] = []
    manager = LifecycleManager(
        store,
        LinkRegistry([link]),
        health_timeout_s=5,
        stop_grace_s=1,
        on_state=lambda r: seen.append(r.state),
    )
    manager.seen = seen  # type: ignore[attr-defined]
    await manager.start()
    yield manager
    await manager.shutdown()


async def test_deploy_reaches_ready_and_routes(manager: LifecycleManager, link: FakeLink) -> None:
    record = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    assert record.state is DeploymentState.PENDING
    settled = await manager.wait_settled(record.id, 5)
    assert settled.state is DeploymentState.READY
    assert manager.seen == [  # type: ignore[attr-defined]
        DeploymentState.PENDING,
        DeploymentState.LOADING,
        DeploymentState.READY,
    ]
    (upstream,) = manager.candidates("tiny")
    assert upstream.deployment_id == record.id and upstream.base_url == link.base_url
    assert manager.models() == ["tiny"]


async def test_failed_start_keeps_its_reason(manager: LifecycleManager, link: FakeLink) -> None:
    link.fail_with = "llama-server exited with code 1"
    record = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    settled = await manager.wait_settled(record.id, 5)
    assert settled.state is DeploymentState.FAILED
    assert "exited with code 1" in (settled.failure_reason or "")
    with pytest.raises(NoReadyDeploymentError):
        manager.candidates("tiny")


async def test_a_wait_begun_before_the_start_task_exists_waits_for_the_outcome(
    manager: LifecycleManager, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that reads the new row from the store (a poller, the scaling controller)
    while deploy() is still writing it, and waits on it, gets the start's outcome, not the
    pending record."""
    created, release, read = threading.Event(), threading.Event(), threading.Event()
    row: list[str] = []
    create, get = store.create_deployment, store.get_deployment

    def create_and_hold(*args: Any, **kwargs: Any) -> DeploymentRecord:
        record = create(*args, **kwargs)
        row.append(record.id)
        created.set()
        release.wait(EVENT_TIMEOUT_S)  # deploy() resumes (and starts its task) after this
        return record

    def get_and_tell(deployment_id: str) -> DeploymentRecord:
        record = get(deployment_id)
        if row and deployment_id == row[0]:
            read.set()
        return record

    monkeypatch.setattr(store, "create_deployment", create_and_hold)
    monkeypatch.setattr(store, "get_deployment", get_and_tell)
    deploying = asyncio.create_task(manager.deploy(DeployOptions("tiny", "llamacpp", "local")))
    assert await asyncio.to_thread(created.wait, EVENT_TIMEOUT_S)
    waiting = asyncio.create_task(manager.wait_settled(row[0], EVENT_TIMEOUT_S))
    assert await asyncio.to_thread(read.wait, EVENT_TIMEOUT_S)  # it saw the row pending
    release.set()
    await deploying
    settled = await waiting
    assert settled.state is DeploymentState.READY
    assert [u.deployment_id for u in manager.candidates("tiny")] == [row[0]]


async def test_unknown_model_engine_and_node_are_refused(manager: LifecycleManager) -> None:
    with pytest.raises(NotFoundError):
        await manager.deploy(DeployOptions("nope", "llamacpp", "local"))
    with pytest.raises(ConfigError):
        await manager.deploy(DeployOptions("tiny", "tgi", "local"))
    with pytest.raises(NotFoundError):
        await manager.deploy(DeployOptions("tiny", "llamacpp", "elsewhere"))
    with pytest.raises(NotFoundError):
        manager.candidates("nope")


async def test_gpus_the_node_lacks_are_refused(manager: LifecycleManager) -> None:
    with pytest.raises(ConfigError, match=r"no GPU 7 \(GPUs: none\)"):
        await manager.deploy(DeployOptions("tiny", "llamacpp", "local", gpus=(7,)))


async def test_known_model_without_ready_deployment_is_503(manager: LifecycleManager) -> None:
    with pytest.raises(NoReadyDeploymentError) as caught:
        manager.candidates("tiny")
    assert caught.value.retry_after_s > 0


async def test_before_the_models_are_loaded_every_name_is_503_not_404(
    store: Store, link: FakeLink
) -> None:
    # A leader that has just taken the lease over serves /v1 a moment before its lifecycle
    # starts (issue 25's step-down benchmark got a 404 for a registered model there).
    manager = LifecycleManager(store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1)
    for name in ("tiny", "nope"):
        with pytest.raises(NoReadyDeploymentError, match="still loading its models") as caught:
            manager.candidates(name)
        assert caught.value.retry_after_s == 1
    await manager.start()
    try:
        with pytest.raises(NotFoundError):
            manager.candidates("nope")
        with pytest.raises(NoReadyDeploymentError):
            manager.candidates("tiny")
    finally:
        await manager.shutdown()


async def test_stop_during_loading_and_stop_twice(
    manager: LifecycleManager, link: FakeLink
) -> None:
    link.start_delay_s = 10
    record = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    stopped = await manager.stop(record.id)
    assert stopped.state is DeploymentState.STOPPED
    assert link.running == {}
    with pytest.raises(ConflictError, match="already stopped"):
        await manager.stop(record.id)


async def test_two_stops_at_once_stop_once_and_refuse_once(
    manager: LifecycleManager, link: FakeLink
) -> None:
    record = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    await manager.wait_settled(record.id, 5)
    outcomes = await asyncio.gather(
        manager.stop(record.id), manager.stop(record.id), return_exceptions=True
    )
    stopped = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert [r.state for r in stopped] == [DeploymentState.STOPPED]
    assert len(refused) == 1 and isinstance(refused[0], ConflictError)
    assert "is already stopp" in str(refused[0])


async def test_every_ready_deployment_is_a_candidate(manager: LifecycleManager) -> None:
    a = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    b = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    await manager.wait_settled(a.id, 5)
    await manager.wait_settled(b.id, 5)
    assert {u.deployment_id for u in manager.candidates("tiny")} == {a.id, b.id}


async def test_reconcile_after_a_crash(store: Store, link: FakeLink) -> None:
    ready = store.create_deployment(
        "tiny", "llamacpp", "process", "local", served_model_name="tiny"
    )
    gone = store.create_deployment("tiny", "llamacpp", "process", "local", served_model_name="tiny")
    loading = store.create_deployment(
        "tiny", "llamacpp", "process", "local", served_model_name="tiny"
    )
    for record in (ready, gone):
        store.transition_deployment(record.id, DeploymentState.LOADING)
        store.transition_deployment(record.id, DeploymentState.READY, port=9, pid=4242)
    store.transition_deployment(loading.id, DeploymentState.LOADING, port=9, pid=4343)
    link.survivors = {
        ready.id: EngineEndpoint(ready.id, link.base_url, 4242, 9),
        loading.id: EngineEndpoint(loading.id, link.base_url, 4343, 9),
    }

    manager = LifecycleManager(store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1)
    await manager.start()
    try:
        assert store.get_deployment(ready.id).state is DeploymentState.READY
        assert [u.deployment_id for u in manager.candidates("tiny")] == [ready.id]
        assert store.get_deployment(gone.id).state is DeploymentState.FAILED
        assert store.get_deployment(loading.id).state is DeploymentState.FAILED
        assert loading.id not in link.running  # caught mid-start: stopped, not adopted
    finally:
        await manager.shutdown()
    assert store.get_deployment(ready.id).state is DeploymentState.STOPPED
    assert link.running == {}


async def test_dead_engine_is_marked_failed_by_the_watcher(store: Store, link: FakeLink) -> None:
    manager = LifecycleManager(
        store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1, watch_interval_s=0.01
    )
    await manager.start()
    try:
        # Restarting a dead engine is tests/test_restarts.py's; here it stays failed.
        options = DeployOptions("tiny", "llamacpp", "local", restart_policy="never")
        record = await manager.deploy(options)
        await manager.wait_settled(record.id, 5)
        link.running.pop(record.id)  # the engine dies behind berth's back
        await wait_for_async(
            lambda: store.get_deployment(record.id).state is DeploymentState.FAILED,
            EVENT_TIMEOUT_S,
            "the dead engine's deployment to fail",
        )
        failed = store.get_deployment(record.id)
        assert failed.state is DeploymentState.FAILED
        assert "exited" in (failed.failure_reason or "")
        with pytest.raises(NoReadyDeploymentError):
            manager.candidates("tiny")
    finally:
        await manager.shutdown()


async def test_a_hung_engine_is_failed_after_repeated_health_probes(
    store: Store, link: FakeLink
) -> None:
    manager = LifecycleManager(
        store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1, watch_interval_s=0.01
    )
    await manager.start()
    try:
        options = DeployOptions("tiny", "llamacpp", "local", restart_policy="never")
        record = await manager.deploy(options)
        await manager.wait_settled(record.id, 5)
        assert store.get_deployment(record.id).pid == 4242  # recorded at spawn
        link.hung.add(record.id)  # runs, but no longer answers health
        await wait_for_async(
            lambda: store.get_deployment(record.id).state is DeploymentState.FAILED,
            EVENT_TIMEOUT_S,
            "the hung engine's deployment to fail",
        )
        failed = store.get_deployment(record.id)
        assert failed.state is DeploymentState.FAILED
        assert "health checks" in (failed.failure_reason or "")
        assert record.id not in link.running  # the hung engine was stopped
    finally:
        await manager.shutdown()


async def test_the_engine_pid_is_recorded_while_it_loads(store: Store, link: FakeLink) -> None:
    link.start_delay_s = 10
    manager = LifecycleManager(store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1)
    await manager.start()
    try:
        record = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
        await wait_for_async(
            lambda: store.get_deployment(record.id).pid is not None,
            EVENT_TIMEOUT_S,
            "the engine's pid to be recorded",
        )
        loading = store.get_deployment(record.id)
        assert loading.state is DeploymentState.LOADING and loading.pid == 4242
    finally:
        await manager.shutdown()


async def test_a_model_whose_node_is_unreachable_says_so(manager: LifecycleManager) -> None:
    record = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    await manager.wait_settled(record.id, 5)
    manager.node_disconnected("local")
    with pytest.raises(NoReadyDeploymentError, match=r"unreachable nodes \(local\)"):
        manager.candidates("tiny")
    await manager.stop(record.id)
    with pytest.raises(NoReadyDeploymentError) as caught:
        manager.candidates("tiny")
    assert "unreachable" not in str(caught.value)


async def test_a_docker_deployment_gets_the_engines_image_and_reports_progress(
    store: Store, link: FakeLink
) -> None:
    manager = LifecycleManager(
        store,
        LinkRegistry([link]),
        health_timeout_s=5,
        stop_grace_s=1,
        images={"llamacpp": "example/llama:7", "vllm": "v:1", "sglang": "s:1"},
    )
    await manager.start()
    try:
        link.progress_line = "pulling example/llama:7: 1/3 layers done"
        link.start_gate = asyncio.Event()  # the engine stays loading until the gate opens
        record = await manager.deploy(DeployOptions("tiny", "llamacpp", "local", runtime="docker"))
        assert (record.runtime, record.image) == ("docker", "example/llama:7")
        await wait_for_async(
            lambda: manager.progress(record.id), EVENT_TIMEOUT_S, "progress while loading"
        )
        assert manager.progress(record.id) == "pulling example/llama:7: 1/3 layers done"
        link.start_gate.set()
        settled = await manager.wait_settled(record.id, 5)
        assert settled.state is DeploymentState.READY
        assert manager.progress(record.id) is None  # only while loading
        sent = link.requests[-1]
        assert (sent.runtime, sent.image) == ("docker", "example/llama:7")
        chosen = await manager.deploy(
            DeployOptions("tiny", "llamacpp", "local", runtime="docker", image="mine/llama:dev")
        )
        assert chosen.image == "mine/llama:dev"
        assert store.get_deployment(chosen.id).image == "mine/llama:dev"
    finally:
        await manager.shutdown()


async def test_an_image_needs_the_docker_runtime_and_runtimes_are_checked(
    manager: LifecycleManager,
) -> None:
    with pytest.raises(ConfigError, match="docker runtime only"):
        await manager.deploy(DeployOptions("tiny", "llamacpp", "local", image="x/y:1"))
    with pytest.raises(ConfigError, match="expected one of process, docker"):
        await manager.deploy(DeployOptions("tiny", "llamacpp", "local", runtime="podman"))
    for image, problem in (("", "image name is empty"), ("Bad Image!!", "not a docker image")):
        with pytest.raises(ConfigError, match=problem):
            await manager.deploy(
                DeployOptions("tiny", "llamacpp", "local", runtime="docker", image=image)
            )


async def test_a_manager_that_never_started_changes_nothing_on_shutdown(
    store: Store, link: FakeLink
) -> None:
    record = store.create_deployment("tiny", "llamacpp", "process", "local")
    store.transition_deployment(record.id, DeploymentState.LOADING)
    store.transition_deployment(record.id, DeploymentState.READY, port=9, pid=4242)
    manager = LifecycleManager(store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1)
    await manager.shutdown()  # as after a start that failed before reconciling
    assert store.get_deployment(record.id).state is DeploymentState.READY


async def test_a_stop_that_breaks_at_shutdown_is_logged_and_the_others_still_stop(
    manager: LifecycleManager,
    link: FakeLink,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    other = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    await manager.wait_settled(broken.id, 5)
    await manager.wait_settled(other.id, 5)
    stop = link.stop_deployment

    async def stop_or_break(deployment_id: str, grace_s: float) -> None:
        if deployment_id == broken.id:
            raise RuntimeError("a bug in the stop")
        await stop(deployment_id, grace_s)

    monkeypatch.setattr(link, "stop_deployment", stop_or_break)
    await manager.shutdown()

    assert list(link.running) == [broken.id]  # the other one was stopped all the same
    (logged,) = [r for r in caplog.records if "a bug in the stop" in r.getMessage()]
    assert broken.id in logged.getMessage() and "local" in logged.getMessage()


async def test_a_store_out_of_reach_at_shutdown_is_logged_and_ends_the_shutdown(
    manager: LifecycleManager,
    store: Store,
    link: FakeLink,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    record = await manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    await manager.wait_settled(record.id, 5)

    def unreachable(**_: object) -> list[DeploymentRecord]:
        raise StoreError("database error: connection failed: Connection refused")

    monkeypatch.setattr(store, "list_deployments", unreachable)
    await manager.shutdown()  # returns: the leader's stop goes on with the rest

    assert list(link.running) == [record.id]  # left for the next start to take back
    (logged,) = [r for r in caplog.records if "cannot list the deployments" in r.getMessage()]
    assert "Connection refused" in logged.getMessage()


async def test_reconcile_stops_local_engines_no_deployment_owns(
    store: Store, link: FakeLink, caplog: pytest.LogCaptureFixture
) -> None:
    kept = store.create_deployment("tiny", "llamacpp", "docker", "local", image="img:1")
    store.transition_deployment(kept.id, DeploymentState.LOADING)
    store.transition_deployment(kept.id, DeploymentState.READY, port=9, pid=4242)
    # Taken back before reconcile (the agent core adopts labelled containers at start-up).
    link.running = {
        kept.id: EngineEndpoint(kept.id, link.base_url, 4242, 9),
        "d-0rphan00": EngineEndpoint("d-0rphan00", link.base_url, 4343, 10),
    }
    link.survivors = {kept.id: link.running[kept.id]}
    manager = LifecycleManager(store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1)
    await manager.start()
    try:
        assert store.get_deployment(kept.id).state is DeploymentState.READY
        assert list(link.running) == [kept.id]
        assert "engine d-0rphan00 (pid 4343, port 10) that no active deployment owns" in caplog.text
    finally:
        await manager.shutdown()


async def test_a_deployment_whose_runtime_is_down_waits_to_be_reconciled(
    store: Store, link: FakeLink
) -> None:
    record = store.create_deployment("tiny", "llamacpp", "docker", "local", image="img:1")
    store.transition_deployment(record.id, DeploymentState.LOADING)
    store.transition_deployment(record.id, DeploymentState.READY, port=9, pid=4242)
    link.reattach_error = EngineError("no Docker engine at unix:///var/run/docker.sock")
    manager = LifecycleManager(
        store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1, watch_interval_s=0.02
    )
    await manager.start()
    try:
        assert store.get_deployment(record.id).state is DeploymentState.READY  # not failed
        with pytest.raises(NoReadyDeploymentError):
            manager.candidates("tiny")  # not routed while unknown
        link.reattach_error = None  # Docker is back, the container still runs
        link.survivors = {record.id: EngineEndpoint(record.id, link.base_url, 4242, 9)}
        await wait_for_async(manager.models, EVENT_TIMEOUT_S, "the deployment to be reconciled")
        assert [u.deployment_id for u in manager.candidates("tiny")] == [record.id]
    finally:
        await manager.shutdown()


async def test_adopted_endpoints_are_routed_while_they_answer(
    manager: LifecycleManager, link: FakeLink
) -> None:
    outside = AdoptedState(name="outside", served_model_name="smol-outside",
                           engine_model="/models/smol.gguf", host="127.0.0.1", port=8080,
                           gpus=[0], alive=True)  # fmt: skip
    manager.adopted_reported("local", [outside])
    [upstream] = manager.candidates("smol-outside")
    assert (upstream.deployment_id, upstream.base_url) == (
        "adopted:outside",
        "http://127.0.0.1:8080",
    )
    assert upstream.engine_model == "/models/smol.gguf"  # what the server itself serves
    assert "smol-outside" in manager.models()
    # Its declared GPU is reserved: berth places nothing else there.
    with pytest.raises(ConflictError, match="reserves GPU 0 by outside"):
        await manager.deploy(DeployOptions("tiny", "llamacpp", "local", gpus=(0,)))
    # It stops answering: out of /v1/models, and a clear 503 naming it.
    manager.adopted_reported("local", [msgspec.structs.replace(outside, alive=False)])
    assert "smol-outside" not in manager.models()
    with pytest.raises(NoReadyDeploymentError, match=r"adopted endpoint does not answer \(outside"):
        manager.candidates("smol-outside")
    manager.adopted_reported("local", [outside])  # back
    assert [u.deployment_id for u in manager.candidates("smol-outside")] == ["adopted:outside"]
    manager.adopted_reported("local", [])  # unadopted
    with pytest.raises(NotFoundError):
        manager.candidates("smol-outside")


async def test_a_hub_model_is_pulled_by_the_agent_that_runs_it_and_its_path_kept(
    store: Store, link: FakeLink
) -> None:
    node = store.enroll_node("gpu-a", "ab" * 32)
    store.add_model("hubby", "/leader/models/hubby", source="hub", repo_id="org/hubby")
    agent = FakeLink(node_id=node.id)
    agent.pulled = {"org/hubby": "/agent/models/org--hubby"}
    manager = LifecycleManager(
        store, LinkRegistry([link, agent]), health_timeout_s=5, stop_grace_s=1
    )
    await manager.start()
    try:
        record = await manager.deploy(DeployOptions("hubby", "llamacpp", "gpu-a"))
        settled = await manager.wait_settled(record.id, 5)
        assert settled.state is DeploymentState.READY
        assert agent.pulls == [("org/hubby", None)]
        assert agent.requests[-1].model_path == Path("/agent/models/org--hubby")
        assert store.model_path_on_node("hubby", node.id) == "/agent/models/org--hubby"
        again = await manager.deploy(DeployOptions("hubby", "llamacpp", "gpu-a"))
        await manager.wait_settled(again.id, 5)
        assert agent.pulls == [("org/hubby", None)]  # the recorded path is used from now on
    finally:
        await manager.shutdown()


async def test_an_agent_without_docker_or_a_link_is_refused_before_anything_is_created(
    store: Store, link: FakeLink
) -> None:
    node = store.enroll_node("gpu-a", "ab" * 32)
    store.set_model_location("tiny", node.id, "/agent/tiny.gguf")
    agent = FakeLink(node_id=node.id)
    agent.capabilities = agent.capabilities - {"runtime.docker"}
    links = LinkRegistry([link, agent])
    manager = LifecycleManager(store, links, health_timeout_s=5, stop_grace_s=1)
    with pytest.raises(ConflictError, match="node gpu-a offers no docker runtime"):
        await manager.deploy(DeployOptions("tiny", "llamacpp", "gpu-a", runtime="docker"))
    links.detach(agent)
    with pytest.raises(ConflictError, match=rf"node gpu-a \({node.id}\) is not connected"):
        await manager.deploy(DeployOptions("tiny", "llamacpp", "gpu-a"))
    assert store.list_deployments() == []


async def test_after_each_round_of_probes_the_engines_that_answered_are_heard(
    store: Store, link: FakeLink
) -> None:
    manager = LifecycleManager(
        store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1, watch_interval_s=0.01
    )
    heard: list[list[str]] = []

    async def after(upstreams: Sequence[Upstream]) -> None:
        heard.append([u.deployment_id for u in upstreams])

    manager.after_probes(after)  # the prefix policy's cache signals are read here
    await manager.start()
    try:
        options = DeployOptions("tiny", "llamacpp", "local", restart_policy="never")
        sound = await manager.deploy(options)
        hung = await manager.deploy(options)
        await manager.wait_settled(sound.id, 5)
        await manager.wait_settled(hung.id, 5)
        link.hung.add(hung.id)  # runs, but no longer answers health
        heard.clear()
        await wait_for_async(lambda: len(heard) >= 3, EVENT_TIMEOUT_S, "three rounds")
        assert [sound.id] in heard and all(hung.id not in round_ for round_ in heard[1:])
    finally:
        await manager.shutdown()
