"""The store's node registry, enrollment tokens and model locations."""

from __future__ import annotations

import pytest

from berth.errors import ConflictError, EnrollmentTokenError, NotFoundError
from berth.store import Store
from berth.vocab.gpu import GpuInfo
from berth.vocab.records import NodeHardware

# Every test that uses the store runs on SQLite and on PostgreSQL (conftest.py).
pytestmark = pytest.mark.store_engines

FP_A = "sha256:" + "a" * 64
FP_B = "sha256:" + "b" * 64
HARDWARE = NodeHardware(
    hostname="gpu-1",
    cpu_count=32,
    memory_total_mb=256_000,
    gpus=(
        GpuInfo(0, "NVIDIA H200", "GPU-0", 143_000, 1_000, 3),
        GpuInfo(1, "NVIDIA H200", "GPU-1", 143_000, 0, None),
    ),
)


def test_local_node_exists_once_and_cannot_be_removed(store: Store) -> None:
    again = store.ensure_local_node()

    assert (again.id, again.label, again.status) == ("local", "local", "ready")
    assert [n.id for n in store.list_nodes()] == ["local"]
    with pytest.raises(ConflictError, match="cannot be removed"):
        store.remove_node("local")
    with pytest.raises(ConflictError):
        store.enroll_node("local", FP_A)


def test_enrolled_node_starts_unreachable_and_is_ready_after_hello(store: Store) -> None:
    node = store.enroll_node("gpu-1", FP_A)

    assert node.id.startswith("n-") and len(node.id) == 10
    assert (node.status, node.cert_fingerprint, node.inventory) == ("unreachable", FP_A, None)
    hello = store.record_node_hello(
        node.id,
        agent_version="0.1.0",
        protocol_version=1,
        capabilities=["process", "logs"],
        inventory=HARDWARE,
        now=1000.0,
    )
    assert hello.status == "ready"
    assert hello.capabilities == ("process", "logs")
    assert hello.inventory == HARDWARE
    assert hello.inventory is not None and hello.inventory.vram_total_mb == 286_000
    assert store.get_node(node.id) == hello
    assert store.find_node_by_fingerprint(FP_A) == hello
    assert store.get_node_by_label("gpu-1") == hello

    beat = store.record_node_heartbeat(node.id, 1005.0)
    assert beat.last_heartbeat_at == 1005.0 and beat.inventory == HARDWARE
    assert store.set_node_status(node.id, "unreachable").status == "unreachable"


def test_reenrolling_keeps_the_id_and_replaces_the_fingerprint(store: Store) -> None:
    first = store.enroll_node("gpu-1", FP_A)
    store.remove_node(first.id)

    again = store.enroll_node("gpu-1", FP_B)

    assert again.id == first.id
    assert (again.status, again.cert_fingerprint) == ("unreachable", FP_B)
    assert store.find_node_by_fingerprint(FP_A) is None
    assert store.propose_node_id("gpu-1") == first.id


def test_removed_node_keeps_its_fingerprint_and_leaves_the_listing(store: Store) -> None:
    node = store.enroll_node("gpu-1", FP_A)

    removed = store.remove_node(node.id)

    assert removed.status == "removed"
    assert store.find_node_by_fingerprint(FP_A) == removed
    assert [n.id for n in store.list_nodes()] == ["local"]
    assert [n.id for n in store.list_nodes(include_removed=True)] == ["local", node.id]
    with pytest.raises(ConflictError, match="removed"):
        store.record_node_hello(
            node.id,
            agent_version="0.1.0",
            protocol_version=1,
            capabilities=[],
            inventory=HARDWARE,
            now=1.0,
        )
    with pytest.raises(ConflictError):
        store.set_node_status(node.id, "ready")


def test_lookup_by_id_or_label(store: Store) -> None:
    node = store.enroll_node("gpu-1", FP_A)

    assert store.lookup_node(node.id) == store.lookup_node("gpu-1") == node
    with pytest.raises(NotFoundError, match="node 'nope' not found"):
        store.lookup_node("nope")


@pytest.mark.parametrize(
    ("consume_at", "reason"), [(99.0, None), (100.0, "expired"), (500.0, "expired")]
)
def test_enrollment_token_expiry(store: Store, consume_at: float, reason: str | None) -> None:
    store.create_enrollment_token("gpu-1", "hash-1", expires_at=100.0)

    if reason is None:
        assert store.consume_enrollment_token("hash-1", consume_at) == "gpu-1"
    else:
        with pytest.raises(EnrollmentTokenError) as caught:
            store.consume_enrollment_token("hash-1", consume_at)
        assert caught.value.reason == reason


def test_enrollment_token_is_single_use_and_survives_a_restart(db_url: str) -> None:
    url = db_url
    with Store(url) as store:
        store.migrate()
        store.create_enrollment_token("gpu-1", "hash-1", expires_at=100.0)
    with Store(url) as restarted:
        assert restarted.consume_enrollment_token("hash-1", 1.0) == "gpu-1"
    with Store(url) as restarted:
        with pytest.raises(EnrollmentTokenError, match="already used") as caught:
            restarted.consume_enrollment_token("hash-1", 2.0)
        assert caught.value.reason == "used"
        with pytest.raises(EnrollmentTokenError, match="unknown") as unknown:
            restarted.consume_enrollment_token("hash-2", 2.0)
        assert unknown.value.reason == "unknown"


def test_model_locations_follow_the_model(store: Store) -> None:
    node = store.enroll_node("gpu-1", FP_A)
    store.add_model("tiny", "/models/tiny.gguf")

    store.set_model_location("tiny", node.id, "/data/tiny.gguf")
    store.set_model_location("tiny", node.id, "/data/tiny-v2.gguf")

    assert store.model_path_on_node("tiny", node.id) == "/data/tiny-v2.gguf"
    assert store.model_path_on_node("tiny", "local") is None
    assert len(store.list_model_locations()) == 1
    with pytest.raises(NotFoundError):
        store.set_model_location("tiny", "n-00000000", "/x")
    with pytest.raises(NotFoundError):
        store.set_model_location("nope", node.id, "/x")

    store.remove_model("tiny")
    assert store.list_model_locations() == []
    store.add_model("tiny", "/models/tiny.gguf")
    assert store.model_path_on_node("tiny", node.id) is None
