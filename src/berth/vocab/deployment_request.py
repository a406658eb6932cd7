"""What to run: :class:`DeploymentRequest`, one model on one engine, as the agent core hands
it to an engine's runtime (:func:`berth.runtime.engines.build_launch_spec` turns it into a
command line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from berth.vocab.engines import EngineName, RuntimeName
from berth.vocab.signed_spec import SignedSpec


@dataclass(frozen=True)
class DeploymentRequest:
    """What to run: one model on one engine, on a port chosen by the caller.

    ``model_path`` is a GGUF file or a directory (an HF-style checkpoint for vLLM and SGLang,
    a folder holding one GGUF for llama.cpp).  ``gpus`` are device indices as NVML numbers
    them; ``ctx`` is the context length in tokens (``None``: the engine's default, usually
    the model's own); ``extra_args`` are appended verbatim after berth's own flags.
    ``runtime`` says how the engine runs; ``image`` is the container image for the docker
    runtime (``None``: the engine's default image,
    :data:`~berth.vocab.images.DEFAULT_IMAGES`).  ``api_key`` is the engine's own API key,
    chosen by the agent core that starts it (``None``: the engine runs without one); it
    never appears in a ``repr``.

    Adapters (vLLM, SGLang): ``adapter_slots`` enables LoRA with that many adapters loaded at
    once, up to rank ``max_lora_rank`` (``None``: vLLM's default, 16), on the
    modules ``lora_target_modules`` (SGLang needs them). llama.cpp: ``lora_files`` are
    given with ``--lora`` in this order (a request names one by its index).

    ``signed`` is the spec the cluster signed for this deployment when the admin API or CLI
    accepted it (``None``: none; the agent core refuses such a start when it checks specs).
    """

    deployment_id: str
    model_name: str
    model_path: Path
    engine: EngineName
    port: int
    log_path: Path
    gpus: tuple[int, ...] = ()
    ctx: int | None = None
    extra_args: tuple[str, ...] = ()
    served_model_name: str | None = None
    runtime: RuntimeName = "process"
    image: str | None = None
    api_key: str | None = field(default=None, repr=False)
    adapter_slots: int | None = None
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()
    lora_files: tuple[Path, ...] = ()
    signed: SignedSpec | None = field(default=None, repr=False, compare=False)

    @property
    def effective_served_name(self) -> str:
        """The name clients use in ``"model"``: ``served_model_name``, else ``model_name``."""
        return self.served_model_name or self.model_name

    @property
    def uses_adapters(self) -> bool:
        """Whether the engine is started to serve LoRA adapters (slots or ``--lora`` files)."""
        return self.adapter_slots is not None or bool(self.lora_files)
