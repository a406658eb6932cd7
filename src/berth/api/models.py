"""Registered models (weights): ``/admin/models``."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, ConfigDict, Field, field_validator

from berth.api.base import AbsolutePath, ApiInput, ApiModel, Timestamp, named_pattern
from berth.api.plans import VramEstimateOut
from berth.vocab.records import ModelSource

#: Model names: letters, digits and ``. _ - : /`` (hub ids like ``org/model:q4``), starting
#: with a letter or digit, no ``..``: safe in URLs, file names and the OpenAI ``model`` field.
#: The same rule names deployments' served model names, adapters and routes.
MODEL_NAME_PATTERN = named_pattern(
    r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$",
    "a valid name: up to 200 letters, digits, '.', '_', ':', '/' and '-', "
    "starting with a letter or digit, without '..'",
)


def no_parent_segments(value: str | None) -> str | None:
    """``value`` when it holds no ``..`` (a name is a URL path segment and a file name);
    ``ValueError`` otherwise. A field validator of every name that follows a
    :data:`MODEL_NAME_PATTERN`-like rule."""
    if value is not None and ".." in value:
        raise ValueError("must not contain '..'")
    return value


class ModelIn(ApiInput):
    """``POST /admin/models``: register weights under ``name``.

    ``path`` is absolute: a GGUF file or a model folder on the leader's host, or, with
    ``node`` (an id or label), on that node's host (not checked by the leader).  ``source``
    ``hub`` with ``repo_id`` and ``revision`` records what ``berth pull`` downloaded.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"name": "llama-3.1-8b-q4", "path": "/srv/models/llama-3.1-8b-instruct-q4_k_m.gguf"}
            ]
        }
    )

    name: str = Field(pattern=MODEL_NAME_PATTERN)
    path: AbsolutePath
    source: Literal["local", "hub"] = "local"
    repo_id: str | None = None
    revision: str | None = None
    node: str | None = None

    _name = field_validator("name")(no_parent_segments)


class RegisteredModel(ApiModel):
    """A registered model: where its weights are on the leader's host, their size on disk
    (bytes), and whether they were registered (``local``), pulled (``hub``: ``repo_id`` and
    ``revision`` name what) or exist only on agents' hosts (``remote``).  ``warning``, in
    the answer of ``POST /admin/models`` only: why node local would refuse to run the
    weights (their path is outside its model roots) and the command that allows them."""

    name: str
    path: str
    source: ModelSource
    repo_id: str | None
    revision: str | None
    size_bytes: int
    created_at: Timestamp
    warning: str | None = None


class LocatedModel(RegisteredModel):
    """A model with where its weights are on other nodes' hosts: node id → path."""

    locations: dict[str, str]


class ModelShapeOut(ApiModel):
    """What the VRAM estimate reads of a model's files (``berth.placement.ModelShape``):
    ``format`` ``gguf`` (a GGUF header) or ``hf`` (``config.json``); ``weights_bytes`` the
    weight files' size; ``kv_heads`` the key/value heads of each layer; ``context_length``
    the trained context (``None``: not stated); ``source`` the file read, on the copy's
    host."""

    format: Literal["gguf", "hf"]
    architecture: str
    weights_bytes: int
    block_count: int
    embedding_length: int
    head_count: int
    #: read from ``kv_heads`` (the JSON) or from ``layer_kv_heads`` (a shape's attribute:
    #: the admin API builds this body from the shape's wire form, ``berth.cluster.wire_forms``)
    kv_heads: list[int] = Field(validation_alias=AliasChoices("kv_heads", "layer_kv_heads"))
    key_length: int
    value_length: int
    context_length: int | None
    vocab_size: int | None
    dtype: str | None
    source: str


class ModelCopy(ApiModel):
    """One copy of a model's files: on node ``node_id`` (``local``: the leader's host) at
    ``path``, with the shape read there and the estimate of one deployment on one GPU at the
    model's trained context (llama.cpp for GGUF, vLLM for an HF folder), or why there are
    none (``problem``: the node is not connected, its agent cannot read headers, the files
    cannot be read)."""

    node_id: str
    node_label: str
    path: str
    shape: ModelShapeOut | None
    estimate: VramEstimateOut | None
    problem: str | None


class ModelDetail(LocatedModel):
    """``GET /admin/models/{name}``: a model with each copy's shape and estimate."""

    copies: list[ModelCopy]


class ModelRemoved(ApiModel):
    """``DELETE /admin/models/{name}``: the name unregistered (the files stay)."""

    removed: str
