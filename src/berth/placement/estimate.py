"""How much GPU memory a deployment takes: a pure estimate from the model's shape.

:func:`estimate_vram` takes a :class:`~berth.placement.shape.ModelShape` (read from a GGUF
header or an HF ``config.json``) and what the deployment asks for (:class:`EstimateRequest`:
engine, context, extra engine arguments, GPU count) and returns a :class:`VramEstimate`:
weights, KV cache and engine overhead per GPU, with the inputs used, so ``berth plan`` can
show the arithmetic.  Memory is in MiB (2**20 bytes), each part rounded up.

The parts, per engine:

* **weights**: the GGUF file (llama.cpp with every layer offloaded, which berth asks for
  with ``-ngl`` whenever it gives a deployment GPUs), or the HF directory's weight files
  (vLLM, SGLang).  This overstates llama.cpp a little: its token-embedding table stays in
  host memory.  Split over ``gpu_count`` GPUs (llama.cpp splits layers, vLLM and SGLang
  split tensors).
* **KV cache**: ``ctx * sum over layers of kv_heads * (key_length * bytes_k + value_length *
  bytes_v)``, the size llama.cpp allocates and logs as ``llama_kv_cache: size = …`` (checked
  against its log for SmolLM2 in the tests), and what vLLM and SGLang need for one sequence
  of ``ctx`` tokens (vLLM refuses to start when its KV cache cannot hold ``max_model_len``
  tokens).  ``ctx`` is the context asked for (``--ctx``, or the engine's own flag in the
  extra arguments), else the model's trained context (llama-server's ``-c 0`` default loads
  it from the model; vLLM's ``max_model_len`` and SGLang's ``context_length`` default to
  ``max_position_embeddings``), else :data:`FALLBACK_CTX`.  Element sizes: ggml's block
  types (``ggml-common.h``: a q8_0 block is 32 int8 weights and one f16 scale, 34 bytes;
  q4_0 is 16 bytes of nibbles and a scale, 18 bytes), llama.cpp's ``--cache-type-k/-v``
  (default f16); vLLM/SGLang ``--kv-cache-dtype`` (``auto``: the model's 16-bit dtype; vLLM
  runs float32 checkpoints in float16; fp8: one byte).  Sliding-window layers (Gemma,
  gpt-oss) and compressed caches (DeepSeek's MLA) need less than this says.
* **overhead**: documented constants below (CUDA context, compute buffers, activations).

vLLM (``--gpu-memory-utilization``, default 0.9 per its engine arguments reference) takes
that fraction of the *whole* GPU at start, whatever the model needs, and refuses to start
when less than that is free; the model (weights, overhead, one ``ctx`` sequence of KV cache)
must fit inside the fraction.  So a vLLM deployment holds ``utilization * GPU total``: see
:meth:`VramEstimate.holds_mb`.  SGLang's ``--mem-fraction-static`` (default 0.9 in its
server arguments page) sizes its static pool (weights + KV) the same way and uses the rest
of the GPU for activations and CUDA graphs, so berth counts an SGLang deployment as holding
the whole GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, assert_never

from berth.errors import ConfigError
from berth.placement.shape import ModelShape
from berth.vocab.engines import EngineName

MIB = 1 << 20

#: llama.cpp KV cache element types (``--cache-type-k/-v``) in bytes per element: ggml's
#: block sizes over elements per block (``ggml-common.h``).
LLAMACPP_CACHE_TYPES: dict[str, Fraction] = {
    "f32": Fraction(4),
    "f16": Fraction(2),
    "bf16": Fraction(2),
    "q8_0": Fraction(34, 32),
    "q4_0": Fraction(18, 32),
    "q4_1": Fraction(20, 32),
    "iq4_nl": Fraction(18, 32),
    "q5_0": Fraction(22, 32),
    "q5_1": Fraction(24, 32),
}
#: vLLM/SGLang ``--kv-cache-dtype`` values in bytes per element (``auto``: the model's dtype,
#: 16-bit for every checkpoint these engines serve by default).
HF_CACHE_TYPES: dict[str, Fraction] = {
    "auto": Fraction(2),
    "bfloat16": Fraction(2),
    "float16": Fraction(2),
    "fp8": Fraction(1),
    "fp8_e4m3": Fraction(1),
    "fp8_e5m2": Fraction(1),
    "fp8_inc": Fraction(1),
}

#: The context used when neither the request nor the model states one (llama.cpp's
#: ``--fit-ctx`` minimum and a common engine default).
FALLBACK_CTX = 4096

#: Per GPU: the CUDA context, cuBLAS workspace and driver allocations of an engine process.
#: The NAIRR GPU estimation guide gives 300 MB to 1 GB per process; llama.cpp's memory
#: breakdown shows 749 MiB "unaccounted" on one device (ggml-org/llama.cpp#27953).
CUDA_RUNTIME_MB = 768
#: Per GPU: llama.cpp's compute buffer with flash attention (llama-server's default
#: ``--flash-attn auto``).  Reported sizes: 105 MiB for a 7B at n_ctx 512
#: (mozilla-ai/llamafile#552's log), 22.6 MiB for SmolLM2-135M at 8192 on this project's
#: CPU backend, 1164 MiB for a hybrid model at 65536 (llama.cpp#27953); a budget above the
#: usual ones, and the least certain part of the estimate.
LLAMACPP_COMPUTE_MB = 512
#: llama.cpp's default micro-batch (``-ub``, 512 in ``llama-server --help``).
LLAMACPP_UBATCH = 512
#: Per GPU, inside vLLM's utilization budget: memory outside PyTorch's allocator plus the
#: activation peak of its profiling run: 1.79 GiB + 1.26 GiB for Llama-3-8B on an H100
#: (the profiling log in vllm-project/vllm#10511), rounded up.
VLLM_OVERHEAD_MB = 3 * 1024
#: Per GPU, inside SGLang's static fraction: the same budget (SGLang leaves activations and
#: CUDA graphs outside the fraction, so this only has to cover its own allocator slack).
SGLANG_OVERHEAD_MB = 1024
#: The engines' documented defaults: vLLM ``--gpu-memory-utilization``, SGLang
#: ``--mem-fraction-static``.
VLLM_DEFAULT_UTILIZATION = 0.9
SGLANG_DEFAULT_MEM_FRACTION = 0.9

FitVerdict = Literal["fits", "too_small", "no_room"]


@dataclass(frozen=True)
class EstimateRequest:
    """What a deployment asks of the engine: ``ctx`` in tokens (``None``: the engine's
    default), its ``extra_args`` (read for cache types, memory fractions, tensor
    parallelism and context flags) and how many GPUs it is split over."""

    engine: EngineName
    ctx: int | None = None
    extra_args: tuple[str, ...] = ()
    gpu_count: int = 1


@dataclass(frozen=True)
class VramEstimate:
    """The GPU memory one deployment needs, per GPU of the ``gpu_count`` it runs on.

    ``need_mb`` (weights + KV cache + overhead) is what the model needs; ``holds_fraction``
    is set for engines that take a fraction of each GPU's total instead (vLLM: the
    utilization; SGLang: the whole GPU), and ``budget_fraction`` is the fraction the model
    must fit inside (``budget_flag`` names the engine flag).  ``inputs`` are ``(name,
    value)`` pairs saying what the numbers came from; ``notes`` what the estimate leaves
    out or assumes.
    """

    engine: EngineName
    weights_mb: int
    kv_cache_mb: int
    overhead_mb: int
    gpu_count: int
    ctx: int
    cache_type: str
    budget_fraction: float | None
    budget_flag: str | None
    holds_fraction: float | None
    inputs: tuple[tuple[str, str], ...]
    notes: tuple[str, ...] = ()

    @property
    def need_mb(self) -> int:
        """Weights, KV cache and overhead: what the model needs on each GPU."""
        return self.weights_mb + self.kv_cache_mb + self.overhead_mb

    def holds_mb(self, gpu_total_mb: int) -> int:
        """What the deployment takes on a GPU of ``gpu_total_mb``: its need, or the engine's
        fraction of the whole GPU (vLLM, SGLang)."""
        if self.holds_fraction is None:
            return self.need_mb
        return math.ceil(self.holds_fraction * gpu_total_mb)

    def fit(self, gpu_total_mb: int, gpu_free_mb: int) -> tuple[FitVerdict, str]:
        """Whether the deployment fits a GPU with ``gpu_total_mb`` of which ``gpu_free_mb``
        are free, and a line saying why (not).

        ``too_small``: it could not fit even an empty GPU of that size; ``no_room``: it
        would fit once enough is freed.
        """
        need = self.need_mb
        if self.budget_fraction is not None:
            budget = math.floor(self.budget_fraction * gpu_total_mb)
            if need > budget:
                return "too_small", (
                    f"needs {mib(need)} inside {self.budget_flag} {self.budget_fraction:g} of "
                    f"{mib(gpu_total_mb)} = {mib(budget)}"
                )
        elif need > gpu_total_mb:
            return "too_small", f"needs {mib(need)}, more than the GPU's {mib(gpu_total_mb)}"
        holds = self.holds_mb(gpu_total_mb)
        if holds > gpu_free_mb:
            verb = "needs" if self.holds_fraction is None else "takes"
            return "no_room", f"{verb} {mib(holds)}, {mib(gpu_free_mb)} free"
        return "fits", f"takes {mib(holds)} of {mib(gpu_free_mb)} free"

    def summary(self) -> str:
        """One line: total and parts, e.g. ``1.4 GiB (weights 94 MiB + KV cache 180 MiB +
        overhead 1.2 GiB at ctx 8192, f16)``."""
        per_gpu = f" per GPU on {self.gpu_count} GPUs" if self.gpu_count > 1 else ""
        line = (
            f"{mib(self.need_mb)}{per_gpu} (weights {mib(self.weights_mb)} + KV cache "
            f"{mib(self.kv_cache_mb)} + overhead {mib(self.overhead_mb)} at ctx {self.ctx}, "
            f"{self.cache_type})"
        )
        if self.holds_fraction is not None:
            line += f"; takes {self.holds_fraction:g} of each GPU's memory"
        return line


def mib(value_mb: int) -> str:
    """``512 MiB``, ``1.52 GiB``, ``23.5 GiB``: a size in MiB for people."""
    if abs(value_mb) < 1024:
        return f"{value_mb} MiB"
    if abs(value_mb) < 10 * 1024:
        return f"{value_mb / 1024:.2f} GiB"
    return f"{value_mb / 1024:.1f} GiB"


def estimate_vram(shape: ModelShape, request: EstimateRequest) -> VramEstimate:
    """The VRAM ``request`` needs for the model of ``shape`` (see the module docstring).

    Raises :class:`~berth.errors.ConfigError` for a context that is not a positive number
    of tokens, an unknown cache type, and engine flags in ``extra_args`` whose values are
    not numbers.
    """
    flags = _Flags(request.extra_args)
    gpu_count = request.gpu_count
    if gpu_count < 1:
        raise ConfigError(f"a deployment runs on 1 GPU or more, not {gpu_count}")
    engine = request.engine
    if engine == "llamacpp":
        return _llamacpp(shape, request, flags)
    if engine == "vllm" or engine == "sglang":
        return _hf_engine(shape, request, flags)
    assert_never(engine)


def _context(
    shape: ModelShape, request: EstimateRequest, flags: _Flags, names: Sequence[str]
) -> tuple[int, str]:
    flagged = flags.integer(names)
    if request.ctx is not None:
        ctx, source = request.ctx, "asked (--ctx)"
    elif flagged is not None:
        ctx, source = flagged, f"asked ({names[0]} in the extra arguments)"
    elif shape.context_length is not None:
        ctx, source = shape.context_length, "the model's trained context"
    else:
        ctx, source = FALLBACK_CTX, "the model states none: berth's fallback"
    if ctx <= 0:
        raise ConfigError(f"the context must be a positive number of tokens, not {ctx}")
    return ctx, source


def kv_cache_bytes(shape: ModelShape, ctx: int, bytes_k: Fraction, bytes_v: Fraction) -> Fraction:
    """The KV cache of ``ctx`` tokens in bytes, with ``bytes_k``/``bytes_v`` per element:
    ``ctx * sum over layers of kv_heads * (key_length * bytes_k + value_length * bytes_v)``."""
    per_token = sum(
        heads * (shape.key_length * bytes_k + shape.value_length * bytes_v)
        for heads in shape.layer_kv_heads
    )
    return ctx * Fraction(per_token)


def _to_mib(value_bytes: Fraction | int) -> int:
    return math.ceil(Fraction(value_bytes) / MIB)


def _shape_inputs(shape: ModelShape) -> list[tuple[str, str]]:
    kv = str(shape.head_count_kv)
    if len(set(shape.layer_kv_heads)) > 1:
        kv = f"{min(shape.layer_kv_heads)}-{shape.head_count_kv} (per layer)"
    source = "GGUF header" if shape.format == "gguf" else "config.json"
    on = f" on node {shape.host}" if shape.host is not None else ""
    return [
        ("read from", f"{source}: {shape.source}{on}"),
        ("architecture", shape.architecture),
        ("layers", str(shape.block_count)),
        ("embedding length", str(shape.embedding_length)),
        ("attention heads", str(shape.head_count)),
        ("KV heads", kv),
        ("key/value length", f"{shape.key_length}/{shape.value_length}"),
        ("trained context", str(shape.context_length or "not stated")),
    ]


def _llamacpp(shape: ModelShape, request: EstimateRequest, flags: _Flags) -> VramEstimate:
    ctx, ctx_source = _context(shape, request, flags, ("-c", "--ctx-size"))
    type_k = flags.text(("-ctk", "--cache-type-k")) or "f16"
    type_v = flags.text(("-ctv", "--cache-type-v")) or "f16"
    for name in (type_k, type_v):
        if name not in LLAMACPP_CACHE_TYPES:
            valid = ", ".join(LLAMACPP_CACHE_TYPES)
            raise ConfigError(f"unknown llama.cpp cache type {name!r} (valid: {valid})")
    n = request.gpu_count
    kv = kv_cache_bytes(shape, ctx, LLAMACPP_CACHE_TYPES[type_k], LLAMACPP_CACHE_TYPES[type_v])
    overhead = CUDA_RUNTIME_MB + LLAMACPP_COMPUTE_MB
    notes = []
    flash = flags.text(("-fa", "--flash-attn"))
    if flash in ("off", "0", "false"):
        # Without flash attention the K·Q product is materialised: n_ctx * n_head *
        # n_ubatch * 4 bytes (ikawrakow/ik_llama.cpp#235).
        ubatch = flags.integer(("-ub", "--ubatch-size")) or LLAMACPP_UBATCH
        overhead += _to_mib(ctx * shape.head_count * ubatch * 4)
        notes.append("flash attention off: the K·Q product is counted in the overhead")
    if shape.context_length is not None and ctx > shape.context_length:
        notes.append(f"ctx {ctx} is beyond the model's trained context {shape.context_length}")
    cache = type_k if type_k == type_v else f"K {type_k}, V {type_v}"
    inputs = [
        *_shape_inputs(shape),
        ("weights", f"{_to_mib(shape.weights_bytes)} MiB: the GGUF file, every layer on GPU"),
        ("context", f"{ctx} ({ctx_source})"),
        ("cache type", f"{cache} (llama.cpp --cache-type-k/-v; default f16)"),
        ("overhead", f"CUDA runtime {CUDA_RUNTIME_MB} MiB + compute buffers "
                     f"{overhead - CUDA_RUNTIME_MB} MiB per GPU"),
    ]  # fmt: skip
    return VramEstimate(
        engine="llamacpp",
        weights_mb=_to_mib(Fraction(shape.weights_bytes, n)),
        kv_cache_mb=_to_mib(kv / n),
        overhead_mb=overhead,
        gpu_count=n,
        ctx=ctx,
        cache_type=cache,
        budget_fraction=None,
        budget_flag=None,
        holds_fraction=None,
        inputs=tuple(inputs),
        notes=tuple(notes),
    )


def _hf_engine(shape: ModelShape, request: EstimateRequest, flags: _Flags) -> VramEstimate:
    engine = request.engine
    if engine == "vllm":
        ctx_flags: tuple[str, ...] = ("--max-model-len",)
        fraction_flag, default_fraction = "--gpu-memory-utilization", VLLM_DEFAULT_UTILIZATION
        tp_flags: tuple[str, ...] = ("--tensor-parallel-size", "-tp")
        overhead = VLLM_OVERHEAD_MB
    else:
        ctx_flags = ("--context-length",)
        fraction_flag, default_fraction = "--mem-fraction-static", SGLANG_DEFAULT_MEM_FRACTION
        tp_flags = ("--tp", "--tp-size", "--tensor-parallel-size")
        overhead = SGLANG_OVERHEAD_MB
    ctx, ctx_source = _context(shape, request, flags, ctx_flags)
    fraction = flags.number((fraction_flag,))
    if fraction is None:
        fraction = default_fraction
    if not 0 < fraction <= 1:
        raise ConfigError(f"{fraction_flag} must be above 0 and at most 1, not {fraction:g}")
    cache = flags.text(("--kv-cache-dtype",)) or "auto"
    if cache not in HF_CACHE_TYPES:
        valid = ", ".join(HF_CACHE_TYPES)
        raise ConfigError(f"unknown {engine} --kv-cache-dtype {cache!r} (valid: {valid})")
    n = flags.integer(tp_flags) or request.gpu_count
    element = HF_CACHE_TYPES[cache]
    kv = kv_cache_bytes(shape, ctx, element, element)
    cache_name = f"{cache} ({shape.dtype or '16-bit'})" if cache == "auto" else cache
    holds = fraction if engine == "vllm" else 1.0
    notes = [
        f"{engine} takes {holds:g} of each GPU's total memory at start, whatever the model needs"
    ]
    if shape.context_length is not None and ctx > shape.context_length:
        notes.append(f"ctx {ctx} is beyond the model's max_position_embeddings")
    inputs = [
        *_shape_inputs(shape),
        ("weights", f"{_to_mib(shape.weights_bytes)} MiB: the weight files (safetensors)"),
        ("context", f"{ctx} ({ctx_source}; KV cache for one sequence of it)"),
        ("cache type", f"{cache_name} ({engine} --kv-cache-dtype)"),
        ("overhead", f"{overhead} MiB per GPU inside the fraction"),
        (fraction_flag, f"{fraction:g}"),
    ]
    return VramEstimate(
        engine=engine,
        weights_mb=_to_mib(Fraction(shape.weights_bytes, n)),
        kv_cache_mb=_to_mib(kv / n),
        overhead_mb=overhead,
        gpu_count=n,
        ctx=ctx,
        cache_type=cache_name,
        budget_fraction=fraction,
        budget_flag=fraction_flag,
        holds_fraction=holds,
        inputs=tuple(inputs),
        notes=tuple(notes),
    )


class _Flags:
    """The value of an engine flag in the extra arguments: ``--flag value`` or
    ``--flag=value``, the last one given winning (as argparse-style engines read them)."""

    def __init__(self, args: Sequence[str]) -> None:
        self._args = list(args)

    def text(self, names: Sequence[str]) -> str | None:
        found: str | None = None
        for at, arg in enumerate(self._args):
            for name in names:
                if arg == name and at + 1 < len(self._args):
                    found = self._args[at + 1]
                elif arg.startswith(name + "="):
                    found = arg[len(name) + 1 :]
        return found

    def integer(self, names: Sequence[str]) -> int | None:
        text = self.text(names)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{names[0]} takes a whole number, not {text!r}") from None

    def number(self, names: Sequence[str]) -> float | None:
        text = self.text(names)
        if text is None:
            return None
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{names[0]} takes a number, not {text!r}") from None
