"""GGUF LoRA adapters made for a given base model, as llama.cpp's ``convert_lora_to_gguf.py``
lays them out (``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``,
and for each adapted weight ``W`` a pair ``W.lora_a`` (ggml ``ne = [W.ne[0], r]``) and
``W.lora_b`` (``ne = [r, W.ne[1]]``)), written with the ``gguf`` package from PyPI.

Zero deltas leave the base's answers exactly as they are; random ones change them.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from berth.weights.gguf_file import read_gguf_header


def write_lora_gguf(
    base: Path,
    out: Path,
    *,
    rank: int = 8,
    modules: tuple[str, ...] = ("attn_q", "attn_v"),
    scale: float = 0.0,
    seed: int = 0,
    architecture: str | None = None,
) -> Path:
    """A LoRA GGUF at ``out`` for every layer's ``modules`` of the GGUF model ``base``.

    ``scale`` is the standard deviation of the deltas' entries (0: all zero); ``architecture``
    overrides the base's ``general.architecture`` (to make one that does not fit).
    """
    header = read_gguf_header(base)
    arch = architecture or header.text("general.architecture") or "llama"
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for name, tensor in sorted(header.tensors.items()):
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in modules:
            continue
        n_in, n_out = tensor.shape[0], tensor.shape[1]
        # numpy shapes are ggml's ne reversed
        a = rng.normal(0.0, scale, (rank, n_in)) if scale else np.zeros((rank, n_in))
        b = rng.normal(0.0, scale, (n_out, rank)) if scale else np.zeros((n_out, rank))
        writer.add_tensor(f"{name}.lora_a", a.astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", b.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
