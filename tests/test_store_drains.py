"""The store's cordons and drains (migration 16): the state a drain is carried on from, on
SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.store import Store

pytestmark = pytest.mark.store_engines

FP = "sha256:" + "a" * 64


def test_a_cordon_is_kept_until_uncordoned_and_a_drain_records_each_move(store: Store) -> None:
    node = store.enroll_node("gpu-a", FP)
    assert store.node_drain(node.id) is None
    cordoned = store.cordon_node(node.id, 100.0)
    assert (cordoned.cordoned_at, cordoned.drain_started_at, cordoned.draining) == (
        100.0, None, False,
    )  # fmt: skip
    assert store.cordon_node(node.id, 200.0).cordoned_at == 100.0  # already cordoned
    with pytest.raises(ConflictError, match="not being drained"):
        store.record_drain_move(node.id, "d-1", "replacing", 150.0)

    started = store.start_drain(node.id, 300.0, grace_s=30.0, force=False)
    assert (started.cordoned_at, started.drain_started_at, started.grace_s) == (100.0, 300.0, 30.0)
    assert started.draining
    store.record_drain_move(node.id, "d-1", "replacing", 301.0, note="placing")
    store.record_drain_move(node.id, "d-1", "retired", 305.0, replacement_id="d-9",
                            retired_at=305.0, note="ready")  # fmt: skip
    store.record_drain_move(node.id, "d-2", "left", 306.0, note="pinned")
    (found,) = store.node_drains()
    assert [(m.deployment_id, m.step, m.replacement_id, m.retired_at, m.note)
            for m in found.moves] == [("d-1", "retired", "d-9", 305.0, "ready"),
                                      ("d-2", "left", None, None, "pinned")]  # fmt: skip
    # asked again while it drains: the grace and force change, the start stays
    again = store.start_drain(node.id, 400.0, grace_s=5.0, force=True)
    assert (again.drain_started_at, again.grace_s, again.force) == (300.0, 5.0, True)

    store.finish_drain(node.id, 500.0)
    finished = store.node_drain(node.id)
    assert finished is not None and finished.finished_at == 500.0 and not finished.draining
    # drained again later: a new start, what was left tried again
    restarted = store.start_drain(node.id, 600.0, grace_s=5.0, force=False)
    assert (restarted.drain_started_at, restarted.finished_at) == (600.0, None)

    was = store.uncordon_node(node.id)
    assert was is not None and len(was.moves) == 2
    assert store.node_drain(node.id) is None and store.node_drains() == []
    assert store.uncordon_node(node.id) is None


def test_bad_drains_are_refused_and_change_nothing(store: Store) -> None:
    node = store.enroll_node("gpu-a", FP)
    with pytest.raises(NotFoundError):
        store.cordon_node("n-missing", 1.0)
    with pytest.raises(ConfigError, match="grace must not be negative"):
        store.start_drain(node.id, 1.0, grace_s=-1.0, force=False)
    store.cordon_node(node.id, 1.0)
    store.start_drain(node.id, 2.0, grace_s=1.0, force=False)
    with pytest.raises(ConfigError, match="unknown drain step 'flying'"):
        store.record_drain_move(node.id, "d-1", "flying", 3.0)  # type: ignore[arg-type]
    store.remove_node(node.id)
    with pytest.raises(ConflictError, match="was removed"):
        store.cordon_node(node.id, 4.0)
