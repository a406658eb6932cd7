"""VRAM estimates for the leader: model shapes read from files (cached), estimates per
deployment (remembered).

:func:`berth.placement.estimate_vram` is pure; this is the I/O beside it.  A model's shape is
read from its registered path on the leader's host (a GGUF header or an HF ``config.json``)
off the event loop.  A model registered only with paths on agents (``source == "remote"``)
is read where it lives: the node's agent reads the header on its host and answers the
``model_shape`` op (:class:`NodeCopy` names the copy asked about); an agent without
``op.model_shape`` leaves it without an estimate, as before the op existed.

One cache holds both: a shape per ``(node, path)``, kept while the files' size and
modification time (:class:`~berth.placement.model_files.FileStamp`) stay the same.  A local
file is stamped here; an agent is sent the stamp the leader has, and reads the header again
only when its files no longer have it (one round trip, no header read, per plan).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from berth.cluster.leader.agent_link import LOCAL_NODE_ID, AgentLink
from berth.cluster.protocol.ops import MODEL_SHAPE
from berth.errors import ConfigError, EngineError
from berth.placement import EstimateRequest, ModelShape, VramEstimate, estimate_vram
from berth.placement.errors import ModelFileError
from berth.placement.model_files import FileStamp, model_stamp, read_model_shape
from berth.vocab.engines import EngineName
from berth.vocab.records import DeploymentRecord, ModelRecord

#: Shapes kept (one per model file and node) and deployment estimates remembered.
MAX_SHAPES = 256
MAX_DEPLOYMENTS = 4096

#: (node id, path on that node's host)
_ShapeKey = tuple[str, str]


@dataclass(frozen=True)
class EstimateResult:
    """An estimate, or why there is none (``problem``)."""

    estimate: VramEstimate | None
    problem: str | None = None


@dataclass(frozen=True)
class NodeCopy:
    """A model's copy on another node's host: ``path`` there, the ``link`` to the node's
    agent and the node's ``label`` (what messages and the shape's ``host`` name)."""

    link: AgentLink
    label: str
    path: str

    @property
    def node_id(self) -> str:
        return self.link.node_id


@dataclass(frozen=True)
class _Cached:
    stamp: FileStamp
    shape: ModelShape


class VramEstimator:
    """Estimates from model files, for placement and for the deployments already placed."""

    def __init__(self) -> None:
        self._shapes: OrderedDict[_ShapeKey, _Cached] = OrderedDict()
        self._deployments: OrderedDict[str, EstimateResult] = OrderedDict()

    async def shape(self, model: ModelRecord, copies: Sequence[NodeCopy] = ()) -> ModelShape:
        """The shape of ``model``: from its files on the leader's host, else (a model with
        paths only on other nodes) from the first of ``copies`` whose agent reads it.

        Raises :class:`~berth.placement.errors.ModelFileError` when they cannot be read,
        saying why for each copy asked.
        """
        path = Path(model.path)
        if model.source != "remote":
            return await self._local_shape(path)
        problems: list[str] = []
        for copy in copies:
            try:
                return await self.shape_on(copy)
            except (EngineError, ModelFileError) as exc:
                problems.append(str(exc))
        why = f" ({'; '.join(problems)})" if problems else " (no node with a copy was asked)"
        raise ModelFileError(
            f"model {model.name} has paths only on other nodes, so the leader cannot read "
            f"its header{why}",
            path=path,
        )

    async def shape_on(self, copy: NodeCopy) -> ModelShape:
        """The shape of the model at ``copy``, read by its node's agent (its ``host`` is the
        node's label).

        Raises ``EngineError`` when the agent lacks ``op.model_shape`` (an older agent) or
        cannot read the files, with its words.
        """
        if MODEL_SHAPE.capability not in copy.link.capabilities:
            raise EngineError(
                f"node {copy.label}'s agent does not read model headers (no "
                f"{MODEL_SHAPE.capability}); upgrade it"
            )
        key = (copy.node_id, copy.path)
        cached = self._shapes.get(key)
        found = await copy.link.model_shape(copy.path, cached.stamp if cached else None)
        if found.shape is None and cached is not None and found.stamp == cached.stamp:
            self._shapes.move_to_end(key)
            return dataclasses.replace(cached.shape, host=copy.label)
        if found.shape is None:  # an agent answering "unchanged" to a stamp it was not sent
            raise EngineError(f"node {copy.label} sent no shape for {copy.path}")
        shape = dataclasses.replace(found.shape, host=copy.label)
        self._keep(key, _Cached(found.stamp, shape))
        return shape

    async def _local_shape(self, path: Path) -> ModelShape:
        key = (LOCAL_NODE_ID, str(path))
        stamp = await asyncio.to_thread(model_stamp, path)
        cached = self._shapes.get(key)
        if cached is not None and stamp is not None and cached.stamp == stamp:
            self._shapes.move_to_end(key)
            return cached.shape
        shape = await asyncio.to_thread(read_model_shape, path)
        if stamp is not None:
            self._keep(key, _Cached(stamp, shape))
        return shape

    def _keep(self, key: _ShapeKey, cached: _Cached) -> None:
        self._shapes[key] = cached
        self._shapes.move_to_end(key)
        while len(self._shapes) > MAX_SHAPES:
            self._shapes.popitem(last=False)

    async def estimate(
        self,
        model: ModelRecord,
        engine: EngineName,
        *,
        ctx: int | None,
        extra_args: tuple[str, ...],
        gpu_count: int,
        copies: Sequence[NodeCopy] = (),
    ) -> EstimateResult:
        """The estimate of a deployment of ``model``, or why there is none (its files cannot
        be read); ``copies`` as :meth:`shape`.

        Raises :class:`~berth.errors.ConfigError` for a request the estimate refuses (a
        context that is not positive, an unknown cache type, a malformed memory flag).
        """
        try:
            shape = await self.shape(model, copies)
        except ModelFileError as exc:
            return EstimateResult(None, str(exc))
        request = EstimateRequest(engine, ctx, extra_args, gpu_count)
        return EstimateResult(estimate_vram(shape, request))

    def remember(self, deployment_id: str, result: EstimateResult) -> None:
        """Keep the estimate a deployment was placed with."""
        self._deployments[deployment_id] = result
        while len(self._deployments) > MAX_DEPLOYMENTS:
            self._deployments.popitem(last=False)

    async def of_deployment(
        self,
        record: DeploymentRecord,
        model: ModelRecord | None,
        engine: EngineName,
        copy: NodeCopy | None = None,
    ) -> EstimateResult:
        """The estimate ``record`` was placed with, else one made now from its model (a
        deployment from before this leader started; ``copy``: the model's copy on the
        deployment's node, for a model with paths only on other nodes); ``model`` ``None``:
        unknown model."""
        found = self._deployments.get(record.id)
        if found is not None:
            return found
        if model is None:
            result = EstimateResult(None, f"model {record.model_name} is not registered")
        else:
            try:
                result = await self.estimate(
                    model,
                    engine,
                    ctx=record.ctx,
                    extra_args=record.extra_args,
                    gpu_count=max(1, len(record.gpus)),
                    copies=() if copy is None else (copy,),
                )
            except ConfigError as exc:
                result = EstimateResult(None, str(exc))
        if result.estimate is not None or copy is None:  # a node may answer later
            self.remember(record.id, result)
        return result
