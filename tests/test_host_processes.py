"""The host's shared state (`berth.host`) with real processes: four workers, each a fresh
interpreter of its own (`support.host_workers`), attached to one state file and hammering
one key or one deployment at once. The limits hold for the host, not per worker: rpm 120
admits exactly 120, concurrency 4 never has 5 at the engine, a daily budget is overrun by
at most one request's reservation, an engine of 2 slots never has 3 taken; the prefix and
session records answer the same in every process; and a worker killed with SIGKILL while
holding slots, requests and reservations is reclaimed, its slots handed to a worker
waiting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from berth.admission import Admission, ManualClock, UsageLedger
from berth.config import TierTable
from berth.host import HostState
from support import host_workers
from support.host_workers import KEY_ID, PeakCounter

WORKERS = 4
TESTS = Path(__file__).resolve().parent


#: the workers a test started, stopped after it whatever way it ended
STARTED: list[Workers] = []


@pytest.fixture(autouse=True)
def stop_workers() -> Iterator[None]:
    yield
    while STARTED:
        STARTED.pop().close()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[HostState]:
    state = HostState.create(tmp_path / "host.state", workers=WORKERS)
    yield state
    state.close()


class Workers:
    """Worker processes of one function of :mod:`support.host_workers`, each talking to the
    test over its stdin and stdout: :meth:`go` releases them together, :meth:`results`
    gathers what each sent and checks that each exited cleanly."""

    def __init__(self, target: Callable[..., None], path: Path, workers: Iterable[int], *args: Any):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]))
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "support.host_workers",
                    target.__name__,
                    json.dumps([str(path), worker, *map(_plain, args)]),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
            for worker in workers
        ]
        STARTED.append(self)

    def go(self) -> None:
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write('"go"\n')
            process.stdin.flush()

    def receive(self) -> list[Any]:
        values = []
        for process in self.processes:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line, f"worker {process.pid} exited with {process.wait(30)} and sent nothing"
            values.append(json.loads(line))
        return values

    def results(self, timeout_s: float = 60.0) -> list[Any]:
        values = self.receive()
        for process in self.processes:
            assert process.wait(timeout_s) == 0
        self.close()
        return values

    def close(self) -> None:
        """Stop any still running and close the pipes."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(30)
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def use_of_key(host: HostState) -> Any:
    """The flooded key's use as the host counts it (the supervisor's view)."""
    admission = Admission(
        TierTable(), UsageLedger(host_workers._Sink()), clock=ManualClock(), counters=host.keys
    )
    admission.update(host_workers.flood_key())
    return admission.use_of(KEY_ID)


def test_rpm_120_admits_exactly_120_across_four_workers(host: HostState) -> None:
    workers = Workers(host_workers.admit_rpm, host.region.path, range(WORKERS), 100)
    workers.go()
    admitted = workers.results()
    assert sum(admitted) == 120  # of 400 tried, the clock standing still
    assert sum(1 for count in admitted if count) >= 2  # more than one worker admitted some


def test_concurrency_4_never_has_5_at_the_engine(host: HostState, tmp_path: Path) -> None:
    engine = PeakCounter(tmp_path / "engine")
    workers = Workers(
        host_workers.admit_concurrently, host.region.path, range(WORKERS), 1.5, engine.path
    )
    workers.go()
    results = workers.results()
    assert engine.peak == 4  # reached, never passed
    assert sum(admitted for admitted, _ in results) > 0
    assert sum(refused for _, refused in results) > 0
    assert use_of_key(host).in_flight == 0


def test_a_daily_budget_is_overrun_by_at_most_one_reservation(host: HostState) -> None:
    # each request reserves 100 (its 400-byte prompt) + 100 (max_tokens) and uses 200
    workers = Workers(host_workers.spend_budget, host.region.path, range(WORKERS), 200, 100)
    workers.go()
    used = sum(workers.results())
    assert 10_000 <= used <= 10_000 + 200
    use = use_of_key(host)
    assert use.day_tokens == used
    assert (use.in_flight, use.body_bytes) == (0, 0)


def test_an_engine_of_2_slots_never_has_3_taken(host: HostState, tmp_path: Path) -> None:
    engine = PeakCounter(tmp_path / "engine")
    workers = Workers(host_workers.hold_slots, host.region.path, range(WORKERS), 4, 25, engine.path)
    workers.go()
    assert workers.results() == [100] * WORKERS  # all served: no wake lost, none timed out
    assert engine.peak == 2
    assert host.deployments.in_use("d-1") == 0


def test_prefix_and_session_records_answer_the_same_in_every_worker(host: HostState) -> None:
    blocks = [11, 22, 33, 44]
    first = Workers(host_workers.routing_records, host.region.path, [0], blocks, "session:s-1")
    assert first.results()[0][1] == "d-b"
    others = Workers(
        host_workers.routing_records, host.region.path, range(1, WORKERS), blocks, "session:s-1"
    )
    seen = others.results()
    assert [(worker, best, node) for worker, best, _m, node in seen] == [
        (i, "d-b", "node-7") for i in range(1, WORKERS)
    ]
    assert all(m == {"d-a": 1, "d-b": 4, "d-c": 0} for _w, _b, m, _n in seen)


def test_a_worker_killed_holding_slots_and_reservations_is_reclaimed(host: HostState) -> None:
    holder = Workers(host_workers.hold_and_wait_for_death, host.region.path, [1])
    assert holder.receive() == ["holding"]
    waiter = Workers(host_workers.wait_for_slot, host.region.path, [2])
    assert waiter.receive() == ["waiting"]
    held = use_of_key(host)
    assert (held.in_flight, held.body_bytes) == (2, 5000)
    assert host.deployments.in_use("d-1") == 2
    assert host.deployments.in_flight("d-1") == 1

    process = holder.processes[0]
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(30) == -signal.SIGKILL
    holder.close()
    assert host.reclaim(1) == 2

    assert waiter.results() == ["d-1"]  # handed one of the dead worker's slots
    after = use_of_key(host)
    assert (after.in_flight, after.body_bytes) == (0, 0)
    assert host.deployments.in_flight("d-1") == 0
    assert host.deployments.node_in_flight("node-a") == 0
