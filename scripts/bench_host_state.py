"""What the host's shared state (``berth.host``) costs per request, against the in-process
counters it replaces, in one process, with no sockets.

Each operation runs in a loop, in process and on a shared state file (under ``/dev/shm``),
the two in turn, for several rounds; the table gives the median ``time.process_time`` per
operation, in microseconds:

- ``admit + settle``: a key with every limit set, none reached (rpm, tpm, concurrency, the
  day's and month's budgets, as ``bench_proxy.py --limits``'s key), admitted and settled;
- ``slot take + give back``: the fair admission gate's free slot taken and given back;
- ``in flight +1 -1``: the router's signal, a request started and finished;
- ``prefix match``: the prefix record's match of a 16-block prompt over 4 deployments (each
  holding part of it), and ``prefix record``: the prompt recorded for one;
- ``session get``: the session map's look-up of a recorded key;
- ``lock pair``: one ``fcntl`` row lock taken and given back, and ``wake send``: one wake
  datagram sent (only a slot handed to another process sends one).

``--fairness`` measures instead how the slots of one deployment go round processes that all
want them: ``--workers`` processes (spawned), each with 4 requests at a time taking one of
the deployment's 2 slots, holding it for 0.5 ms and giving it back, for ``--seconds``; it
prints the requests served a second and each process's share of them (1/N each is
even).

Commands (about half a minute each)::

    PYTHONPATH=src python scripts/bench_host_state.py [--rounds 5] [--n 20000]
    PYTHONPATH=src python scripts/bench_host_state.py --fairness [--workers 4] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from berth.admission import Admission, SlotGate, UsageLedger
from berth.config import TierTable
from berth.host import HostState
from berth.host.wake import WakeBox
from berth.routing.affinity import AffinityMap
from berth.routing.prefix_blocks import PromptBlocks
from berth.routing.prefix_index import PrefixIndex
from berth.routing.signals import SignalBoard
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import ApiKeyRecord, UsageRecord

HUGE = 10**12


class _Sink:
    def add_usage(self, batch: list[UsageRecord]) -> int:
        return len(batch)


class _Slotted:
    def __init__(self, deployment_id: str, slots: int) -> None:
        self.deployment_id = deployment_id
        self.slots = slots


def _key() -> ApiKeyRecord:
    limits = LimitOverrides(
        rpm=HUGE,
        tpm=HUGE,
        max_concurrency=100_000,
        daily_tokens=HUGE,
        monthly_tokens=HUGE,
        models=frozenset({"m"}),
    )
    return ApiKeyRecord(
        "k-bench",
        "bench",
        "standard",
        "sk-berth-0000",
        datetime(2025, 1, 1, tzinfo=UTC),
        None,
        limits,
    )


def per_op_us(op: Callable[[], None], n: int) -> float:
    """CPU microseconds per call of ``op`` over ``n`` calls (the collector off)."""
    gc.collect()
    gc.disable()
    try:
        begun = time.process_time_ns()
        for _ in range(n):
            op()
        return (time.process_time_ns() - begun) / n / 1000
    finally:
        gc.enable()


def admission_op(host: HostState | None) -> Callable[[], None]:
    ledger = UsageLedger(_Sink())  # type: ignore[arg-type]
    admission = (
        Admission(TierTable(), ledger)
        if host is None
        else Admission(TierTable(), ledger, counters=host.keys)
    )
    key = _key()

    def op() -> None:
        ticket = admission.admit(key, "m", 400, 64)
        admission.settle(
            ticket,
            node_id="local",
            error=False,
            prompt_tokens=100,
            completion_tokens=20,
            estimated=False,
        )

    return op


def slot_op(host: HostState | None) -> Callable[[], None]:
    gate = SlotGate() if host is None else SlotGate(slots=host.deployments)
    candidates = [_Slotted("d-bench", 1_000_000)]

    def op() -> None:
        held = gate.take_free(candidates)
        assert isinstance(held, str)
        gate.release(held)

    return op


def in_flight_op(host: HostState | None) -> Callable[[], None]:
    board = SignalBoard() if host is None else SignalBoard(in_flight=host.deployments)

    def op() -> None:
        board.started("d-bench", "local")
        board.finished("d-bench", "local")

    return op


PROMPT = PromptBlocks(tuple(range(1_000, 1_016)))
DEPLOYMENTS = ["d-0", "d-1", "d-2", "d-3"]


def prefix_ops(host: HostState | None) -> tuple[Callable[[], None], Callable[[], None]]:
    index = PrefixIndex() if host is None else host.prefixes
    for number, deployment in enumerate(DEPLOYMENTS):
        index.record(deployment, PromptBlocks(PROMPT.hashes[: 4 * (number + 1)]))

    def match() -> None:
        index.matches(PROMPT, DEPLOYMENTS)

    def record() -> None:
        index.record("d-3", PROMPT)

    return match, record


def session_op(host: HostState | None) -> Callable[[], None]:
    sessions = AffinityMap() if host is None else host.sessions
    sessions.record("session:bench", "node-1")

    def op() -> None:
        sessions.get("session:bench")

    return op


def fair_worker(path: Path, worker: int, seconds: float, conn: Any) -> None:
    """One process of ``--fairness``: 4 requests at a time through the gate on the host's
    slots of ``d-fair`` (2 slots) until ``seconds`` pass; sends the requests served."""
    state = HostState.attach(path, worker)
    gate = SlotGate(slots=state.deployments, timeout_s=60.0)
    candidates = [_Slotted("d-fair", 2)]
    conn.recv()  # go

    async def one(deadline: float) -> int:
        served = 0
        while time.monotonic() < deadline:
            held = await gate.acquire("k-fair", 0, "m", candidates)
            await asyncio.sleep(0.0005)  # the engine answering
            gate.release(held)
            served += 1
        return served

    async def run() -> int:
        deadline = time.monotonic() + seconds
        return sum(await asyncio.gather(*(one(deadline) for _ in range(4))))

    conn.send(asyncio.run(run()))
    state.close()


def fairness(workers: int, seconds: float) -> None:
    folder = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    supervisor = HostState.create(folder / "host.state", workers=workers)
    spawn = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for worker in range(workers):
        mine, theirs = spawn.Pipe()
        process = spawn.Process(
            target=fair_worker, args=(supervisor.region.path, worker, seconds, theirs)
        )
        process.start()
        pipes.append(mine)
        processes.append(process)
    for pipe in pipes:
        pipe.send("go")
    served = [pipe.recv() for pipe in pipes]
    for process in processes:
        process.join()
    total = sum(served)
    shares = " ".join(f"{count / total:.3f}" for count in served)
    print(f"{workers} processes x 4 requests at a time, 2 slots, 0.5 ms held, {seconds:g} s")
    print(f"served {total} ({total / seconds:.0f}/s); shares {shares}; even {1 / workers:.3f}")
    even = total / workers
    print(f"max/even {max(served) / even:.2f}, min/even {min(served) / even:.2f}")
    supervisor.close()
    for leftover in folder.iterdir():
        leftover.unlink()
    folder.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--fairness", action="store_true")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if args.fairness:
        fairness(args.workers, args.seconds)
        return
    folder = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    supervisor = HostState.create(folder / "host.state", workers=16)
    host = HostState.attach(folder / "host.state", 0)
    cases: dict[str, dict[str, Callable[[], None]]] = {}
    for name, host_of in (("in process", None), ("shared", host)):
        match, record = prefix_ops(host_of)
        ops = {
            "admit + settle": admission_op(host_of),
            "slot take + give back": slot_op(host_of),
            "in flight +1 -1": in_flight_op(host_of),
            "prefix match (16 blocks, 4 deployments)": match,
            "prefix record (16 blocks)": record,
            "session get": session_op(host_of),
        }
        for op_name, op in ops.items():
            cases.setdefault(op_name, {})[name] = op
    region = host.region
    peer = WakeBox(region.token, 1)

    def lock_pair() -> None:
        region.lock(1, 0)
        region.unlock(1, 0)

    def wake() -> None:
        host.deployments._wake.wake(1, 0)
        peer.drain()

    cases["lock pair (fcntl)"] = {"shared": lock_pair}
    cases["wake send + receive"] = {"shared": wake}
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for op_name, kinds in cases.items():
            for kind, op in kinds.items():  # in process, then shared: in turn each round
                op()
                samples.setdefault((op_name, kind), []).append(per_op_us(op, args.n))
    print(f"median of {args.rounds} rounds of {args.n}, CPU us per operation")
    print(f"{'operation':44} {'in process':>11} {'shared':>9} {'added':>8}")
    for op_name, kinds in cases.items():
        local = (
            statistics.median(samples[(op_name, "in process")]) if "in process" in kinds else None
        )
        shared = statistics.median(samples[(op_name, "shared")])
        added = "" if local is None else f"{shared - local:8.2f}"
        local_text = "" if local is None else f"{local:11.2f}"
        print(f"{op_name:44} {local_text:>11} {shared:9.2f} {added:>8}")
    peer.close()
    host.close()
    supervisor.close()
    for leftover in folder.iterdir():
        leftover.unlink()
    folder.rmdir()


if __name__ == "__main__":
    main()
