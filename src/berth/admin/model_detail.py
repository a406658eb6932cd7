"""``GET /admin/models/{name}`` (``berth models show``): a model with, for each copy of its
files, the shape read there and what one deployment of it would need.

The leader's own copy is read here; a copy on another node is read by that node's agent
(the ``model_shape`` op), through the same :class:`~berth.deployments.estimates.VramEstimator`
cache placement uses, so showing a model warms the cache for the next plan.
"""

from __future__ import annotations

import asyncio

from berth.admin.plans import estimate_view
from berth.api import ModelCopy, ModelDetail, ModelShapeOut
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.wire_forms import shape_to_wire
from berth.deployments.estimates import NodeCopy, VramEstimator
from berth.deployments.model_registration import located_model_view
from berth.errors import BerthError
from berth.placement import EstimateRequest, ModelShape, estimate_vram
from berth.store import Store
from berth.vocab.engines import EngineName


async def model_detail(
    store: Store, estimator: VramEstimator, links: LinkRegistry, name: str
) -> ModelDetail:
    """Model ``name`` with its copies (the leader's first, then by node label).

    Raises ``NotFoundError`` for an unknown model.
    """
    record = await asyncio.to_thread(store.get_model, name)
    located = await asyncio.to_thread(store.list_model_locations, name)
    labels = {n.id: n.label for n in await asyncio.to_thread(store.list_nodes)}
    copies: list[ModelCopy] = []
    if record.source != "remote":
        try:
            shape: ModelShape | None = await estimator.shape(record)
            problem = None
        except BerthError as exc:
            shape, problem = None, str(exc)
        copies.append(_copy(LOCAL_NODE_ID, labels.get(LOCAL_NODE_ID, LOCAL_NODE_ID),
                            str(record.path), shape, problem))  # fmt: skip
    for location in sorted(located, key=lambda x: labels.get(x.node_id, x.node_id)):
        label = labels.get(location.node_id, location.node_id)
        link = links.get(location.node_id)
        shape, problem = None, None
        if link is None:
            problem = f"node {label} is not connected"
        else:
            try:
                shape = await estimator.shape_on(NodeCopy(link, label, location.path))
            except BerthError as exc:
                problem = str(exc)
        copies.append(_copy(location.node_id, label, location.path, shape, problem))
    view = located_model_view(record, {x.node_id: x.path for x in located})
    return view.extended(ModelDetail, copies=copies)


def _copy(
    node_id: str, label: str, path: str, shape: ModelShape | None, problem: str | None
) -> ModelCopy:
    if shape is None:
        return ModelCopy(node_id=node_id, node_label=label, path=path, shape=None,
                         estimate=None, problem=problem)  # fmt: skip
    engine: EngineName = "llamacpp" if shape.format == "gguf" else "vllm"
    try:
        estimate = estimate_view(estimate_vram(shape, EstimateRequest(engine)))
    except BerthError as exc:
        return ModelCopy(node_id=node_id, node_label=label, path=path, shape=shape_view(shape),
                         estimate=None, problem=str(exc))  # fmt: skip
    return ModelCopy(node_id=node_id, node_label=label, path=path, shape=shape_view(shape),
                     estimate=estimate, problem=None)  # fmt: skip


def shape_view(shape: ModelShape) -> ModelShapeOut:
    """A model's shape for the admin API: its wire form (the one field-by-field copy of a
    shape, :func:`berth.cluster.wire_forms.shape_to_wire`), read by the response model."""
    return ModelShapeOut.model_validate(shape_to_wire(shape), from_attributes=True)
