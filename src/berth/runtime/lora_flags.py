"""The flags and environment that start an engine ready for LoRA adapters (pure).

A vLLM or SGLang deployment given adapter slots starts with LoRA enabled and loads adapters
later through its API (:mod:`berth.runtime.lora_api`):

* vLLM ``--enable-lora --max-loras N --max-lora-rank R``, with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in its environment (its "Dynamically serving
  LoRA Adapters" docs);
* SGLang ``--enable-lora --max-loras-per-batch N --max-lora-rank R --lora-target-modules
  M...`` (its "LoRA Serving" docs: rank and modules must be given when adapters are loaded
  after start).

A llama.cpp deployment gets its node's adapters at start, ``--lora FILE`` each, with
``--lora-init-without-apply`` so that none applies until a request asks for it in its
``lora`` field (llama.cpp's ``tools/server/README.md``). ``docs/adapters.md`` has the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, assert_never

from berth.errors import ConfigError

#: The ranks vLLM's ``--max-lora-rank`` accepts (``MaxLoRARanks`` in its LoRA config); berth
#: rounds an adapter's rank up to the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's own default ``--max-lora-rank``, used when no adapter's rank is known.
DEFAULT_MAX_LORA_RANK = 16
#: The environment variable that lets a vLLM server load adapters after it started.
VLLM_RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
#: Flags berth sets for adapters itself, refused in extra arguments.
LORA_FLAGS = frozenset({"--enable-lora", "--max-loras", "--max-lora-rank", "--max-loras-per-batch",
                        "--lora-target-modules", "--lora", "--lora-init-without-apply",
                        "--lora-scaled"})  # fmt: skip


def lora_serve_flags(
    engine: Literal["llamacpp", "vllm", "sglang"],
    *,
    slots: int | None,
    max_rank: int | None,
    target_modules: Sequence[str],
    files: Sequence[Path],
) -> list[str]:
    """The flags that start ``engine`` with ``slots`` LoRA slots (vLLM, SGLang; ``None``:
    LoRA off) up to rank ``max_rank`` (``None``: :data:`DEFAULT_MAX_LORA_RANK`) on
    ``target_modules`` (SGLang; empty: ``all``), or with the GGUF adapters ``files``
    (llama.cpp, in this order: a request names one by its index). Raises ``ConfigError``
    for a rank above vLLM's largest."""
    if engine == "llamacpp":
        flags: list[str] = []
        for path in files:
            flags += ["--lora", str(path)]
        return [*flags, "--lora-init-without-apply"] if files else []
    if slots is None:
        return []
    rank = max_rank or DEFAULT_MAX_LORA_RANK
    if engine == "vllm":
        return ["--enable-lora", "--max-loras", str(slots),
                "--max-lora-rank", str(vllm_lora_rank(rank))]  # fmt: skip
    if engine == "sglang":
        return ["--enable-lora", "--max-loras-per-batch", str(slots),
                "--max-lora-rank", str(rank),
                "--lora-target-modules", *(target_modules or ("all",))]  # fmt: skip
    assert_never(engine)


def lora_env(engine: str, slots: int | None) -> dict[str, str]:
    """The environment a vLLM engine with LoRA slots needs to load adapters while it runs."""
    return {VLLM_RUNTIME_LORA_ENV: "True"} if engine == "vllm" and slots is not None else {}


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's ``--max-lora-rank`` accepts that is at least ``rank``
    (:data:`VLLM_LORA_RANKS`); ``ConfigError`` above the largest."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"LoRA rank {rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")
