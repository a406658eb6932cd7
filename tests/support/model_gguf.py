"""Small GGUF models for placement tests: a header with the keys the VRAM estimate reads (a
SmolLM2-135M-like llama: 30 layers, 9 heads, 3 KV heads, 8192 trained context), written
with the ``gguf`` package from PyPI, and a sparse tail so the file has the weights' size
without their bytes."""

from __future__ import annotations

from pathlib import Path

import gguf

#: SmolLM2-135M's file size (bytes), so the estimate's weights match the real model's.
WEIGHTS_BYTES = 100_000_000


def write_model_gguf(path: Path, *, size_bytes: int = WEIGHTS_BYTES, context: int = 8192) -> Path:
    """A llama GGUF at ``path`` whose header berth reads, ``size_bytes`` long (sparse)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(30)
    writer.add_context_length(context)
    writer.add_embedding_length(576)
    writer.add_head_count(9)
    writer.add_head_count_kv(3)
    writer.add_vocab_size(49152)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with path.open("r+b") as file:
        file.truncate(size_bytes)
    return path
