"""The restart policy: the pure decision (:func:`berth.deployments.restarts.decide_restart`), and
the lifecycle manager carrying it out over an in-memory link (real processes:
``tests/test_restarts_e2e.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.protocol.ops import PROBE, ProbeResult
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.deployments.restarts import (
    Backoff,
    Ending,
    GiveUp,
    Restart,
    RestartHistory,
    decide_restart,
)
from berth.deployments.supervisor import restart_reporter
from berth.errors import PolicyError
from berth.observability.metrics import ProxyMetrics
from berth.runtime.base import EngineExit
from berth.store import Store
from berth.vocab.policies import RestartPolicy
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState
from support.berth_cli import Berth
from support.cluster_harness import clean_env
from support.fakes import FakeLink
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

pytestmark = pytest.mark.store_models(("tiny", "tiny.gguf"))

KILLED = Ending("signal", "killed by SIGKILL")
CRASHED = Ending("exit", "exit code 1", 1)
CLEAN = Ending("exit", "exit code 0", 0)
HUNG = Ending("unhealthy", "stopped after 3 failed health probes")
SERVED = RestartHistory(streak=0, ready_since=0.0, ever_ready=True)


# -- the pure decision --------------------------------------------------------------------


def _first_restart(detail: str) -> Restart:
    return Restart(1.0, 1, False, f"{detail}; restarting: restart 1 in a row, in 1s")


@pytest.mark.parametrize(
    ("policy", "ending", "history", "expected"),
    [
        ("never", KILLED, SERVED, GiveUp("not restarted (restart policy never)")),
        (
            "on-failure",
            Ending("start_failed", "start failed: exit code 1"),
            RestartHistory(),
            GiveUp("not restarted: its first start failed", first_start=True),
        ),
        (
            "on-failure",
            CLEAN,
            SERVED,
            GiveUp("not restarted: it exited with code 0 (restart policy on-failure)"),
        ),
        ("always", CLEAN, SERVED, _first_restart("exit code 0")),
        ("on-failure", KILLED, SERVED, _first_restart("killed by SIGKILL")),
        ("on-failure", CRASHED, SERVED, _first_restart("exit code 1")),
        ("always", HUNG, SERVED, _first_restart("stopped after 3 failed health probes")),
    ],
)
def test_the_policy_says_whether_an_ended_engine_is_restarted(
    policy: RestartPolicy, ending: Ending, history: RestartHistory, expected: Restart | GiveUp
) -> None:
    assert decide_restart(policy, ending, history, now=10.0) == expected


@pytest.mark.parametrize(
    ("streak", "delay_s", "crashloop"),
    [
        (0, 1.0, False),
        (1, 2.0, False),
        (2, 4.0, False),
        (3, 8.0, True),  # crashloop_restarts restarts in a row that did not hold
        (8, 256.0, True),
        (9, 300.0, True),  # capped at 5 minutes
        (10_000, 300.0, True),  # no overflow however long it loops
    ],
)
def test_the_backoff_doubles_from_1_s_to_a_5_minute_cap(
    streak: int, delay_s: float, crashloop: bool
) -> None:
    history = RestartHistory(streak=streak, ready_since=None, ever_ready=True)
    decision = decide_restart("on-failure", KILLED, history, now=1000.0)
    assert isinstance(decision, Restart)
    assert (decision.delay_s, decision.streak, decision.crashloop) == (
        delay_s,
        streak + 1,
        crashloop,
    )


@pytest.mark.parametrize(
    ("ready_for_s", "delay_s"),
    [
        (599.0, 16.0),  # not 10 minutes healthy: the streak goes on
        (600.0, 1.0),  # 10 minutes healthy: back to the first delay
    ],
)
def test_ten_minutes_healthy_resets_the_backoff(ready_for_s: float, delay_s: float) -> None:
    history = RestartHistory(streak=4, ready_since=1000.0, ever_ready=True)
    decision = decide_restart("on-failure", KILLED, history, now=1000.0 + ready_for_s)
    assert isinstance(decision, Restart)
    assert decision.delay_s == delay_s


def test_backoff_settings_apply() -> None:
    backoff = Backoff(initial_s=0.5, max_s=3.0, reset_after_s=60.0, crashloop_restarts=1)
    assert [backoff.delay_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    history = RestartHistory(streak=1, ready_since=None, ever_ready=True)
    decision = decide_restart("always", KILLED, history, now=0.0, backoff=backoff)
    assert isinstance(decision, Restart) and decision.crashloop


def test_an_exit_is_described_by_its_code_or_signal() -> None:
    assert EngineExit.from_returncode(1).describe() == "exit code 1"
    assert EngineExit.from_returncode(-9).describe() == "killed by SIGKILL"
    assert EngineExit.from_returncode(-200).describe() == "killed by signal 200"
    assert EngineExit.from_returncode(-4).describe() == (
        "killed by SIGILL (built for instructions this CPU does not run)"
    )


# -- the lifecycle manager carrying it out --------------------------------------------------

FAST = Backoff(initial_s=0.01, max_s=0.05, crashloop_restarts=2)


@pytest.fixture
def restart_link() -> FakeLink:
    return FakeLink()


@pytest.fixture
async def restart_manager(store: Store, restart_link: FakeLink) -> AsyncIterator[LifecycleManager]:
    metrics = ProxyMetrics()
    audited: list[dict[str, object]] = []
    restart_manager = LifecycleManager(
        store,
        LinkRegistry([restart_link]),
        health_timeout_s=5,
        stop_grace_s=1,
        watch_interval_s=0.01,
        probe_timeout_s=0.005,
        restart_backoff=FAST,
        on_restart=restart_reporter(metrics, lambda event: audited.append(dict(event))),
    )
    restart_manager.audited = audited  # type: ignore[attr-defined]
    restart_manager.metrics = metrics  # type: ignore[attr-defined]
    await restart_manager.start()
    yield restart_manager
    await restart_manager.shutdown()


async def _ready(restart_manager: LifecycleManager, policy: RestartPolicy = "on-failure") -> str:
    record = await restart_manager.deploy(
        DeployOptions("tiny", "llamacpp", "local", restart_policy=policy)
    )
    assert (await restart_manager.wait_settled(record.id, 5)).state is DeploymentState.READY
    return record.id


async def _until(store: Store, deployment_id: str, what: str, test: object) -> DeploymentRecord:
    def check() -> DeploymentRecord | None:
        record = store.get_deployment(deployment_id)
        return record if test(record) else None  # type: ignore[operator]

    found = await wait_for_async(check, EVENT_TIMEOUT_S, what)
    assert found is not None
    return found


async def test_a_dead_engine_is_started_again_under_the_same_id(
    restart_manager: LifecycleManager, store: Store, restart_link: FakeLink
) -> None:
    deployment_id = await _ready(restart_manager)
    restart_link.running.pop(deployment_id)  # the engine dies behind berth's back
    restart_link.exits[deployment_id] = EngineExit(signal="SIGKILL")
    again = await _until(
        store,
        deployment_id,
        "the deployment to be ready again",
        lambda r: r.state is DeploymentState.READY and r.restart_count == 1,
    )
    assert again.last_exit == "killed by SIGKILL"
    assert again.last_exit_log == f"log of {deployment_id}"
    assert [r.deployment_id for r in restart_link.requests] == [deployment_id, deployment_id]

    assert [u.deployment_id for u in restart_manager.candidates("tiny")] == [deployment_id]
    [event] = restart_manager.audited  # type: ignore[attr-defined]
    assert (event["event"], event["deployment"], event["reason"], event["restart_count"]) == (
        "deployment_restarted",
        deployment_id,
        "signal",
        1,
    )
    metrics: ProxyMetrics = restart_manager.metrics  # type: ignore[attr-defined]
    labels = {"deployment": deployment_id, "model": "tiny", "node": "local", "reason": "signal"}
    sample = metrics.registry.get_sample_value("berth_deployment_restarts_total", labels)
    assert sample == 1.0


async def test_failed_restarts_back_off_into_crashloop(
    restart_manager: LifecycleManager, store: Store, restart_link: FakeLink
) -> None:
    deployment_id = await _ready(restart_manager)
    restart_link.fail_with = "engine exited with code 1 before /health answered 200"
    restart_link.running.pop(deployment_id)
    looping = await _until(
        store,
        deployment_id,
        "crashloop",
        lambda r: r.state is DeploymentState.CRASHLOOP,
    )
    assert looping.restart_count >= FAST.crashloop_restarts
    assert (looping.last_exit or "").startswith("start failed: engine exited with code 1")
    restart_link.fail_with = None  # the fault is fixed: the next restart serves again
    served = await _until(
        store, deployment_id, "ready again", lambda r: r.state is DeploymentState.READY
    )
    assert served.restart_count > looping.restart_count


async def test_a_restart_the_agent_policy_refuses_fails_at_once(
    restart_manager: LifecycleManager, store: Store, restart_link: FakeLink
) -> None:
    deployment_id = await _ready(restart_manager)
    refusal = "refused by the agent policy (model_roots): model path /m is outside the roots"
    restart_link.start_error = PolicyError(refusal, rule="model_roots")
    restart_link.running.pop(deployment_id)
    failed = await _until(
        store, deployment_id, "failed", lambda r: r.state is DeploymentState.FAILED
    )
    assert refusal in (failed.failure_reason or ""), failed.failure_reason
    # One restart was tried and refused; none after it (no crashloop of refusals).
    assert failed.restart_count == 1
    assert [r.deployment_id for r in restart_link.requests] == [deployment_id, deployment_id]


async def test_a_stop_wins_over_a_pending_restart(store: Store, restart_link: FakeLink) -> None:
    slow = Backoff(initial_s=30.0)
    restart_manager = LifecycleManager(
        store,
        LinkRegistry([restart_link]),
        health_timeout_s=5,
        stop_grace_s=1,
        watch_interval_s=0.01,
        probe_timeout_s=0.005,
        restart_backoff=slow,
    )
    await restart_manager.start()
    try:
        deployment_id = await _ready(restart_manager)
        restart_link.running.pop(deployment_id)
        await _until(
            store, deployment_id, "restarting", lambda r: r.state is DeploymentState.RESTARTING
        )
        stopped = await restart_manager.stop(deployment_id)
        assert stopped.state is DeploymentState.STOPPED
        assert len(restart_link.requests) == 1  # never started again
        assert store.get_deployment(deployment_id).restart_count == 0
    finally:
        await restart_manager.shutdown()


@pytest.mark.parametrize(
    ("policy", "ending_exit", "state"),
    [
        ("never", EngineExit(signal="SIGKILL"), DeploymentState.FAILED),
        ("on-failure", EngineExit(code=0), DeploymentState.FAILED),
        ("always", EngineExit(code=0), DeploymentState.READY),
    ],
)
async def test_the_policy_decides_per_deployment(
    restart_manager: LifecycleManager,
    store: Store,
    restart_link: FakeLink,
    policy: RestartPolicy,
    ending_exit: EngineExit,
    state: DeploymentState,
) -> None:
    deployment_id = await _ready(restart_manager, policy)
    restart_link.running.pop(deployment_id)
    restart_link.exits[deployment_id] = ending_exit
    ended = await _until(
        store,
        deployment_id,
        f"{state} after the engine ended",
        lambda r: r.state is state and (state is not DeploymentState.READY or r.restart_count),
    )
    assert ended.restart_policy == policy
    if state is DeploymentState.FAILED:
        assert ended.last_exit == ending_exit.describe()
        assert "not restarted" in (ended.failure_reason or "")


async def test_a_first_start_that_fails_is_not_restarted(
    restart_manager: LifecycleManager, store: Store, restart_link: FakeLink
) -> None:
    restart_link.fail_with = "engine exited with code 1 before /health answered 200"
    record = await restart_manager.deploy(DeployOptions("tiny", "llamacpp", "local"))
    failed = await restart_manager.wait_settled(record.id, 5)
    assert failed.state is DeploymentState.FAILED
    assert failed.failure_reason == restart_link.fail_with  # as before restart policies
    assert len(restart_link.requests) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ("run", "tiny", "--restart", "sometimes"),
        ("service", "create", "chat", "--model", "tiny", "--restart", "sometimes"),
        ("service", "scale", "chat", "--restart", "sometimes"),
    ],
)
def test_an_unknown_restart_policy_is_refused_by_the_cli(
    tmp_path: Path, argv: tuple[str, ...]
) -> None:
    berth = Berth(tmp_path / "home", env=clean_env({}), cwd=tmp_path)
    line = berth.fails(*argv)
    assert line == (
        "error: unknown restart policy 'sometimes': choose one of on-failure, always, never"
    )


def test_the_probe_answers_exit_fields_are_additive() -> None:
    older = PROBE.decode_result(msgspec.Raw(b'{"result": "gone"}'))
    assert (older.result, older.exit_code, older.exit_signal) == ("gone", None, None)
    newer = ProbeResult(result="gone", exit_signal="SIGKILL")
    again = PROBE.decode_result(PROBE.encode_result(newer))
    assert (again.exit_code, again.exit_signal) == (None, "SIGKILL")
