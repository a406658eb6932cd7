"""The wire forms of values other packages own, converted in this one place by both ends of
the agent link: a host's GPUs (the vocabulary's ``GpuInfo`` <-> the wire's ``GpuState``, in
an agent's Hello and heartbeats) and a model's shape (:class:`berth.placement.ModelShape`
<-> :class:`~berth.cluster.protocol.ops.ModelShapeInfo`, the ``model_shape`` op's result).

The protocol package sits below the vocabulary's users and below placement, so its structs
cannot name their types; the conversions live here, where both are in reach. The agent uses
them to send (its service, its node sampler), the leader's side to read (the hub, the remote
link). Agents import this module, so it stays free of the store (and SQLAlchemy), and of the
leader's side: it imports the protocol, the vocabulary and placement only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from berth.cluster.protocol.ops import ModelShapeInfo, ModelShapeResult
from berth.cluster.protocol.payloads import GpuState
from berth.placement.model_files import FileStamp, ModelFileShape
from berth.placement.shape import ModelShape
from berth.vocab.gpu import GpuInfo


def shape_to_wire(shape: ModelShape) -> ModelShapeInfo:
    """``shape`` as the agent sends it (its ``host`` stays behind: the leader knows which
    node answered)."""
    return ModelShapeInfo(
        format=shape.format,
        architecture=shape.architecture,
        weights_bytes=shape.weights_bytes,
        block_count=shape.block_count,
        embedding_length=shape.embedding_length,
        head_count=shape.head_count,
        layer_kv_heads=list(shape.layer_kv_heads),
        key_length=shape.key_length,
        value_length=shape.value_length,
        context_length=shape.context_length,
        vocab_size=shape.vocab_size,
        dtype=shape.dtype,
        source=str(shape.source),
    )


def shape_from_wire(info: ModelShapeInfo, *, host: str | None) -> ModelShape:
    """The shape an agent sent, read on the host of node ``host`` (its label)."""
    return ModelShape(
        format=info.format,
        architecture=info.architecture,
        weights_bytes=info.weights_bytes,
        block_count=info.block_count,
        embedding_length=info.embedding_length,
        head_count=info.head_count,
        layer_kv_heads=tuple(info.layer_kv_heads),
        key_length=info.key_length,
        value_length=info.value_length,
        context_length=info.context_length,
        vocab_size=info.vocab_size,
        dtype=info.dtype,
        source=Path(info.source),
        host=host,
    )


def file_shape_to_wire(found: ModelFileShape) -> ModelShapeResult:
    """The ``model_shape`` answer for what the agent read."""
    return ModelShapeResult(
        size_bytes=found.stamp.size_bytes,
        mtime_ns=found.stamp.mtime_ns,
        shape=None if found.shape is None else shape_to_wire(found.shape),
    )


def file_shape_from_wire(result: ModelShapeResult, *, host: str | None) -> ModelFileShape:
    """What node ``host``'s agent answered to ``model_shape``."""
    shape = None if result.shape is None else shape_from_wire(result.shape, host=host)
    return ModelFileShape(FileStamp(result.size_bytes, result.mtime_ns), shape)


def gpu_states(gpus: Sequence[GpuInfo]) -> list[GpuState]:
    """The agent's GPUs as Hello and heartbeats carry them."""
    return [
        GpuState(
            index=g.index,
            name=g.name,
            uuid=g.uuid,
            memory_total_mb=g.memory_total_mb,
            memory_used_mb=g.memory_used_mb,
            utilization_pct=g.utilization_pct,
        )
        for g in gpus
    ]


def gpu_infos(states: Sequence[GpuState]) -> tuple[GpuInfo, ...]:
    """GPUs received from an agent, as the rest of the leader handles them."""
    return tuple(
        GpuInfo(
            index=g.index,
            name=g.name,
            uuid=g.uuid,
            memory_total_mb=g.memory_total_mb,
            memory_used_mb=g.memory_used_mb,
            utilization_pct=g.utilization_pct,
        )
        for g in states
    )
