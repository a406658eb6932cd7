"""Fair admission without the proxy: a deployment's slots (its engine's flags, or its
service's capacity, changed while it serves), the slot scheduler's order (tier priority,
round-robin across keys, first come first served within a key), its bound, requests leaving
it, and the async gate's answers (full, too long a wait, a client gone) and metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry

from berth.admission import (
    QueueCollector,
    QueueFullError,
    QueueTimeoutError,
    SlotGate,
    SlotScheduler,
    Waiter,
    gate_slots,
)
from berth.cluster.leader.agent_link import EngineEndpoint
from berth.cluster.protocol.payloads import AdoptedState
from berth.deployments.ready_table import ReadyTable
from berth.vocab.records import DeploymentRecord
from berth.vocab.slots import engine_slots
from berth.vocab.states import DeploymentState


@dataclass(frozen=True)
class Deployment:
    deployment_id: str
    slots: int | None


D1 = Deployment("d-1", 2)
D2 = Deployment("d-2", 1)


@pytest.mark.parametrize(
    ("engine", "args", "slots"),
    [
        ("llamacpp", (), None),
        ("llamacpp", ("--parallel", "2"), 2),
        ("llamacpp", ("-np", "3", "--ctx-size", "4096"), 3),
        ("llamacpp", ("--parallel=6",), 6),
        ("llamacpp", ("--parallel", "-1"), None),
        ("llamacpp", ("-np", "2", "-np", "5"), 5),
        ("llamacpp", ("--parallel",), None),
        ("llamacpp", ("--parallel", "²"), None),  # a digit to str.isdigit, not to int
        ("vllm", (), None),
        ("vllm", ("--max-num-seqs", "64"), 64),
        ("sglang", ("--max-running-requests=16",), 16),
        ("sglang", ("--max-running-requests", "lots"), None),
        ("other", ("--parallel", "2"), None),
    ],
)
def test_an_engines_slots_come_from_its_flag_or_are_unknown(
    engine: str, args: tuple[str, ...], slots: int | None
) -> None:
    assert engine_slots(engine, args) == slots


@pytest.mark.parametrize(
    ("engine", "args", "capacity", "slots", "source", "detail"),
    [
        # llama-server's --parallel -1 ("auto") gives 4
        ("llamacpp", (), None, 4, "engine_default", "llama.cpp's default, --parallel auto"),
        ("llamacpp", ("--parallel", "-1"), None, 4, "engine_default",
         "llama.cpp's default, --parallel auto"),
        ("llamacpp", ("-np", "2"), None, 2, "flag", "--parallel 2"),
        ("vllm", (), None, 256, "engine_default", "vLLM's default --max-num-seqs"),
        # SGLang sizes itself at start, an adopted endpoint says nothing: default_slots
        ("sglang", (), None, 6, "default_slots", "default_slots: its engine does not say"),
        (None, (), None, 6, "default_slots", "default_slots: an adopted endpoint does not say"),
        ("vllm", ("--max-num-seqs", "64"), None, 64, "flag", "--max-num-seqs 64"),
        ("llamacpp", ("--parallel", "8"), 3, 3, "service", "the service's capacity setting"),
        ("sglang", (), 5, 5, "service", "the service's capacity setting"),
    ],
)  # fmt: skip
def test_the_gates_slots_are_the_services_setting_else_the_engines_else_default_slots(
    engine: str | None,
    args: tuple[str, ...],
    capacity: int | None,
    slots: int,
    source: str,
    detail: str,
) -> None:
    counted = gate_slots(engine, args, capacity, default_slots=6)
    assert (counted.slots, counted.source, counted.detail) == (slots, source, detail)
    assert counted.assumed == (source in ("engine_default", "default_slots"))


def test_a_request_takes_a_free_slot_at_the_first_candidate_that_has_one() -> None:
    scheduler = SlotScheduler(max_waiting=10)
    assert scheduler.try_take([D2, D1]) == "d-2"
    assert scheduler.try_take([D2, D1]) == "d-1"
    assert scheduler.try_take([D2, D1]) == "d-1"
    assert scheduler.try_take([D2, D1]) is None
    assert (scheduler.in_use("d-1"), scheduler.in_use("d-2")) == (2, 1)
    assert scheduler.release("d-2") is None  # nobody waits: the slot is free again
    assert scheduler.try_take([D1, D2]) == "d-2"


def waiter(key: str, priority: int = 50, deployments: tuple[str, ...] = ("d-1",)) -> Waiter:
    return Waiter(key, priority, "m", deployments)


def test_a_key_with_fifty_waiting_gets_one_slot_in_turn_with_a_key_sending_one_at_a_time() -> None:
    scheduler = SlotScheduler(max_waiting=100)
    assert scheduler.try_take([D1]) and scheduler.try_take([D1])  # both slots busy
    heavy = [waiter("heavy") for _ in range(50)]
    for each in heavy:
        assert scheduler.enqueue(each)
    granted: list[str] = []
    for _ in range(10):
        light = waiter("light")
        assert scheduler.enqueue(light)
        before = len(granted)
        for _ in range(60):  # bounded: first come, first served would need 50 turns
            if light.granted is not None:
                break
            served = scheduler.release("d-1")  # a request ends; its slot goes on
            assert served is not None
            granted.append(served.key_id)
            if served.key_id == "heavy":
                assert scheduler.enqueue(waiter("heavy"))  # the heavy key keeps 50 waiting
        # The light key waited for at most one slot given to the heavy key.
        assert granted[before:].count("heavy") <= 1
    assert granted.count("light") == 10
    assert scheduler.waiting == 50


def test_within_a_key_requests_are_served_in_the_order_they_came() -> None:
    scheduler = SlotScheduler(max_waiting=10)
    scheduler.try_take([D2])
    first, second = waiter("a", deployments=("d-2",)), waiter("a", deployments=("d-2",))
    scheduler.enqueue(first)
    scheduler.enqueue(second)
    assert scheduler.release("d-2") is first
    assert scheduler.release("d-2") is second


def test_a_higher_tier_priority_is_served_first_however_late_it_came() -> None:
    scheduler = SlotScheduler(max_waiting=10)
    scheduler.try_take([D2])
    low = [waiter("free", 10, ("d-2",)) for _ in range(3)]
    for each in low:
        scheduler.enqueue(each)
    high = waiter("team", 60, ("d-2",))
    scheduler.enqueue(high)
    assert scheduler.release("d-2") is high
    assert scheduler.release("d-2") is low[0]


def test_a_queued_request_takes_a_slot_of_another_deployment_that_frees_first() -> None:
    scheduler = SlotScheduler(max_waiting=10)
    for _ in range(3):
        scheduler.try_take([D1, D2])
    only_d1 = waiter("a", deployments=("d-1",))
    either = waiter("b", deployments=("d-1", "d-2"))
    scheduler.enqueue(only_d1)
    scheduler.enqueue(either)
    assert scheduler.release("d-2") is either  # the first waiter cannot use d-2
    assert either.granted == "d-2"
    assert scheduler.release("d-1") is only_d1


def test_the_queue_is_bounded_and_a_request_that_leaves_is_out_at_once() -> None:
    scheduler = SlotScheduler(max_waiting=2)
    scheduler.try_take([D2])
    gone, stays = waiter("a", deployments=("d-2",)), waiter("b", deployments=("d-2",))
    assert scheduler.enqueue(gone) and scheduler.enqueue(stays)
    assert not scheduler.enqueue(waiter("c", deployments=("d-2",)))  # full
    assert dict(scheduler.waiting_by_model()) == {"m": 2}
    assert scheduler.leave(gone)
    assert scheduler.waiting == 1
    assert scheduler.release("d-2") is stays  # the slot skips the request that left
    assert not scheduler.leave(stays)  # given a slot already: the caller gives it back
    assert scheduler.waiting == 0
    assert dict(scheduler.waiting_by_model()) == {}


def test_a_queue_of_size_zero_refuses_at_once() -> None:
    scheduler = SlotScheduler(max_waiting=0)
    scheduler.try_take([D2])
    assert not scheduler.enqueue(waiter("a", deployments=("d-2",)))


# -- the async gate ------------------------------------------------------------------------


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met"
        await asyncio.sleep(0.001)


async def test_a_waiting_request_wakes_with_the_slot_given_back() -> None:
    gate = SlotGate(max_waiting=4, timeout_s=30)
    assert await gate.acquire("a", 50, "m", [D2]) == "d-2"
    waiting = asyncio.create_task(gate.acquire("b", 50, "m", [D2]))
    await until(lambda: gate.scheduler.waiting == 1)
    gate.release("d-2")
    assert await waiting == "d-2"
    assert gate.scheduler.in_use("d-2") == 1


async def test_a_full_queue_and_a_wait_too_long_are_503_with_retry_after() -> None:
    gate = SlotGate(max_waiting=1, timeout_s=0.05)
    await gate.acquire("a", 50, "m", [D2])
    waiting = asyncio.create_task(gate.acquire("b", 50, "m", [D2]))
    await until(lambda: gate.scheduler.waiting == 1)
    with pytest.raises(QueueFullError) as full:
        await gate.acquire("c", 50, "m", [D2])
    assert (full.value.http_status, full.value.error_code) == (503, "queue_full")
    assert full.value.retry_after_s > 0
    with pytest.raises(QueueTimeoutError) as late:
        await waiting
    assert (late.value.http_status, late.value.error_code) == (503, "queue_timeout")
    assert gate.scheduler.waiting == 0
    assert gate.stats.dropped == {("m", "queue_full"): 1, ("m", "queue_timeout"): 1}


async def test_a_cancelled_waiter_leaves_the_queue_and_its_turn_goes_to_the_next() -> None:
    gate = SlotGate(max_waiting=4, timeout_s=30)
    await gate.acquire("a", 50, "m", [D2])
    gone = asyncio.create_task(gate.acquire("b", 50, "m", [D2]))
    next_one = asyncio.create_task(gate.acquire("c", 50, "m", [D2]))
    await until(lambda: gate.scheduler.waiting == 2)
    gone.cancel()
    await until(lambda: gate.scheduler.waiting == 1)
    gate.release("d-2")
    assert await next_one == "d-2"
    assert gone.cancelled()
    assert gate.stats.dropped == {("m", "client_left"): 1}


async def test_a_slot_given_to_a_waiter_cancelled_before_it_woke_is_passed_on() -> None:
    gate = SlotGate(max_waiting=4, timeout_s=30)
    await gate.acquire("a", 50, "m", [D2])
    gone = asyncio.create_task(gate.acquire("b", 50, "m", [D2]))
    next_one = asyncio.create_task(gate.acquire("c", 50, "m", [D2]))
    await until(lambda: gate.scheduler.waiting == 2)
    gate.release("d-2")  # to "b", which is cancelled before it runs again
    gone.cancel()
    assert await next_one == "d-2"
    assert gate.scheduler.in_use("d-2") == 1


async def test_a_request_that_may_go_to_an_engine_of_unknown_slots_is_not_held() -> None:
    gate = SlotGate(max_waiting=0, timeout_s=30)
    unknown = Deployment("adopted-x", None)
    for _ in range(5):
        assert await gate.acquire("a", 50, "m", [D2, unknown]) is None
    assert gate.scheduler.in_use("d-2") == 0


async def test_a_retry_moves_the_slot_to_the_deployment_that_answered() -> None:
    gate = SlotGate(max_waiting=4, timeout_s=30)
    held = await gate.acquire("a", 50, "m", [D2, D1])
    assert held == "d-2"
    waiting = asyncio.create_task(gate.acquire("b", 50, "m", [D2]))
    await until(lambda: gate.scheduler.waiting == 1)
    assert gate.move(held, D1) == "d-1"
    assert await waiting == "d-2"
    assert gate.scheduler.in_use("d-1") == 1


async def test_the_metrics_show_the_depth_the_waits_and_the_requests_dropped() -> None:
    gate = SlotGate(max_waiting=4, timeout_s=30)
    registry = CollectorRegistry()
    registry.register(QueueCollector(gate))
    await gate.acquire("a", 50, "m", [D2])
    waiting = asyncio.create_task(gate.acquire("b", 50, "m", [D2]))
    await until(lambda: gate.scheduler.waiting == 1)
    assert registry.get_sample_value("berth_admission_queue_depth", {"model": "m"}) == 1
    gate.release("d-2")
    await waiting
    assert registry.get_sample_value("berth_admission_queue_depth", {"model": "m"}) is None
    count = registry.get_sample_value("berth_admission_queue_wait_seconds_count", {"model": "m"})
    assert count == 1
    inf = {"model": "m", "le": "+Inf"}
    assert registry.get_sample_value("berth_admission_queue_wait_seconds_bucket", inf) == 1
    gone = asyncio.create_task(gate.acquire("c", 50, "m", [D2]))
    await until(lambda: gate.scheduler.waiting == 1)
    gone.cancel()
    await until(lambda: gate.scheduler.waiting == 0)
    dropped = {"model": "m", "reason": "client_left"}
    assert registry.get_sample_value("berth_admission_queue_dropped_total", dropped) == 1


def test_a_ready_deployment_carries_its_engines_slots_to_the_proxy() -> None:
    table = ReadyTable()
    now = datetime(2026, 1, 1, tzinfo=UTC)
    for deployment_id, args in (("d-1", ("--parallel", "2")), ("d-2", ())):
        record = DeploymentRecord(
            deployment_id, "smollm2", "llamacpp", "process", "local", DeploymentState.READY,
            8080, 1, (), None, args, "smollm2", None, now, now,
        )  # fmt: skip
        table.mark_ready(record, EngineEndpoint(deployment_id, "http://127.0.0.1:8080", 1, 8080))
    slots = {u.deployment_id: u.slots for u in table.candidates("smollm2")}
    assert slots == {"d-1": 2, "d-2": 4}


def deployment(deployment_id: str, served: str, args: tuple[str, ...] = ()) -> DeploymentRecord:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return DeploymentRecord(
        deployment_id, served, "llamacpp", "process", "local", DeploymentState.READY,
        8080, 1, (), None, args, served, None, now, now,
    )  # fmt: skip


def test_a_services_capacity_setting_gives_its_deployments_their_slots_until_it_changes() -> None:
    changed: list[tuple[str, int | None]] = []
    table = ReadyTable(on_slots=lambda d, slots: changed.append((d, slots)))
    table.set_service_capacities({"chat": 2, "other": None})
    endpoint = EngineEndpoint("d-1", "http://127.0.0.1:8080", 1, 8080)
    table.mark_ready(deployment("d-1", "chat", ("--parallel", "8")), endpoint)
    table.mark_ready(deployment("d-2", "other", ("--parallel", "8")), endpoint)
    assert [u.slots for u in table.candidates("chat")] == [2]
    assert [u.slots for u in table.candidates("other")] == [8]
    assert changed == []  # set before they were ready: nothing to tell

    table.set_service_capacities({"chat": 5, "other": 1})  # `berth service scale --capacity`
    assert [u.slots for u in table.candidates("chat")] == [5]
    assert [u.slots for u in table.candidates("other")] == [1]
    assert sorted(changed) == [("d-1", 5), ("d-2", 1)]

    table.set_service_capacities({})  # the services are gone: the engines' slots again
    assert [u.slots for u in table.candidates("chat")] == [8]
    assert [u.slots for u in table.candidates("other")] == [8]


async def test_waiters_take_the_slots_a_larger_capacity_adds_at_once() -> None:
    gate = SlotGate(max_waiting=10, timeout_s=10.0)
    small = Deployment("d-1", 1)
    first = await gate.acquire("a", 50, "m", [small])
    waiting = [asyncio.create_task(gate.acquire(k, 50, "m", [small])) for k in ("b", "c", "d")]
    await until(lambda: gate.scheduler.waiting == 3)
    gate.resize("d-1", 3)  # two more slots: the first two waiters in fair order go
    await until(lambda: waiting[0].done() and waiting[1].done())
    assert gate.scheduler.waiting == 1
    assert gate.scheduler.in_use("d-1") == 3
    gate.resize("d-1", 1)  # smaller: nobody goes until those in flight are down to it
    for task in waiting[:2]:
        gate.release(await task)
    await asyncio.sleep(0)
    assert not waiting[2].done()
    assert gate.scheduler.in_use("d-1") == 1
    assert first is not None
    gate.release(first)  # now one in use, at the new capacity: the last waiter goes
    assert await waiting[2] == "d-1"


async def test_an_adopted_endpoint_and_an_sglang_engine_without_a_count_keep_the_queue_on() -> None:
    # One deployment of unknown slots used to turn the fair queue off for its whole model:
    # each now gets default_slots, and a request beyond every slot waits its turn.
    table = ReadyTable(default_slots=2)
    endpoint = EngineEndpoint("d-1", "http://127.0.0.1:8080", 1, 8080)
    table.mark_ready(deployment("d-1", "chat", ("--parallel", "1")), endpoint)
    sglang = replace(deployment("d-2", "chat"), engine="sglang")
    table.mark_ready(sglang, EngineEndpoint("d-2", "http://127.0.0.1:8081", 1, 8081))
    state = AdoptedState(name="ollama", served_model_name="chat", engine_model="qwen",
                         host="127.0.0.1", port=11434, alive=True)  # fmt: skip
    table.adopted_reported("local", [state])
    candidates = {u.deployment_id: u for u in table.candidates("chat")}
    assert {d: (u.slots, u.slots_assumed, u.slots_from) for d, u in candidates.items()} == {
        "d-1": (1, False, "--parallel 1"),
        "d-2": (2, True, "default_slots: its engine does not say"),
        "adopted:ollama": (2, True, "default_slots: an adopted endpoint does not say"),
    }
    gate = SlotGate(max_waiting=10, timeout_s=30)
    plan = list(candidates.values())
    held = [await gate.acquire(f"k-{i}", 50, "chat", plan) for i in range(5)]
    assert sorted(h for h in held if h is not None) == [
        "adopted:ollama", "adopted:ollama", "d-1", "d-2", "d-2"
    ]  # fmt: skip
    sixth = asyncio.create_task(gate.acquire("k-6", 50, "chat", plan))
    await until(lambda: gate.scheduler.waiting == 1)  # held, not sent past the slots
    gate.release("adopted:ollama")
    assert await sixth == "adopted:ollama"
