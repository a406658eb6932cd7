"""An engine's end known at once, in process (issue 37): what the leader does with it, and
what a request does with an engine that refuses it.

- an end heard from node ``local``'s core or an agent's heartbeat takes the deployment out
  of the ready table before anything else happens (the call returns with it gone), moves
  the requests waiting on it, and the supervisor restarts it; a standby does nothing;
- an agent hands an engine's end to the leader in a heartbeat it sends at once;
- a connection an engine believed ready refuses makes the deployment suspect and goes to a
  replica beside it on the same node; with none left it is a 503 with ``Retry-After``.

``test_engine_exit.py`` kills real engines under load; this one drives each step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from berth.agent.service import AgentService
from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.gateway.dispatch import first_answer
from berth.routing.errors import EngineUnavailableError, EngineUnreachableError
from berth.routing.resolver import Upstream
from berth.routing.signals import SignalBoard
from berth.routing.waiting import GiveUp, WaitingAttempts
from berth.runtime.base import EngineExit
from berth.store import Store
from berth.vocab.states import DeploymentState
from support.fakes import FakeLink
from support.link_pair import FakeCore
from support.waiting import EVENT_TIMEOUT_S, wait_for_async
from test_failover import Engines, _answer

MODEL = "tiny"

pytestmark = pytest.mark.store_models((MODEL, "tiny.gguf"))


@contextlib.asynccontextmanager
async def leading(store: Store, link: FakeLink) -> AsyncIterator[LifecycleManager]:
    """A lifecycle manager that leads (its watcher runs), with a long probe interval: only an
    end reported says an engine is gone."""
    manager = LifecycleManager(
        store,
        LinkRegistry([link]),
        health_timeout_s=5,
        stop_grace_s=1,
        watch_interval_s=3600,
        probe_timeout_s=1,
        waiting=WaitingAttempts(),
    )
    await manager.start()
    try:
        yield manager
    finally:
        await manager.shutdown()


async def _ready(manager: LifecycleManager, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        record = await manager.deploy(DeployOptions(MODEL, "llamacpp", "local"))
        assert (await manager.wait_settled(record.id, 5)).state is DeploymentState.READY
        ids.append(record.id)
    return ids


def _routed(manager: LifecycleManager) -> set[str]:
    return {u.deployment_id for u in manager.candidates(MODEL)}


async def test_an_engine_end_leaves_routing_before_anything_else_and_is_restarted(
    store: Store,
) -> None:
    link = FakeLink()
    async with leading(store, link) as manager:
        killed, other = await _ready(manager, 2)
        waiting = manager._waiting  # the one the router shares
        assert waiting is not None
        upstream = next(u for u in manager.candidates(MODEL) if u.deployment_id == killed)
        request = asyncio.create_task(asyncio.sleep(3600))
        attempt = waiting.add(upstream, request, elsewhere=True)
        link.running.pop(killed)  # the engine is gone: what the runtime saw

        manager.engine_ended("local", killed, EngineExit(signal="SIGKILL"))

        # Synchronously: no request routed after this call can reach it.
        assert _routed(manager) == {other}
        assert attempt.given_up is GiveUp.FAILED
        with pytest.raises(asyncio.CancelledError):
            await request
        await wait_for_async(
            lambda: (
                store.get_deployment(killed).restart_count == 1
                and store.get_deployment(killed).state is DeploymentState.READY
            ),
            EVENT_TIMEOUT_S,
            "the supervisor to restart it",
        )
        record = store.get_deployment(killed)
        assert record.last_exit == "killed by SIGKILL"
        assert _routed(manager) == {killed, other}
        # A second report of the same end, or one for a deployment not ready, changes nothing.
        manager.engine_ended("local", "d-nosuch", None)
        assert _routed(manager) == {killed, other}


async def test_a_standby_leaves_an_engine_end_to_the_active(store: Store) -> None:
    link = FakeLink()
    async with leading(store, link) as manager:
        (deployment,) = await _ready(manager, 1)
        await manager.stand_down()  # lost the lease
        manager.engine_ended("local", deployment, None)
        assert _routed(manager) == {deployment}
        assert store.get_deployment(deployment).restart_count == 0


async def test_an_agent_reports_an_engine_end_in_the_next_heartbeat_at_once() -> None:
    core = FakeCore(9)
    service = AgentService(core)  # type: ignore[arg-type]
    assert not service.report_due.is_set()
    (ended,) = core.end_listeners
    ended("d-1", EngineExit(signal="SIGKILL"))
    assert service.report_due.is_set()  # the dialer sends a heartbeat now
    beat = service.heartbeat(1.0)
    assert [(e.deployment_id, e.exit_code, e.exit_signal) for e in beat.ended] == [
        ("d-1", None, "SIGKILL")
    ]
    assert not service.report_due.is_set()
    assert service.heartbeat(2.0).ended == []  # told once
    await service.close()


# -- a refused connection --------------------------------------------------------------------

A1 = Upstream("http://127.0.0.1:1", "d-a1", "n-a", MODEL)
A2 = Upstream("http://127.0.0.1:2", "d-a2", "n-a", MODEL)


class Refusing(Engines):
    """The attempts of :class:`Engines`, with some deployments refusing the connection."""

    def __init__(self, *refusing: str) -> None:
        super().__init__()
        self.refusing = set(refusing)

    async def attempt(self, upstream: Upstream) -> Any:
        if upstream.deployment_id in self.refusing:
            self.begun.append(upstream.deployment_id)
            raise EngineUnreachableError(upstream, "refused the connection", engine_side=True)
        return await super().attempt(upstream)


async def _dispatch(plan: list[Upstream], engines: Engines, waiting: WaitingAttempts) -> Any:
    return await first_answer(
        plan, engines.attempt, max_attempts=3, signals=SignalBoard(), clock=lambda: 0.0,
        request_id="r-1", waiting=waiting,
    )  # fmt: skip


async def test_a_refused_connection_goes_to_a_replica_on_the_same_node_and_marks_it() -> None:
    engines, waiting = Refusing("d-a1"), WaitingAttempts()
    failed: list[tuple[str, str]] = []
    waiting.on_engine_failed = lambda upstream, why: failed.append((upstream.deployment_id, why))
    engines.gate(A2).set_result(_answer("a2"))
    chosen, answer = await _dispatch([A1, A2], engines, waiting)
    assert (chosen, answer.name) == (A2, "a2")  # the node was not barred for it
    assert failed == [("d-a1", "refused the connection")]


async def test_with_no_replica_left_a_refused_connection_is_a_503_with_retry_after() -> None:
    engines, waiting = Refusing("d-a1", "d-a2"), WaitingAttempts()
    with pytest.raises(EngineUnavailableError) as raised:
        await _dispatch([A1, A2], engines, waiting)
    assert raised.value.http_status == 503 and raised.value.retry_after_s >= 1
    assert engines.begun == ["d-a1", "d-a2"]
    # A node that could not be reached at all stays a 502, and bars the node.
    unreachable = EngineUnreachableError(A1, "could not be reached (node n-a is not connected)")
    assert not unreachable.engine_side and unreachable.http_status == 502
