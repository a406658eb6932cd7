"""A real in-process Leader with shared leadership that loses its lease (docs/ha.md, A
stalled active): it steps down and stays on as a standby, answering as one on ``/readyz``,
``/admin/leader`` and ``/v1``, and leads again, twice over, when the lease is free; and a
leader that starts leading marks unreachable, ``node_timeout_s`` later, a node the store
says is ``ready`` but that has no link to it (bug C: its link died with the last active).

The other leader is played by a second store on the same SQLite file, taking and
releasing the lease by hand, as if this one had stalled past it.
"""

from __future__ import annotations

import time
from pathlib import Path

from berth.config import Settings
from berth.daemon.server import Leader
from berth.paths import BerthHome
from berth.store import Store
from support.waiting import wait_for_async
from test_leader_object import leader_settings, public_get, socket_get

LEASE_S = 2.0
BOUND_S = 20.0
OTHER = "https://other.lan:11500"


def _ha_settings(home: BerthHome, db_file: Path, **flags: object) -> Settings:
    return leader_settings(
        home,
        leader_ha=True,
        leader_only=True,
        leader_lease_s=LEASE_S,
        database_url=f"sqlite:///{db_file}",
        **flags,
    )


def _take_over(other: Store, leader: Leader) -> int:
    """As if ``leader`` stalled past its lease: its lease ends, the other takes it."""
    state = leader.graph.leadership
    assert state is not None
    other.release_lease(state.me, state.state.epoch)
    return other.acquire_lease("other", OTHER, 60.0).epoch


async def test_a_leader_that_loses_the_lease_stands_by_and_leads_again(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "leader")
    db_file = tmp_path / "shared.db"
    leader = Leader(home, _ha_settings(home, db_file))
    await leader.start()
    other = Store(f"sqlite:///{db_file}")
    try:
        for round_ in (1, 2):
            assert leader.leading, f"round {round_}"
            epoch = _take_over(other, leader)
            await wait_for_async(lambda: not leader.leading, BOUND_S, "the leader to step down")
            assert leader.started  # still running: a standby now

            ready = await public_get(home, leader.public_port, "/readyz")
            assert (ready.status_code, ready.json()) == (503, {"status": "standby"})
            role = (await socket_get(home, "/admin/leader")).json()
            assert (role["role"], role["epoch"], role["active_address"]) == (
                "standby", epoch, OTHER)  # fmt: skip
            refused = await public_get(home, leader.public_port, "/v1/models")
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            assert OTHER in refused.json()["error"]["message"]

            other.release_lease("other", epoch)  # the other stops cleanly: this one leads
            await wait_for_async(lambda: leader.leading, BOUND_S, "the leader to lead again")
            role = (await socket_get(home, "/admin/leader")).json()
            assert (role["role"], role["epoch"]) == ("active", epoch + 1)
            assert (await public_get(home, leader.public_port, "/readyz")).status_code == 200
    finally:
        await leader.stop()
        other.close()
    assert not leader.started


async def test_a_new_active_marks_ready_nodes_without_a_link_unreachable(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "leader")
    db_file = tmp_path / "shared.db"
    node_timeout_s = 4.0
    seeded = Store(f"sqlite:///{db_file}")
    seeded.migrate()
    # A node whose link was with the last active, which died: the store still says ready.
    node = seeded.enroll_node("gpu-gone", "sha256:" + "ab" * 32)
    seeded.set_node_status(node.id, "ready")
    settings = _ha_settings(home, db_file, heartbeat_interval_s=1.0, node_timeout_s=node_timeout_s)
    leader = Leader(home, settings)
    started_at = time.monotonic()
    await leader.start()
    try:
        assert leader.leading
        if time.monotonic() - started_at < node_timeout_s - 1.0:  # its agent may still dial
            assert seeded.get_node(node.id).status == "ready"
        await wait_for_async(lambda: seeded.get_node(node.id).status == "unreachable",
                             BOUND_S, "the node to be marked unreachable")  # fmt: skip
        assert time.monotonic() - started_at >= node_timeout_s
        listed = (await socket_get(home, "/admin/nodes")).json()
        statuses = {n["id"]: n["status"] for n in listed}
        assert statuses[node.id] == "unreachable"
    finally:
        await leader.stop()
        seeded.close()
