"""A GGUF model's shape: the header values the VRAM estimate needs, nothing else.

The header is read by berth's one GGUF reader (:mod:`berth.weights.gguf_file`, which
describes the format); its errors become :class:`ModelFileError` here, message unchanged.
The keys read are the spec's "LLM" keys, prefixed by ``general.architecture`` (``llama``,
``qwen2``, ...): ``{arch}.block_count``, ``.embedding_length``, ``.context_length``,
``.attention.head_count``, ``.attention.head_count_kv`` (a number, or an array with one
entry per layer), ``.attention.key_length`` and ``.attention.value_length`` (both default
to ``embedding_length / head_count``, as llama.cpp does), ``.vocab_size`` (else the length
of ``tokenizer.ggml.tokens``), and ``split.count`` for a model split over several files.
"""

from __future__ import annotations

import re
from pathlib import Path

from berth.placement.errors import ModelFileError
from berth.placement.shape import ModelShape
from berth.weights.gguf_file import GgufError, GgufHeader, read_gguf_header

_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def read_gguf_shape(path: Path, *, weights_bytes: int | None = None) -> ModelShape:
    """The :class:`ModelShape` of the GGUF file at ``path``.

    ``weights_bytes`` is the size of the weights (default: this file's size, plus its
    sibling parts when the header says the model is split, named as ``gguf-split`` names
    them: ``NAME-00001-of-00003.gguf``).  Raises :class:`ModelFileError` for a file that is
    not GGUF, is truncated or malformed, or lacks a key the estimate needs.
    """
    try:
        header = read_gguf_header(path, keep_arrays=_kv_head_keys, tensors=False)
        size = path.stat().st_size
    except GgufError as exc:
        raise ModelFileError(exc.why, path=path) from None
    except OSError as exc:
        raise ModelFileError(f"cannot read the GGUF header: {exc.strerror}", path=path) from None
    if weights_bytes is None:
        weights_bytes = size + _other_split_parts_bytes(path, header)
    return shape_from_header(header, path, weights_bytes=weights_bytes)


def _kv_head_keys(key: str) -> bool:
    return key.endswith(".attention.head_count_kv")


def _other_split_parts_bytes(path: Path, header: GgufHeader) -> int:
    count = header.metadata.get("split.count")
    named = _SPLIT_NAME.match(path.name)
    if not isinstance(count, int) or count <= 1 or named is None:
        return 0
    total = 0
    for number in range(1, count + 1):
        part = path.with_name(f"{named['prefix']}-{number:05d}-of-{named['count']}.gguf")
        if part != path and part.is_file():
            total += part.stat().st_size
    return total


def shape_from_header(header: GgufHeader, path: Path, *, weights_bytes: int) -> ModelShape:
    """The estimate's inputs from a parsed header (``path`` names it in errors)."""
    values = header.metadata
    arch = values.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError("the GGUF header has no general.architecture", path=path)

    def number(key: str, *, required: bool = True) -> int | None:
        found = values.get(f"{arch}.{key}")
        if found is None and not required:
            return None
        if isinstance(found, bool) or not isinstance(found, int) or found < 0:
            raise ModelFileError(
                f"the GGUF header has no usable {arch}.{key} (found {found!r})", path=path
            )
        return found

    blocks = number("block_count")
    embedding = number("embedding_length")
    heads = number("attention.head_count")
    assert blocks is not None and embedding is not None and heads is not None
    if heads == 0 or blocks == 0:
        raise ModelFileError(f"{arch}.block_count and head_count must be above 0", path=path)
    per_layer = values.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(per_layer, tuple):
        if len(per_layer) != blocks:
            raise ModelFileError(
                f"{arch}.attention.head_count_kv lists {len(per_layer)} layers, not {blocks}",
                path=path,
            )
        layer_kv_heads = per_layer
    elif isinstance(per_layer, int) and not isinstance(per_layer, bool):
        layer_kv_heads = (per_layer,) * blocks
    else:
        raise ModelFileError(f"{arch}.attention.head_count_kv is {per_layer!r}", path=path)
    # llama.cpp: n_embd_head_k = key_length if given, else n_embd / n_head (same for v).
    key_length = number("attention.key_length", required=False) or embedding // heads
    value_length = number("attention.value_length", required=False) or embedding // heads
    vocab = number("vocab_size", required=False)
    if vocab is None:
        vocab = header.array_lengths.get("tokenizer.ggml.tokens")
    return ModelShape(
        format="gguf",
        architecture=arch,
        weights_bytes=weights_bytes,
        block_count=blocks,
        embedding_length=embedding,
        head_count=heads,
        layer_kv_heads=layer_kv_heads,
        key_length=key_length,
        value_length=value_length,
        context_length=number("context_length", required=False),
        vocab_size=vocab,
        dtype=None,
        source=path,
    )
