"""Measure ``POST /admin/models`` with ``"path": "/"``: how long the refusal takes, and whether
the leader's event loop stalled meanwhile.

Issue 38 found that registering ``/`` walked the whole tree on the event loop (6.2 s for
``/root``) and then failed with a 500. The path is now checked in a worker thread with a
bound on entries and time (:mod:`berth.weights.model_files`). This script starts a leader in
its own process (:class:`berth.daemon.server.Leader`, leader-only, on a temporary home), asks
it ``--requests`` times over its Unix socket, and prints the answers' median and max, and
from ``berth_event_loop_lag_seconds{node="local"}`` (a tick every 20 ms) how many ticks of
the loop were late by more than 50, 100 and 250 ms while it did. Each round is a fresh
leader; rounds show the noise of a shared machine.

Run: ``.venv/bin/python scripts/bench_admin_paths.py [--rounds 3] [--requests 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from berth.config import Settings
from berth.daemon.server import Leader
from berth.paths import BerthHome

#: The lag bounds reported, in seconds (buckets of the histogram).
BOUNDS = ("0.05", "0.1", "0.25")


def _settings(home: BerthHome) -> Settings:
    flags: dict[str, object] = {
        "public_bind": "127.0.0.1",
        "public_host": "127.0.0.1",
        "cluster_bind": "127.0.0.1",
        "cluster_host": "127.0.0.1",
        "public_port": 0,
        "cluster_port": 0,
        "orphan_grace_s": 0,
        "leader_only": True,
    }
    return Settings.load(home, flags=flags, env={})


def _lag(text: str) -> dict[str, float]:
    for family in text_string_to_metric_families(text):
        if family.name == "berth_event_loop_lag_seconds":
            return {
                s.labels["le"]: s.value
                for s in family.samples
                if s.name.endswith("_bucket") and s.labels.get("node") == "local"
            }
    raise SystemExit("no berth_event_loop_lag_seconds in /metrics")


async def _round(requests: int) -> tuple[list[float], dict[str, float], float, str]:
    """One fresh leader: the answers' seconds, the late ticks per bound, all ticks, and the
    last refusal's message."""
    with tempfile.TemporaryDirectory(prefix="berth-bench-paths-") as scratch:
        home = BerthHome(Path(scratch) / "home")
        leader = Leader(home, _settings(home))
        await leader.start()
        try:
            transport = httpx.AsyncHTTPTransport(uds=str(home.socket_file))
            async with httpx.AsyncClient(
                transport=transport, base_url="http://berth", timeout=60
            ) as api:
                await api.get("/admin/openapi.json")  # the app's first requests, not measured
                before = _lag((await api.get("/metrics")).text)
                seconds: list[float] = []
                message = ""
                for number in range(requests):
                    started = time.monotonic()
                    answer = await api.post(
                        "/admin/models", json={"name": f"root-{number}", "path": "/"}
                    )
                    seconds.append(time.monotonic() - started)
                    if answer.status_code != 400:
                        raise SystemExit(f"expected 400, got {answer.status_code}: {answer.text}")
                    message = answer.json()["error"]["message"]
                after = _lag((await api.get("/metrics")).text)
        finally:
            await leader.stop()

    def late(lags: dict[str, float], bound: str) -> float:
        return lags["+Inf"] - lags[bound]

    lagged = {b: late(after, b) - late(before, b) for b in BOUNDS}
    return seconds, lagged, after["+Inf"] - before["+Inf"], message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    print("| round | answers | median s | max s | ticks | late > 50 ms | > 100 ms | > 250 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    message = ""
    for number in range(1, args.rounds + 1):
        seconds, lagged, ticks, message = asyncio.run(_round(args.requests))
        late = " | ".join(f"{lagged[b]:.0f}" for b in BOUNDS)
        print(
            f"| {number} | {len(seconds)} x 400 | {statistics.median(seconds):.3f} | "
            f"{max(seconds):.3f} | {ticks:.0f} | {late} |"
        )
    print(f"\nthe refusal: {message}")


if __name__ == "__main__":
    main()
