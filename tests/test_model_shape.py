"""Placement by fit where the models live: the ``model_shape`` op (an agent reads a model's
header on its host), its wire form, the leader's cache of what agents read, and ``berth
plan``'s estimate for a model with paths only on an agent, all in one process (the link
over an in-memory WebSocket pair). ``test_plan_remote_cli.py`` does it with real processes.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from berth.admin.model_detail import model_detail, shape_view
from berth.agent.core import AgentCore
from berth.agent.service import AgentService
from berth.api import ModelShapeOut
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.remote_link import RemoteLink
from berth.cluster.link.connection import LinkConnection, RemoteOpError
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.ops import MODEL_SHAPE, OP_CAPABILITIES, ModelShapeArgs
from berth.cluster.protocol.payloads import ErrorCode
from berth.cluster.protocol.session import Role
from berth.cluster.wire_forms import (
    file_shape_from_wire,
    file_shape_to_wire,
    shape_from_wire,
    shape_to_wire,
)
from berth.deployments.estimates import NodeCopy, VramEstimator
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.errors import EngineError
from berth.placement import EstimateRequest, Placement, Refusal, estimate_vram
from berth.placement.model_files import FileStamp, ModelFileShape, read_model_shape
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import SimulatedInventory
from berth.runtime.process import ProcessRuntime
from berth.store import Store
from berth.vocab.gpu import parse_simulated_gpus
from berth.vocab.records import ModelRecord
from support.cluster_harness import fake_engine_wrapper
from support.fakes import FakeLink, memory_socket_pair
from support.link_pair import LeaderSide, Linked
from support.model_gguf import write_model_gguf

# -- the wire form ------------------------------------------------------------------------------


def test_a_shape_crosses_the_wire_unchanged_but_for_its_host(tmp_path: Path) -> None:
    shape = read_model_shape(write_model_gguf(tmp_path / "m.gguf"))
    found = ModelFileShape(FileStamp(100_000_000, 1_700_000_000_123_456_789), shape)
    raw = MODEL_SHAPE.encode_result(file_shape_to_wire(found))
    back = file_shape_from_wire(MODEL_SHAPE.decode_result(raw), host="gpu-a")
    assert back.stamp == found.stamp
    assert back.shape is not None and back.shape.host == "gpu-a"
    assert back.shape == shape.__class__(**{**shape.__dict__, "host": "gpu-a"})
    assert shape_from_wire(shape_to_wire(shape), host=None) == shape
    # "unchanged": the stamp alone, no shape on the wire
    unchanged = file_shape_to_wire(ModelFileShape(found.stamp, None))
    assert b"shape" not in msgspec.json.encode(unchanged)
    assert file_shape_from_wire(unchanged, host="gpu-a").shape is None


def test_the_admin_view_of_a_shape_is_its_wire_form_field_for_field(tmp_path: Path) -> None:
    """``GET /admin/models/{name}``'s shape is read from the wire form (one copy of a shape's
    fields, not two): every field of the response model comes from the wire struct, the
    per-layer heads under the API's name ``kv_heads``."""
    shape = read_model_shape(write_model_gguf(tmp_path / "m.gguf"))
    view = shape_view(shape)
    wire = msgspec.structs.asdict(shape_to_wire(shape))
    wire["kv_heads"] = wire.pop("layer_kv_heads")
    assert view.model_dump() == wire
    assert set(ModelShapeOut.model_fields) == set(wire)
    assert view.kv_heads == list(shape.layer_kv_heads) and view.source == str(shape.source)
    # what the CLI decodes from the JSON is the same value
    assert ModelShapeOut.model_validate_json(view.model_dump_json()) == view


# -- the op over the link -----------------------------------------------------------------------


async def test_the_agent_reads_a_header_on_its_host(linked: Linked, tmp_path: Path) -> None:
    path = write_model_gguf(tmp_path / "agent" / "m.gguf")
    assert OP_CAPABILITIES["model_shape"] in linked.service.hello().capabilities
    found = await linked.link.model_shape(str(path))
    stat = path.stat()
    assert found.stamp == FileStamp(stat.st_size, stat.st_mtime_ns)
    local = read_model_shape(path)
    assert found.shape == local.__class__(**{**local.__dict__, "host": "n-1"})

    again = await linked.link.model_shape(str(path), found.stamp)
    assert again == ModelFileShape(found.stamp, None)  # not read again
    write_model_gguf(path, size_bytes=200_000_000)
    changed = await linked.link.model_shape(str(path), found.stamp)
    assert changed.shape is not None and changed.shape.weights_bytes == 200_000_000


async def test_what_the_agent_cannot_read_comes_back_typed_with_words(
    linked: Linked, tmp_path: Path
) -> None:
    not_a_model = tmp_path / "zeros.gguf"
    not_a_model.write_bytes(b"GGUF" + bytes(60))
    cases = [
        (str(tmp_path / "none.gguf"), ErrorCode.NOT_FOUND, "no such file or folder on this host"),
        (str(not_a_model), ErrorCode.INVALID, "zeros.gguf: "),
        ("models/m.gguf", ErrorCode.INVALID, "a model path must be absolute"),
    ]  # fmt: skip
    for path, code, words in cases:
        with pytest.raises(RemoteOpError) as caught:
            await linked.leader.call(MODEL_SHAPE, ModelShapeArgs(path=path), 5.0)
        assert caught.value.info.code == code, caught.value.info
        assert words in caught.value.info.message
        with pytest.raises(EngineError, match="^node n-1: .*" + words[:12]):
            await linked.link.model_shape(path)


async def test_an_agent_without_the_capability_is_not_asked(linked: Linked, tmp_path: Path) -> None:
    path = write_model_gguf(tmp_path / "m.gguf")
    older = set(linked.link.capabilities) - {OP_CAPABILITIES["model_shape"]}
    link = RemoteLink("n-1", linked.leader, linked.service.inventory(), sorted(older))
    with pytest.raises(EngineError, match="does not support 'model_shape'; upgrade it"):
        await link.model_shape(str(path))
    # placement keeps the old behaviour, with the reason
    problem = (await VramEstimator().estimate(
        remote_model(path), "llamacpp", ctx=None, extra_args=(), gpu_count=1,
        copies=[NodeCopy(link, "gpu-a", str(path))],
    )).problem  # fmt: skip
    assert problem == (
        f"{path}: model m has paths only on other nodes, so the leader cannot read its header "
        "(node gpu-a's agent does not read model headers (no op.model_shape); upgrade it)"
    )


# -- the leader's cache -------------------------------------------------------------------------


@dataclass
class CountingLink:
    """A link that records what it was asked and whether the agent read the header."""

    inner: RemoteLink
    asked: list[tuple[str, FileStamp | None, bool]]

    @property
    def node_id(self) -> str:
        return self.inner.node_id

    @property
    def capabilities(self) -> frozenset[str]:
        return self.inner.capabilities

    async def model_shape(self, path: str, known: FileStamp | None = None) -> ModelFileShape:
        found = await self.inner.model_shape(path, known)
        self.asked.append((path, known, found.shape is not None))
        return found


async def test_the_leader_keeps_a_shape_while_the_file_is_unchanged(
    linked: Linked, tmp_path: Path
) -> None:
    path = write_model_gguf(tmp_path / "m.gguf")
    link = CountingLink(linked.link, [])
    copy = NodeCopy(link, "gpu-a", str(path))  # type: ignore[arg-type]
    estimator = VramEstimator()
    first = await estimator.shape_on(copy)
    assert first.host == "gpu-a" and first.weights_bytes == 100_000_000
    assert await estimator.shape_on(copy) == first
    stamp = FileStamp(path.stat().st_size, path.stat().st_mtime_ns)
    assert link.asked == [(str(path), None, True), (str(path), stamp, False)]
    write_model_gguf(path, size_bytes=300_000_000)
    os.utime(path, ns=(stamp.mtime_ns + 10**9, stamp.mtime_ns + 10**9))
    assert (await estimator.shape_on(copy)).weights_bytes == 300_000_000
    assert link.asked[-1] == (str(path), stamp, True)


# -- planning a model that lives only on an agent -----------------------------------------------


def remote_model(path: Path) -> ModelRecord:
    return ModelRecord("m", path, "remote", None, None, 0, datetime(2026, 1, 1, tzinfo=UTC))


@dataclass
class Leader:
    manager: LifecycleManager
    store: Store
    agent_id: str
    links: LinkRegistry


@pytest.fixture
async def gpu_agent(store: Store, tmp_path: Path) -> AsyncIterator[Leader]:
    """A leader (no GPUs of its own) with one agent whose core simulates a 4 GiB GPU, joined
    by a real link over an in-memory WebSocket pair."""
    agent_id = store.enroll_node("gpu-a", "ab" * 32).id
    core = AgentCore(
        ProcessRuntime(),
        EngineBinaries(str(fake_engine_wrapper(tmp_path)), None, ""),
        SimulatedInventory(parse_simulated_gpus("4GiB")),
        logs_dir=tmp_path,
    )
    service = AgentService(core, read_timeout_s=10.0)
    agent_ws, leader_ws = memory_socket_pair()
    agent = LinkConnection(Role.AGENT, agent_ws, service, peer="leader")
    conn = LinkConnection(Role.LEADER, leader_ws, LeaderSide(), peer=agent_id)
    _welcome, hello = await asyncio.gather(
        agent.handshake(service.hello(), timeout_s=5.0),
        conn.handshake(WelcomeTerms(node_id=agent_id, leader_version="test"), timeout_s=5.0),
    )
    tasks = [asyncio.create_task(agent.run()), asyncio.create_task(conn.run())]
    remote = RemoteLink(agent_id, conn, service.inventory(), hello.capabilities)
    links = LinkRegistry([FakeLink(), remote])
    manager = LifecycleManager(store, links, health_timeout_s=30, stop_grace_s=2)
    await manager.start()
    try:
        yield Leader(manager, store, agent_id, links)
    finally:
        await manager.shutdown()
        await conn.close(1000, "test over")
        await asyncio.gather(*tasks)
        await service.close()


async def test_a_model_only_on_an_agent_is_placed_by_its_estimate(
    gpu_agent: Leader, tmp_path: Path
) -> None:
    on_agent = write_model_gguf(tmp_path / "agent-home" / "m.gguf")
    gpu_agent.store.add_model("m", str(on_agent), source="remote")
    gpu_agent.store.set_model_location("m", gpu_agent.agent_id, str(on_agent))
    planned = await gpu_agent.manager.plan(DeployOptions("m", "llamacpp"))
    assert isinstance(planned.result, Placement), planned.result
    assert (planned.result.node_id, planned.result.gpus) == (gpu_agent.agent_id, (0,))
    expected = estimate_vram(read_model_shape(on_agent), EstimateRequest("llamacpp"))
    estimate = planned.estimate.estimate
    assert estimate is not None and estimate.summary() == expected.summary()
    assert dict(estimate.inputs)["read from"] == f"GGUF header: {on_agent} on node gpu-a"

    too_long = await gpu_agent.manager.plan(DeployOptions("m", "llamacpp", ctx=1 << 20))
    assert isinstance(too_long.result, Refusal) and too_long.result.reason == "vram_too_large"
    # models show: the copy's shape and estimate, from the same cache
    detail = await model_detail(gpu_agent.store, gpu_agent.manager.estimator, gpu_agent.links, "m")
    (copy,) = detail.copies
    assert copy.node_label == "gpu-a" and copy.problem is None
    assert copy.estimate is not None and copy.estimate.summary == expected.summary()


async def test_a_deployment_of_it_from_before_counts_what_its_copy_needs(
    gpu_agent: Leader, tmp_path: Path
) -> None:
    on_agent = write_model_gguf(tmp_path / "agent-home" / "m.gguf")
    gpu_agent.store.add_model("m", str(on_agent), source="remote")
    gpu_agent.store.set_model_location("m", gpu_agent.agent_id, str(on_agent))
    # placed by an earlier leader: this one has no estimate remembered for it
    gpu_agent.store.create_deployment("m", "llamacpp", "process", gpu_agent.agent_id, gpus=(0,))
    planned = await gpu_agent.manager.plan(DeployOptions("m", "llamacpp", served_model_name="b"))
    (option,) = planned.result.considered
    assert option.free_mb == 4096 - (96 + 180 + 1280), option


async def test_an_hf_folder_on_the_agent_is_read_there(linked: Linked, tmp_path: Path) -> None:
    folder = tmp_path / "llama3"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32,
              "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
              "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    for number, size in enumerate((5_000_000_000, 3_000_000_000), start=1):
        with (folder / f"model-{number:05d}-of-00002.safetensors").open("wb") as file:
            file.truncate(size)  # sparse
    found = await linked.link.model_shape(str(folder))
    assert found.shape is not None
    assert (found.shape.format, found.shape.weights_bytes) == ("hf", 8_000_000_000)
    assert found.shape.layer_kv_heads == (8,) * 32 and found.shape.dtype == "bfloat16"
    assert found.stamp.size_bytes == 8_000_000_000 + (folder / "config.json").stat().st_size
    assert (await linked.link.model_shape(str(folder), found.stamp)).shape is None
    with (folder / "model-00002-of-00002.safetensors").open("r+b") as file:
        file.truncate(3_500_000_000)  # a weight file replaced: the stamp changes
    changed = await linked.link.model_shape(str(folder), found.stamp)
    assert changed.shape is not None and changed.shape.weights_bytes == 8_500_000_000


async def test_models_show_lists_every_copy_the_leader_s_first(
    gpu_agent: Leader, tmp_path: Path
) -> None:
    on_leader = write_model_gguf(tmp_path / "leader" / "m.gguf")
    gpu_agent.store.add_model("m", str(on_leader))
    gpu_agent.store.set_model_location("m", gpu_agent.agent_id, str(tmp_path / "missing.gguf"))
    gone = gpu_agent.store.enroll_node("gpu-z", "cd" * 32).id
    gpu_agent.store.set_model_location("m", gone, "/srv/m.gguf")
    detail = await model_detail(gpu_agent.store, gpu_agent.manager.estimator, gpu_agent.links, "m")
    assert [(c.node_label, c.estimate is not None) for c in detail.copies] == [
        ("local", True),
        ("gpu-a", False),
        ("gpu-z", False),
    ]
    assert detail.copies[0].shape is not None and detail.copies[0].shape.source == str(on_leader)
    assert detail.copies[1].problem == (
        f"node {gpu_agent.agent_id}: {tmp_path / 'missing.gguf'}: no such file or folder on "
        "this host"
    )
    assert detail.copies[2].problem == "node gpu-z is not connected"
