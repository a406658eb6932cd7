"""Measure how soon removing a node cuts its live agent off.

Real processes on loopback, set up with the tests' cluster harness
(``tests/support/cluster_harness.py``): a leader (``berth daemon start``) with the fake
llama-server, and agents enrolled, registered and started with berth's own CLI, each its own
process and home. For each agent: ``DELETE /admin/nodes/LABEL`` on the leader's admin socket,
then the time until the agent's status file records the leader's close code 4403 (node
removed), polled every 5 ms, and until the agent process exits. The target (a removed node's
live link is gone within a second) is checked here, by reading the numbers;
``tests/test_cluster.py`` only checks that it happens. Run:
``.venv/bin/python scripts/bench_removal.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.cluster_harness import started_cluster  # noqa: E402

CUT_OFF_TARGET_S = 1.0


def main(agents: int) -> None:
    cut_offs: list[float] = []
    exits: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="berth-bench-removal-") as folder,
        started_cluster(Path(folder)) as cluster,
    ):
        for index in range(agents):
            agent = cluster.add_agent(f"rm-{index}")
            assert agent.process is not None
            status_file = agent.home / "agent-status.json"
            started = time.monotonic()
            cluster.admin("DELETE", f"/admin/nodes/{agent.label}")
            while "4403" not in json.loads(status_file.read_text() or "{}").get("last_error", ""):
                if time.monotonic() - started > 60:
                    raise SystemExit(f"{agent.label} was never told it was removed")
                time.sleep(0.005)
            cut_offs.append(time.monotonic() - started)
            agent.process.wait(timeout=60)
            exits.append(time.monotonic() - started)
            agent.process = None
    print(f"node removal -> live link cut (agent saw close code 4403), {agents} agents:")
    print(
        f"  p50 {statistics.median(cut_offs) * 1000:.0f} ms   max {max(cut_offs) * 1000:.0f} ms"
        f"   (target: under {CUT_OFF_TARGET_S:.0f} s)"
    )
    print(f"  agent process exited after: p50 {statistics.median(exits):.2f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=3, help="agents to remove, one by one")
    main(parser.parse_args().agents)
