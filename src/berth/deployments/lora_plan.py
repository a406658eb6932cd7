"""What a new deployment of a base model starts with for its LoRA adapters (pure).

vLLM and SGLang start with LoRA on and a number of adapter slots, loading adapters later
through their API; llama.cpp starts with every adapter of its base on its node (``--lora``)
and applies one per request. :func:`plan_lora` decides it, :func:`lora_notes` says it for
``berth plan``; :mod:`berth.runtime.engines` turns it into flags.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from berth.errors import ConfigError
from berth.vocab.engines import EngineName, RuntimeName
from berth.vocab.records import AdapterRecord

#: The adapter format each engine takes.
FORMAT_OF_ENGINE: dict[EngineName, str] = {"llamacpp": "gguf", "vllm": "peft", "sglang": "peft"}


@dataclass(frozen=True)
class LoraPlan:
    """How a new deployment starts with respect to adapters: vLLM/SGLang with ``slots``
    (``None``: LoRA off), up to ``max_rank``, on ``target_modules``; llama.cpp with the
    adapters ``names`` at ``files`` (``--lora``, in this order)."""

    slots: int | None = None
    max_rank: int | None = None
    target_modules: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    files: tuple[Path, ...] = ()


def plan_lora(
    engine: EngineName,
    runtime: RuntimeName,
    node_id: str,
    adapters: Iterable[AdapterRecord],
    *,
    max_adapters: int | None,
    node_serves_adapters: bool,
) -> LoraPlan:
    """The adapters a deployment of their base starts with (pure).

    vLLM and SGLang get LoRA with ``max_adapters`` slots (default 1, vLLM's own default)
    when the base has PEFT adapters or ``max_adapters`` is given, their largest rank and
    every module they target; llama.cpp gets the base's GGUF adapters on ``node_id``, by
    name. Nothing for the docker runtime (adapter files are not mounted into containers)
    or a node whose agent does not serve adapters (``node_serves_adapters``).

    Raises :class:`~berth.errors.ConfigError` for ``max_adapters`` below 1, or given for
    llama.cpp, or for a container.
    """
    if max_adapters is not None:
        if max_adapters < 1:
            raise ConfigError(f"--max-adapters must be at least 1, not {max_adapters}")
        if engine == "llamacpp":
            raise ConfigError(
                "--max-adapters is for vLLM and SGLang: llama.cpp starts with every adapter "
                "of its base on its node"
            )
        if runtime != "process":
            raise ConfigError("LoRA adapters are served by the process runtime only")
    if runtime != "process" or not node_serves_adapters:
        return LoraPlan()
    records = sorted(adapters, key=lambda a: a.name)
    if engine == "llamacpp":
        mine = [a for a in records if a.format == "gguf" and node_id in a.locations]
        return LoraPlan(
            names=tuple(a.name for a in mine),
            files=tuple(Path(a.locations[node_id]) for a in mine),
        )
    peft = [a for a in records if a.format == "peft"]
    if max_adapters is None and not peft:
        return LoraPlan()
    ranks = [a.rank for a in peft if a.rank is not None]
    modules = sorted({m for a in peft for m in a.target_modules})
    return LoraPlan(
        slots=max_adapters or 1,
        max_rank=max(ranks) if ranks else None,
        target_modules=tuple(modules),
    )


def lora_notes(lora: LoraPlan) -> list[str]:
    """What ``berth plan`` says of the adapters a deployment would start with."""
    if lora.names:
        names = ", ".join(lora.names)
        return [f"starts with adapters {names} (--lora; each request for one applies it)"]
    if lora.slots is not None:
        rank = f", rank up to {lora.max_rank}" if lora.max_rank is not None else ""
        plural = "s" if lora.slots != 1 else ""
        return [f"starts with LoRA on: {lora.slots} adapter slot{plural}{rank}, loaded on demand"]
    return []
