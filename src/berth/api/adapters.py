"""LoRA adapters, served under their own names on a deployment of their base:
``/admin/adapters``."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from berth.api.base import AbsolutePath, ApiInput, ApiModel, Timestamp
from berth.api.models import MODEL_NAME_PATTERN
from berth.vocab.records import AdapterFormatName, ModelSource


class AdapterIn(ApiInput):
    """``POST /admin/adapters``: register the adapter ``name`` of the model ``base``.

    ``path`` is absolute: a PEFT folder (vLLM, SGLang) or a GGUF LoRA file (llama.cpp) on the
    leader's host, or, with ``node`` (an id or label), on that node's host, which the leader
    cannot read (then the engine checks it when it loads it). Registering a name again with
    another ``node`` adds that node's copy. ``source`` ``hub`` with ``repo_id`` and
    ``revision`` records what ``berth pull`` downloaded.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "llama-3.1-8b-sql",
                    "base": "llama-3.1-8b-q4",
                    "path": "/srv/adapters/sql-lora.gguf",
                }
            ]
        }
    )

    name: str = Field(pattern=MODEL_NAME_PATTERN)
    base: str
    path: AbsolutePath
    node: str | None = None
    source: Literal["local", "hub"] = "local"
    repo_id: str | None = None
    revision: str | None = None

    @field_validator("name")
    @classmethod
    def _no_parent_segments(cls, name: str) -> str:
        if ".." in name:
            raise ValueError("must not contain '..'")
        return name


class AdapterLoaded(ApiModel):
    """An engine that has the adapter now: a vLLM or SGLang deployment that loaded it, or a
    llama.cpp deployment started with it."""

    deployment_id: str
    node_id: str


class Adapter(ApiModel):
    """A registered adapter: its base model, format (``peft`` or ``gguf``), rank and target
    modules (read from its files; ``None`` and empty when they are only on another node's
    host), where its files are (node id → path), and where it is loaded now."""

    name: str
    base: str
    format: AdapterFormatName
    rank: int | None
    target_modules: list[str]
    source: ModelSource
    repo_id: str | None
    revision: str | None
    created_at: Timestamp
    locations: dict[str, str]
    loaded_on: list[AdapterLoaded]


class AddedAdapter(Adapter):
    """The adapter just registered. ``checked`` says whether the leader read its files (and
    found they fit the base); ``restart_needed`` lists the base's running deployments that
    cannot serve it until restarted (llama.cpp takes its adapters at start; a vLLM or SGLang
    engine started without LoRA cannot load any)."""

    checked: bool
    restart_needed: list[str]


class AdapterRemoved(ApiModel):
    """``DELETE /admin/adapters/{name}``: the adapter unregistered (its files stay), or only
    its copy on ``node`` when one was given."""

    removed: str
    node: str | None = None
