"""The host's shared state (`berth.host`) in one process: two workers' views of one state
file, used one after the other, count once for the host; full tables, collisions of the
open addressing, a row given up and used again, reclaim; the budgets' reservations of the
in-process admission; a slot handed from one worker's gate to another's over the wake
socket. The same with real processes: `tests/test_host_processes.py`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from berth.admission import Admission, ManualClock, QuotaExceededError, Ticket, UsageLedger
from berth.admission.gate import SlotGate
from berth.admission.quotas import DEFAULT_COMPLETION_RESERVE
from berth.config import TierTable
from berth.host import HostFileError, HostState
from berth.host.keys import KeyCounters
from berth.routing.prefix_blocks import PromptBlocks
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.routing.signals import SignalBoard
from support.host_workers import KEY_ID, flood_key


class Sink:
    def add_usage(self, batch: object) -> int:
        return 0


class Slotted:
    """A candidate deployment and its slots."""

    def __init__(self, deployment_id: str, slots: int | None) -> None:
        self.deployment_id = deployment_id
        self.slots = slots


@pytest.fixture
def path(tmp_path: Path) -> Iterator[Path]:
    state = HostState.create(
        tmp_path / "host.state",
        workers=2,
        key_rows=8,
        deployment_rows=8,
        prefix_rows=64,
        affinity_rows=16,
    )
    yield state.region.path
    state.close()


@pytest.fixture
def views(path: Path) -> Iterator[tuple[HostState, HostState]]:
    first, second = HostState.attach(path, 0), HostState.attach(path, 1)
    yield first, second
    first.close()
    second.close()


def make_admission(counters: KeyCounters | None = None) -> Admission:
    ledger = UsageLedger(Sink())  # type: ignore[arg-type]
    if counters is None:
        return Admission(TierTable(), ledger, clock=ManualClock())
    return Admission(TierTable(), ledger, clock=ManualClock(), counters=counters)


def settle(admission: Admission, ticket: Ticket, tokens: int) -> None:
    admission.settle(
        ticket,
        node_id="local",
        error=False,
        prompt_tokens=tokens,
        completion_tokens=0,
        estimated=False,
    )


def test_two_workers_count_one_keys_requests_once(views: tuple[HostState, HostState]) -> None:
    one, two = make_admission(views[0].keys), make_admission(views[1].keys)
    key = flood_key(rpm=3, max_concurrency=2)
    first = one.admit(key, "m", 100)
    second = two.admit(key, "m", 100)
    with pytest.raises(QuotaExceededError, match="already has 2 requests in flight"):
        one.admit(key, "m", 100)
    assert one.use_of(KEY_ID).in_flight == two.use_of(KEY_ID).in_flight == 2
    settle(one, first, 5)
    settle(one, second, 5)  # settled in the other worker: the count is the host's
    two.admit(key, "m", 100)
    with pytest.raises(QuotaExceededError) as spent:
        one.admit(key, "m", 100)
    assert spent.value.error_code == "rpm_exceeded"  # 3 a minute, whoever admitted them
    assert one.use_of(KEY_ID).in_flight == 1
    assert two.use_of(KEY_ID).day_tokens == 10


def test_budgets_are_seeded_once_and_reserved_across_workers(
    views: tuple[HostState, HostState],
) -> None:
    one, two = make_admission(views[0].keys), make_admission(views[1].keys)
    key = flood_key(daily_tokens=1000)
    one.load([key], {KEY_ID: (400, 400)})
    two.load([key], {KEY_ID: (0, 0)})  # a later worker: the host's count wins
    assert two.use_of(KEY_ID).day_tokens == 400
    one.admit(key, "m", 400, 300)  # reserves 100 + 300: 800 of 1000 counted
    two.admit(key, "m", 400, 100)  # reserves 200: 1000 counted
    with pytest.raises(QuotaExceededError, match=r"400 tokens today \(UTC\) \(and 600 are res"):
        one.admit(key, "m", 4, 1)


def test_in_process_budgets_reserve_max_tokens_or_the_default() -> None:
    alone = make_admission()
    key = flood_key(daily_tokens=1500)
    first = alone.admit(key, "m", 40)  # 10 for the prompt, and the default
    assert first.budget_tokens == 10 + DEFAULT_COMPLETION_RESERVE
    second = alone.admit(key, "m", 40, 500)  # admitted: 1034 of 1500 counted
    assert second.budget_tokens == 510
    with pytest.raises(QuotaExceededError) as refused:
        alone.admit(key, "m", 40, 1)
    assert refused.value.error_code == "daily_tokens_exceeded"
    assert "and 1544 are reserved by requests in flight" in str(refused.value)
    settle(alone, first, 20)
    settle(alone, second, 20)
    assert alone.use_of(KEY_ID).day_tokens == 40
    alone.admit(key, "m", 40, 1)


def test_a_full_key_table_counts_a_key_in_its_process_alone(
    views: tuple[HostState, HostState],
) -> None:
    state = views[0]
    counting = make_admission(state.keys)
    for number in range(8):  # every row of the table, each found past the collisions
        counting.admit(flood_key(f"k-{number}", max_concurrency=5), "m", 10)
    assert state.keys.overflowed == 0
    extra = flood_key("k-extra", max_concurrency=1)
    counting.admit(extra, "m", 10)
    assert state.keys.overflowed == 1
    with pytest.raises(QuotaExceededError):  # still limited, in this process
        counting.admit(extra, "m", 10)
    for number in range(8):
        assert counting.use_of(f"k-{number}").in_flight == 1  # each its own row


def test_deployment_rows_collide_fill_and_are_given_up_and_reused(
    views: tuple[HostState, HostState],
) -> None:
    one, two = (view.deployments for view in views)
    for number in range(8):
        assert one.take(f"d-{number}", 1)
    assert [two.in_use(f"d-{number}") for number in range(8)] == [1] * 8
    assert one.take("d-extra", 1)  # no row: counted in this process alone
    assert two.take("d-extra", 1)
    assert one.overflowed == 1
    assert not one.forget("d-0")  # a slot is still held there
    assert one.release("d-0", lambda: None) is None
    assert one.forget("d-0")
    assert two.take("d-late", 1)  # d-0's row, given up, is used again
    assert one.in_use("d-late") == 1
    assert one.overflowed == 1


def test_reclaim_gives_back_what_a_dead_worker_held(
    path: Path, views: tuple[HostState, HostState]
) -> None:
    alive, dead = views
    admission = make_admission(dead.keys)
    key = flood_key(max_concurrency=2, daily_tokens=10_000)
    admission.admit(key, "m", 40, 60)
    admission.admit(key, "m", 40, 60)
    assert dead.deployments.take("d-1", 1)
    dead.deployments.started("d-1", "node-a")
    supervisor = HostState.attach(path, None)  # the parent's view
    assert supervisor.reclaim(1) == 1
    use = make_admission(alive.keys)
    use.update(key)
    assert use.use_of(KEY_ID).in_flight == 0
    assert alive.deployments.in_use("d-1") == 0
    assert alive.deployments.in_flight("d-1") == 0
    assert alive.deployments.take("d-1", 1)
    supervisor.close()


async def test_a_slot_given_back_in_one_worker_wakes_a_request_waiting_in_another(
    views: tuple[HostState, HostState],
) -> None:
    giver = SlotGate(slots=views[0].deployments)
    waiter = SlotGate(slots=views[1].deployments, timeout_s=10.0)
    candidates = [Slotted("d-1", 1)]
    held = giver.take_free(candidates)
    assert held == "d-1"
    waiting = asyncio.create_task(waiter.acquire("k", 0, "m", candidates))
    while waiter.scheduler.waiting == 0:
        await asyncio.sleep(0)
    giver.release(held)  # the slot moves to worker 1, which is woken
    assert await asyncio.wait_for(waiting, 10) == "d-1"
    assert views[0].deployments.in_use("d-1") == 1
    waiter.release("d-1")
    assert views[0].deployments.in_use("d-1") == 0


def test_prefix_and_session_records_are_bounded_and_shared(
    views: tuple[HostState, HostState],
) -> None:
    one, two = views
    blocks = PromptBlocks((1, 2, 3))
    one.prefixes.record("d-a", blocks)
    assert two.prefixes.matches(blocks, ["d-a", "d-b"]) == {"d-a": 3, "d-b": 0}
    for number in range(200):  # far more than the 64 entries
        one.prefixes.record("d-b", PromptBlocks((1000 + number,)))
    assert len(two.prefixes) <= 64
    entries = two.prefixes.entries_of("d-b")
    assert entries > 0
    assert two.prefixes.drop("d-b") == entries
    assert one.prefixes.entries_of("d-b") == 0
    one.sessions.record("session:s", "node-1")
    assert two.sessions.get("session:s") == "node-1"
    for number in range(100):
        one.sessions.record(f"session:{number}", "node-2")
    assert len(two.sessions) <= 16
    assert two.sessions.forget_node("node-2") > 0
    assert one.sessions.peek("session:99") is None


def test_a_file_of_another_kind_is_refused_with_its_path(tmp_path: Path) -> None:
    stray = tmp_path / "stray"
    stray.write_bytes(b"not a state file at all, but long enough to read a header")
    with pytest.raises(HostFileError, match=str(stray)):
        HostState.attach(stray, 0)


def test_a_worker_index_out_of_the_files_columns_is_refused(path: Path) -> None:
    with pytest.raises(ValueError, match=r"worker 2 is not in 0\.\.1"):
        HostState.attach(path, 2)


def test_the_clis_requests_are_not_counted_for_the_host(views: tuple[HostState, HostState]) -> None:
    counting = make_admission(views[0].keys)
    ticket = counting.admit(None, "m", 10)
    settle(counting, ticket, 3)
    assert views[0].keys.overflowed == 0
    assert ticket.quota.in_flight == 0


async def test_slots_given_back_go_round_the_waiting_workers_in_turn(tmp_path: Path) -> None:
    state = HostState.create(tmp_path / "three.state", workers=3, prefix_rows=8, affinity_rows=8)
    views = [HostState.attach(state.region.path, worker) for worker in range(3)]
    gates = [SlotGate(slots=view.deployments, timeout_s=10.0) for view in views]
    candidates = [Slotted("d-1", 1)]
    served: list[int] = []

    async def request(worker: int) -> None:
        held = await gates[worker].acquire(f"k-{worker}", 0, "m", candidates)
        served.append(worker)
        await asyncio.sleep(0)  # the engine answering
        gates[worker].release(held)

    try:
        assert gates[0].take_free(candidates) == "d-1"
        tasks = [asyncio.create_task(request(worker)) for worker in (1, 1, 2, 2)]
        while sum(gate.scheduler.waiting for gate in gates) < 4:
            await asyncio.sleep(0)
        gates[0].release("d-1")
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert served == [1, 2, 1, 2]  # one of every two slots to each waiting worker
        assert views[0].deployments.in_use("d-1") == 0
    finally:
        for view in views:
            view.close()
        state.close()


def test_the_prefix_record_holds_64_deployments_and_drop_gives_a_place_back(
    views: tuple[HostState, HostState],
) -> None:
    one, two = views
    blocks = PromptBlocks((7, 8))
    for number in range(64):
        one.prefixes.record(f"d-{number}", blocks)
    one.prefixes.record("d-late", blocks)  # no place left: not recorded
    assert two.prefixes.matches(blocks, ["d-0", "d-63", "d-late"]) == {
        "d-0": 2,
        "d-63": 2,
        "d-late": 0,
    }
    assert two.prefixes.drop("d-5") == 2
    one.prefixes.record("d-late", blocks)
    assert two.prefixes.matches(blocks, ["d-5", "d-late"]) == {"d-5": 0, "d-late": 2}


def test_a_row_given_up_and_taken_by_another_deployment_is_looked_up_again(
    views: tuple[HostState, HostState],
) -> None:
    one, two = (view.deployments for view in views)
    one.started("d-old", "node-a")
    assert two.in_flight("d-old") == 1  # two has found d-old's row
    one.finished("d-old", "node-a")
    assert one.forget("d-old")
    assert two.take("d-new", 1)  # may take d-old's row
    assert two.in_flight("d-old") == 0  # not d-new's counts under d-old's old row
    assert one.in_use("d-new") == 1


async def test_a_grant_whose_wake_was_lost_is_taken_with_the_next_wake(
    views: tuple[HostState, HostState],
) -> None:
    giver = SlotGate(slots=views[0].deployments)
    waiter = SlotGate(slots=views[1].deployments, timeout_s=10.0)
    first, second = [Slotted("d-1", 1)], [Slotted("d-2", 1)]
    assert giver.take_free(first) == "d-1"
    assert giver.take_free(second) == "d-2"
    one = asyncio.create_task(waiter.acquire("k", 0, "m", first))
    two = asyncio.create_task(waiter.acquire("k", 0, "m", second))
    while waiter.scheduler.waiting < 2:
        await asyncio.sleep(0)
    box = views[1].deployments.wake_box
    assert box is not None
    giver.release("d-1")
    assert box.drain()  # the wake for d-1 is lost
    giver.release("d-2")  # d-2's wake brings both
    assert await asyncio.wait_for(asyncio.gather(one, two), 10) == ["d-1", "d-2"]


class Fleet:
    """Three deployments on three nodes, for the model ``m``."""

    def candidates(self, model: str) -> list[Upstream]:
        return [Upstream(f"http://{n}", f"dep-{n}", n, model) for n in ("n1", "n2", "n3")]

    def models(self) -> list[str]:
        return ["m"]


def conversation(number: int, turns: int) -> dict[str, object]:
    messages = [{"role": "system", "content": f"rules of conversation {number}. " * 60}]
    for turn in range(turns):
        messages += [
            {"role": "user", "content": f"question {turn}"},
            {"role": "assistant", "content": f"answer {turn}"},
        ]
    return {"messages": [*messages, {"role": "user", "content": f"question {turns}"}]}


def test_routers_in_two_workers_send_a_conversation_to_the_same_engine(tmp_path: Path) -> None:
    state = HostState.create(tmp_path / "routing.state", workers=2)
    views = [HostState.attach(state.region.path, worker) for worker in (0, 1)]

    def router(view: HostState) -> Router:
        return Router(
            Fleet(),
            policy="prefix",
            signals=SignalBoard(in_flight=view.deployments),
            prefixes=view.prefixes,
            affinity=view.sessions,
        )

    first, second = router(views[0]), router(views[1])
    chosen = {}
    for number in range(6):
        plan, key = first.plan_request("m", [], conversation(number, 0))
        first.succeeded(key, plan[0])
        chosen[number] = plan[0].deployment_id
    assert len(set(chosen.values())) > 1  # spread over the engines
    for number in reversed(range(6)):  # the next turns, taken by the other worker
        plan, _key = second.plan_request("m", [], conversation(number, 1))
        assert plan[0].deployment_id == chosen[number]
    session = [(b"x-session-id", b"s-1")]
    plan, key = first.plan_request("m", session, {"messages": []})
    first.succeeded(key, plan[-1])
    assert second.plan_request("m", session, {"messages": []})[0][0].node_id == plan[-1].node_id
    for view in (*views, state):
        view.close()
