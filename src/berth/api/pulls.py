"""Pulls from the Hugging Face hub: ``/admin/pulls`` (the leader downloads, then registers),
and what a pulled folder is registered as, shared by the leader's pull jobs and
``berth pull`` (which downloads on the user's side and registers through the API).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from berth.api.adapters import AdapterIn
from berth.api.base import ApiInput, ApiModel, Timestamp, named_pattern
from berth.api.models import MODEL_NAME_PATTERN, ModelIn, RegisteredModel
from berth.errors import ConfigError
from berth.weights.adapter_files import PEFT_CONFIG, AdapterFacts, inspect_adapter
from berth.weights.gguf_file import is_gguf, read_gguf_header

#: Where a pull job is: waiting for a free download slot, downloading, registering what it
#: downloaded, and the three ends.
PullState = Literal["queued", "downloading", "registering", "done", "failed", "cancelled"]
#: Hub repository ids: ``name`` or ``org/name``, each part letters, digits and ``. _ -``
#: starting with a letter or digit (the hub's own rule, less its length limits).
HUB_REPO_PATTERN = named_pattern(
    r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$",
    "a Hugging Face repository id: ORG/NAME (or NAME) of letters, digits, '.', '_' and '-', "
    "each part starting with a letter or digit",
)
#: The states a job leaves no more.
FINISHED_PULL_STATES: frozenset[str] = frozenset({"done", "failed", "cancelled"})


class PullIn(ApiInput):
    """``POST /admin/pulls``: download hub repository ``repo`` (``org/name``) at
    ``revision`` (a branch, tag or commit; default the main branch) into the leader's models
    folder and register it as ``name`` (default: ``repo``): as a model, or, for an adapter
    repository, as an adapter of ``base`` (default: the registered model pulled from the
    repository its ``adapter_config.json`` names)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"repo": "bartowski/Llama-3.2-1B-Instruct-GGUF", "name": "llama-3.2-1b"}]
        }
    )

    repo: str = Field(pattern=HUB_REPO_PATTERN, max_length=200)
    name: str | None = Field(default=None, pattern=MODEL_NAME_PATTERN)
    revision: str | None = Field(default=None, min_length=1, max_length=200)
    base: str | None = None

    @field_validator("name", "repo")
    @classmethod
    def _no_parent_segments(cls, value: str | None) -> str | None:
        if value is not None and ".." in value:
            raise ValueError("must not contain '..'")
        return value

    @property
    def registered_name(self) -> str:
        """The name the model or adapter gets."""
        return self.name or self.repo


class PullFile(ApiModel):
    """One file of a pull: its path in the repository, its size and how much of it is here
    (bytes)."""

    path: str
    size_bytes: int
    done_bytes: int


class Pull(ApiModel):
    """A pull job on the leader. ``done_bytes`` and ``total_bytes`` sum its files
    (``total_bytes`` is ``None`` until the hub has listed them); ``error`` says in plain
    words why a ``failed`` job failed; ``kind`` and ``path`` say what was registered and
    where its files are, once known."""

    id: str
    repo: str
    name: str
    revision: str | None
    base: str | None
    state: PullState
    error: str | None
    done_bytes: int
    total_bytes: int | None
    files: list[PullFile]
    kind: Literal["model", "adapter"] | None
    path: str | None
    created_at: Timestamp
    finished_at: Timestamp | None


def pulled_adapter(folder: Path) -> AdapterFacts | None:
    """The adapter a pulled repository holds: a PEFT folder (``adapter_config.json``), or
    one GGUF file of type ``adapter``; ``None`` for a model. Raises ``ConfigError`` for a
    PEFT folder that is not a usable adapter. Blocking (it reads files)."""
    if (folder / PEFT_CONFIG).is_file():
        return inspect_adapter(folder)
    ggufs = sorted(p for p in folder.glob("*.gguf") if is_gguf(p))
    if len(ggufs) != 1:
        return None
    try:
        kind = read_gguf_header(ggufs[0]).text("general.type")
    except ConfigError:
        return None  # not a readable header: registering it as a model says what is wrong
    return inspect_adapter(ggufs[0]) if kind == "adapter" else None


def base_model_for(trained_on: str | None, models: Sequence[RegisteredModel]) -> str:
    """The registered model pulled from ``trained_on`` (an adapter's
    ``base_model_name_or_path``), or named so; ``ConfigError`` asking for a base otherwise."""
    if trained_on:
        for model in models:
            if model.repo_id == trained_on or model.name == trained_on:
                return model.name
    named = f" ({trained_on})" if trained_on else ""
    raise ConfigError(
        f"this is an adapter repository: name its base model{named} "
        "(berth pull --base MODEL, or base in the pull)"
    )


def pulled_registration(
    body: PullIn, folder: Path, models: Sequence[RegisteredModel]
) -> ModelIn | AdapterIn:
    """What the pull ``body`` that downloaded ``folder`` registers: an adapter of its base
    (``body.base``, else :func:`base_model_for` among ``models``), or a model. Blocking.

    Raises ``ConfigError``: ``folder`` is a PEFT folder that is not a usable adapter, an
    adapter's base cannot be found, or ``base`` was given for a model.
    """
    adapter = pulled_adapter(folder)
    if adapter is not None:
        return AdapterIn(
            name=body.registered_name,
            base=body.base or base_model_for(adapter.trained_on, models),
            path=str(adapter.path),
            source="hub",
            repo_id=body.repo,
            revision=body.revision,
        )
    if body.base is not None:
        raise ConfigError(f"{body.repo} is not an adapter repository: a base is for adapters")
    return ModelIn(
        name=body.registered_name,
        path=str(folder),
        source="hub",
        repo_id=body.repo,
        revision=body.revision,
    )
