"""READY is written by the one writer with the ready table leading: whoever reads READY (a
poller of the store, the state listener) finds the deployment routed, a write that fails
leaves it unrouted, and a deployment whose link dropped is not routed. Over a real store and
the real ready table."""

from __future__ import annotations

import pytest

from berth.cluster.leader.agent_link import EngineEndpoint
from berth.deployments.ready_table import ReadyTable
from berth.deployments.transitions import StateWriter
from berth.errors import InvalidTransitionError
from berth.store import Store
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState

pytestmark = pytest.mark.store_models(("tiny", "/models/tiny.gguf"))


def loading(store: Store) -> DeploymentRecord:
    record = store.create_deployment("tiny", "llamacpp", "process", "local")
    return store.transition_deployment(record.id, DeploymentState.LOADING)


def endpoint_of(record: DeploymentRecord) -> EngineEndpoint:
    return EngineEndpoint(record.id, "http://127.0.0.1:8080", 4321, 8080)


def routed(table: ReadyTable, deployment_id: str) -> bool:
    return table.ready_upstream(deployment_id) is not None


async def test_the_table_routes_a_deployment_before_the_store_says_ready(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = ReadyTable()
    heard: list[tuple[DeploymentState, bool]] = []
    writer = StateWriter(store, table, lambda r: heard.append((r.state, routed(table, r.id))))
    record = loading(store)
    seen_at_write: list[bool] = []
    write = store.transition_deployment

    def spying_write(deployment_id: str, target: DeploymentState, **fields: object) -> object:
        written = write(deployment_id, target, **fields)  # type: ignore[arg-type]
        # The moment the row says READY, before the writer's task runs again: a poller of
        # the store on the event loop could read it now.
        seen_at_write.append(routed(table, deployment_id))
        return written

    monkeypatch.setattr(store, "transition_deployment", spying_write)

    ready = await writer.transition(
        record.id, DeploymentState.READY, endpoint=endpoint_of(record), port=8080, pid=4321
    )

    assert ready.state is DeploymentState.READY
    assert seen_at_write == [True]
    assert heard == [(DeploymentState.READY, True)]
    [upstream] = table.candidates("tiny")
    assert (upstream.deployment_id, upstream.base_url) == (record.id, "http://127.0.0.1:8080")


async def test_a_ready_write_the_state_machine_refuses_leaves_the_table_as_it_was(
    store: Store,
) -> None:
    table = ReadyTable()
    writer = StateWriter(store, table)
    record = loading(store)
    store.transition_deployment(record.id, DeploymentState.STOPPING)  # a stop won the race

    with pytest.raises(InvalidTransitionError):
        await writer.transition(record.id, DeploymentState.READY, endpoint=endpoint_of(record))

    assert not routed(table, record.id)
    assert store.get_deployment(record.id).state is DeploymentState.STOPPING


async def test_a_deployment_whose_link_dropped_is_ready_but_not_routed(store: Store) -> None:
    table = ReadyTable()
    writer = StateWriter(store, table)
    record = loading(store)

    ready = await writer.transition(
        record.id, DeploymentState.READY, endpoint=endpoint_of(record), routable=lambda: False
    )

    assert ready.state is DeploymentState.READY
    assert not routed(table, record.id)


async def test_routing_again_takes_a_ready_record_only(store: Store) -> None:
    table = ReadyTable()
    writer = StateWriter(store, table)
    record = loading(store)

    with pytest.raises(ValueError, match="not ready"):
        writer.route(record, endpoint_of(record))
    assert not routed(table, record.id)

    ready = store.transition_deployment(record.id, DeploymentState.READY)
    writer.route(ready, endpoint_of(ready))
    assert routed(table, record.id)
