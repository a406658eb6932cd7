"""A model's shape on the agent link: :class:`berth.placement.ModelShape` to and from its
wire form (:class:`~berth.cluster.protocol.ops.ModelShapeInfo`, the ``model_shape`` op's
result), in this one place.

The protocol package sits below placement, so the wire struct cannot name the placement
type; the conversion lives here, where both are in reach, and both ends of the link use it
(the agent's service to answer, the leader's :class:`~berth.cluster.leader.remote_link.RemoteLink`
to read the answer).
"""

from __future__ import annotations

from pathlib import Path

from berth.cluster.protocol.ops import ModelShapeInfo, ModelShapeResult
from berth.placement.model_files import FileStamp, ModelFileShape
from berth.placement.shape import ModelShape


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
