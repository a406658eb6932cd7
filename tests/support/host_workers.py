"""Serving-process stand-ins for the host's shared state tests (`tests/test_host_processes.py`):
each function runs in a process of its own (``python -m support.host_workers NAME ARGS``, a
fresh interpreter, as a spawned worker is), attaches to the host's state file as one worker,
and does to one key or one deployment what a serving process does on the request path. Each
talks to the test over its stdin and stdout, one JSON value a line (``conn``: it waits for a
go, sends what it counted); what must be measured inside a critical section is counted in a
:class:`PeakCounter` (a file under an ``fcntl`` lock).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import struct
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from berth.admission import Admission, ManualClock, QuotaExceededError, Ticket, UsageLedger
from berth.admission.gate import SlotGate
from berth.config import TierTable
from berth.host import HostState
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import ApiKeyRecord, UsageRecord

KEY_ID = "k-flood"
_PAIR = struct.Struct("<qq")


class PeakCounter:
    """Requests somewhere now, and the most there ever were at once, in a file every
    process changes under an ``fcntl`` lock."""

    def __init__(self, path: Path | str) -> None:
        self.path = path = Path(path)
        if not path.exists():
            path.write_bytes(_PAIR.pack(0, 0))

    def _change(self, step: int) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            now, peak = _PAIR.unpack(os.pread(fd, _PAIR.size, 0))
            now += step
            os.pwrite(fd, _PAIR.pack(now, max(now, peak)), 0)
        finally:
            os.close(fd)  # closing lets go of the lock

    def enter(self) -> None:
        self._change(1)

    def leave(self) -> None:
        self._change(-1)

    @property
    def peak(self) -> int:
        return int(_PAIR.unpack(self.path.read_bytes())[1])


class _Sink:
    def add_usage(self, batch: Iterable[UsageRecord]) -> int:
        return len(list(batch))


def flood_key(key_id: str = KEY_ID, **limits: Any) -> ApiKeyRecord:
    """The one key every worker floods (or another, by ``key_id``)."""
    return ApiKeyRecord(
        key_id,
        "flood",
        "standard",
        "sk-berth-abcd",
        datetime(2025, 1, 1, tzinfo=UTC),
        None,
        LimitOverrides(**limits),
    )


def _admission(state: HostState, **kwargs: Any) -> Admission:
    # A clock standing still: the minute buckets do not refill while the test runs, so what
    # is admitted is exact (every process reads the same instant).
    return Admission(
        TierTable(), UsageLedger(_Sink()), clock=ManualClock(), counters=state.keys, **kwargs
    )


def _settle(admission: Admission, ticket: Ticket, tokens: int) -> None:
    admission.settle(
        ticket,
        node_id="local",
        error=False,
        prompt_tokens=tokens,
        completion_tokens=0,
        estimated=False,
    )


def admit_rpm(path: Path, worker: int, conn: Any, attempts: int) -> None:
    """Try ``attempts`` admissions of a key of rpm 120, settling each; send the admitted
    count."""
    state = HostState.attach(path, worker)
    admission = _admission(state)
    key = flood_key(rpm=120)
    conn.recv()
    admitted = 0
    for _ in range(attempts):
        try:
            ticket = admission.admit(key, "m", 100)
        except QuotaExceededError:
            continue
        admitted += 1
        _settle(admission, ticket, 10)
    conn.send(admitted)


def admit_concurrently(
    path: Path, worker: int, conn: Any, seconds: float, engine_path: Path
) -> None:
    """For ``seconds``, admit two requests at a time of a key of concurrency 4 and hold
    each "at the engine" (a :class:`PeakCounter` at ``engine_path``) for a moment; send
    (admitted, refused)."""
    state = HostState.attach(path, worker)
    admission = _admission(state)
    key = flood_key(max_concurrency=4)
    engine = PeakCounter(engine_path)
    conn.recv()
    admitted = refused = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        held: list[Ticket] = []
        for _ in range(2):
            try:
                held.append(admission.admit(key, "m", 100))
            except QuotaExceededError:
                refused += 1
                continue
            engine.enter()
        time.sleep(0.0005)  # the engine answering
        for ticket in held:
            engine.leave()
            _settle(admission, ticket, 0)
        admitted += len(held)
    conn.send((admitted, refused))


def spend_budget(path: Path, worker: int, conn: Any, tokens_each: int, max_tokens: int) -> None:
    """Spend a key's daily budget with up to 3 requests in flight at once, each using
    ``tokens_each`` (at most what it reserves: its prompt estimate plus ``max_tokens``),
    until the budget refuses; send the tokens this worker's requests used."""
    state = HostState.attach(path, worker)
    admission = _admission(state)
    key = flood_key(daily_tokens=10_000)
    conn.recv()
    used = 0
    held: list[Ticket] = []
    while True:
        try:
            held.append(admission.admit(key, "m", 400, max_tokens))
            if len(held) < 3:
                continue
        except QuotaExceededError as refusal:
            assert refusal.error_code == "daily_tokens_exceeded", refusal.error_code
            if not held:
                break
        _settle(admission, held.pop(0), tokens_each)
        used += tokens_each
    conn.send(used)


def hold_slots(
    path: Path, worker: int, conn: Any, tasks: int, rounds: int, engine_path: Path
) -> None:
    """Run ``tasks`` requests at once, ``rounds`` each, through a slot gate on the host's
    slots of deployment ``d-1`` (2 slots); count those holding a slot (a
    :class:`PeakCounter` at ``engine_path``); send the requests served."""
    engine = PeakCounter(engine_path)
    state = HostState.attach(path, worker)
    gate = SlotGate(slots=state.deployments, timeout_s=30.0)
    candidates = [_Candidate("d-1", 2)]

    async def one() -> int:
        served = 0
        for _ in range(rounds):
            held = await gate.acquire(KEY_ID, 0, "m", candidates)
            assert held == "d-1"
            engine.enter()
            await asyncio.sleep(0.0005)  # the engine answering
            engine.leave()
            gate.release(held)
            served += 1
        return served

    async def run() -> int:
        return sum(await asyncio.gather(*(one() for _ in range(tasks))))

    conn.recv()
    conn.send(asyncio.run(run()))


class _Candidate:
    def __init__(self, deployment_id: str, slots: int) -> None:
        self.deployment_id = deployment_id
        self.slots = slots


def hold_and_wait_for_death(path: Path, worker: int, conn: Any) -> None:
    """Take both slots of ``d-1``, admit two requests of a key with a daily budget and a
    concurrency limit (reserving tokens) and hold body bytes, then wait to be killed."""
    state = HostState.attach(path, worker)
    gate = SlotGate(slots=state.deployments)
    admission = _admission(state, max_body_bytes_per_key=1_000_000)
    key = flood_key(daily_tokens=100_000, max_concurrency=3)
    candidates = [_Candidate("d-1", 2)]
    assert gate.take_free(candidates) == "d-1"
    assert gate.take_free(candidates) == "d-1"
    admission.admit(key, "m", 400, 100)
    admission.admit(key, "m", 400, 100)
    hold = admission.hold_body(key)
    assert hold is not None
    hold.take(5000)
    state.deployments.started("d-1", "node-a")
    conn.send("holding")
    conn.recv()  # killed before anything comes


def wait_for_slot(path: Path, worker: int, conn: Any) -> None:
    """Wait at the gate for a slot of ``d-1`` (send "waiting" once queued), then send what
    it got (or the error's name)."""
    state = HostState.attach(path, worker)
    gate = SlotGate(slots=state.deployments, timeout_s=20.0)
    candidates = [_Candidate("d-1", 2)]

    async def run() -> str:
        task = asyncio.create_task(gate.acquire(KEY_ID, 0, "m", candidates))
        while gate.scheduler.waiting == 0 and not task.done():
            await asyncio.sleep(0.001)
        conn.send("waiting")
        try:
            return str(await task)
        except Exception as error:
            return type(error).__name__

    conn.send(asyncio.run(run()))


def routing_records(path: Path, worker: int, conn: Any, blocks: list[int], session: str) -> None:
    """Report which deployment the shared prefix record matches ``blocks`` at, and the node
    the shared session map gives ``session``; worker 0 records them first."""
    state = HostState.attach(path, worker)
    prompt = _Blocks(blocks)
    if worker == 0:
        state.prefixes.record("d-b", prompt)
        state.prefixes.record("d-a", _Blocks(blocks[:1]))
        state.sessions.record(session, "node-7")
    matches = state.prefixes.matches(prompt, ["d-a", "d-b", "d-c"])
    best = max(matches, key=lambda d: matches[d])
    conn.send((worker, best, dict(matches), state.sessions.get(session)))


class _Blocks:
    def __init__(self, hashes: list[int]) -> None:
        self.hashes = hashes


class Lines:
    """A worker's end of its talk with the test: JSON values, one a line."""

    def recv(self) -> Any:
        return json.loads(sys.stdin.readline())

    def send(self, value: Any) -> None:
        sys.stdout.write(json.dumps(value) + "\n")
        sys.stdout.flush()


FUNCTIONS = {
    function.__name__: function
    for function in (
        admit_rpm,
        admit_concurrently,
        spend_budget,
        hold_slots,
        hold_and_wait_for_death,
        wait_for_slot,
        routing_records,
    )
}


def main() -> None:
    """``python -m support.host_workers NAME '[path, worker, ...]'``."""
    name, args = sys.argv[1], json.loads(sys.argv[2])
    FUNCTIONS[name](Path(args[0]), args[1], Lines(), *args[2:])


if __name__ == "__main__":
    main()
