"""A small GGUF header reader: the metadata the VRAM estimate needs, nothing else.

The format is the GGUF specification (``docs/gguf.md`` in ggml-org/ggml): a little-endian
(or, from version 3, big-endian) header ``magic "GGUF", uint32 version, uint64
tensor_count, uint64 metadata_kv_count``, then the key/value pairs, each a string key (uint64
length + UTF-8 bytes), a uint32 value type and the value.  Value types: 0 uint8, 1 int8,
2 uint16, 3 int16, 4 uint32, 5 int32, 6 float32, 7 bool, 8 string, 9 array (uint32 element
type, uint64 count, elements), 10 uint64, 11 int64, 12 float64.  Version 1 counted in uint32
and is not read here (llama.cpp itself dropped it).

The keys read are the spec's "LLM" keys, prefixed by ``general.architecture`` (``llama``,
``qwen2``, ...): ``{arch}.block_count``, ``.embedding_length``, ``.context_length``,
``.attention.head_count``, ``.attention.head_count_kv`` (a number, or an array with one
entry per layer), ``.attention.key_length`` and ``.attention.value_length`` (both default
to ``embedding_length / head_count``, as llama.cpp does), ``.vocab_size`` (else the length
of ``tokenizer.ggml.tokens``), and ``split.count`` for a model split over several files.

Everything else is skipped without being kept: the tokenizer's arrays (150k strings for
recent vocabularies) are stepped over string by string, so a header costs one pass over a
few MiB and no memory beyond the values kept.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from berth.placement.errors import ModelFileError
from berth.placement.shape import ModelShape

MAGIC = b"GGUF"
#: The versions read here: 2 (uint64 counts) and 3 (big-endian files allowed).
VERSIONS = (2, 3)
#: Bounds that keep a malformed header from making the reader allocate or loop for long.
MAX_KEY_BYTES = 65_536
MAX_KEPT_STRING_BYTES = 1 << 20
MAX_METADATA_KVS = 1 << 20
MAX_ARRAY_ELEMENTS = 1 << 28

_STRING, _ARRAY = 8, 9
#: struct codes of the fixed-size value types
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

Value = int | float | bool | str | tuple[int, ...]
#: Says which arrays' integers to keep, by key.
KeyFilter = Callable[[str], bool]


@dataclass(frozen=True)
class GgufHeader:
    """The metadata kept from a header: scalars and strings by key, integer arrays only
    for the keys asked for, and the length of every array (``array_lengths``)."""

    version: int
    tensor_count: int
    values: dict[str, Value]
    array_lengths: dict[str, int]


def read_gguf_shape(path: Path, *, weights_bytes: int | None = None) -> ModelShape:
    """The :class:`ModelShape` of the GGUF file at ``path``.

    ``weights_bytes`` is the size of the weights (default: this file's size, plus its
    sibling parts when the header says the model is split, named as ``gguf-split`` names
    them: ``NAME-00001-of-00003.gguf``).  Raises :class:`ModelFileError` for a file that is
    not GGUF, is truncated or malformed, or lacks a key the estimate needs.
    """
    try:
        with path.open("rb") as file:
            header = read_gguf_header(file, path, keep_arrays=_kv_head_keys)
        size = path.stat().st_size
    except OSError as exc:
        raise ModelFileError(f"cannot read the GGUF header: {exc.strerror}", path=path) from None
    if weights_bytes is None:
        weights_bytes = size + _other_split_parts_bytes(path, header)
    return shape_from_header(header, path, weights_bytes=weights_bytes)


def _kv_head_keys(key: str) -> bool:
    return key.endswith(".attention.head_count_kv")


def _other_split_parts_bytes(path: Path, header: GgufHeader) -> int:
    count = header.values.get("split.count")
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
    values = header.values
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


def read_gguf_header(
    file: BinaryIO, path: Path, *, keep_arrays: KeyFilter | None = None
) -> GgufHeader:
    """Parse the metadata of the GGUF file open as ``file`` (positioned at its start).

    Integer arrays whose key ``keep_arrays(key)`` accepts are kept as tuples; other arrays
    are skipped (only their length is kept).  Raises :class:`ModelFileError` (naming
    ``path``) for a wrong magic, an unsupported version, a truncated or malformed header.
    """
    reader = _Reader(file, path)
    magic = file.read(4)
    if magic != MAGIC:
        raise ModelFileError("not a GGUF file (its first bytes are not 'GGUF')", path=path)
    raw_version = reader.take(4)  # after the magic, read by hand above
    order = "<"
    version = struct.unpack("<I", raw_version)[0]
    if version not in VERSIONS and struct.unpack(">I", raw_version)[0] in VERSIONS:
        order = ">"  # version 3 allows big-endian files
        version = struct.unpack(">I", raw_version)[0]
    if version not in VERSIONS:
        raise ModelFileError(
            f"GGUF version {version} is not supported (versions 2 and 3 are)", path=path
        )
    reader.order = order
    tensor_count = reader.unpack("Q")
    kv_count = reader.unpack("Q")
    if kv_count > MAX_METADATA_KVS:
        raise ModelFileError(f"the GGUF header claims {kv_count} metadata keys", path=path)
    values: dict[str, Value] = {}
    lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key = reader.string(MAX_KEY_BYTES, what="a metadata key")
        kind = reader.unpack("I")
        if kind == _ARRAY:
            element = reader.unpack("I")
            count = reader.unpack("Q")
            if count > MAX_ARRAY_ELEMENTS:
                raise ModelFileError(f"{key}: an array of {count} elements", path=path)
            lengths[key] = count
            if keep_arrays is not None and keep_arrays(key) and element in _FIXED:
                values[key] = reader.integers(element, count, key)
            else:
                reader.skip_array(element, count, key)
        elif kind == _STRING:
            text = reader.string(MAX_KEPT_STRING_BYTES, what=key)
            values[key] = text
        elif kind in _FIXED:
            values[key] = reader.unpack(_FIXED[kind])
        else:
            raise ModelFileError(f"{key}: unknown GGUF value type {kind}", path=path)
    return GgufHeader(version, tensor_count, values, lengths)


class _Reader:
    """Buffered reads over the header, with the file's byte order; a short read is a
    truncated header."""

    CHUNK = 1 << 20

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self._file = file
        self._path = path
        self._buffer = b""
        self._at = 0
        self.order = "<"

    def take(self, size: int) -> bytes:
        if self._at + size > len(self._buffer):
            rest = self._buffer[self._at :]
            more = self._file.read(max(size - len(rest), self.CHUNK))
            self._buffer, self._at = rest + more, 0
            if size > len(self._buffer):
                raise ModelFileError("the GGUF header is truncated", path=self._path)
        data = self._buffer[self._at : self._at + size]
        self._at += size
        return data

    def skip(self, size: int) -> None:
        left = len(self._buffer) - self._at
        if size <= left:
            self._at += size
            return
        # Past the buffer: seek rather than read (a long array need not be in memory).
        self._file.seek(size - left, 1)
        self._buffer, self._at = b"", 0

    def unpack(self, code: str) -> int:
        value = struct.unpack(self.order + code, self.take(struct.calcsize(code)))[0]
        return value  # type: ignore[no-any-return]

    def string(self, limit: int, *, what: str) -> str:
        size = self.unpack("Q")
        if size > limit:
            raise ModelFileError(f"{what} is {size} bytes long", path=self._path)
        try:
            return self.take(size).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{what} is not UTF-8", path=self._path) from None

    def integers(self, element: int, count: int, key: str) -> tuple[int, ...]:
        code = _FIXED[element]
        if code in "f?d":
            raise ModelFileError(f"{key}: expected integers", path=self._path)
        data = self.take(struct.calcsize(code) * count)
        return tuple(struct.unpack(f"{self.order}{count}{code}", data))

    def skip_array(self, element: int, count: int, key: str) -> None:
        if element in _FIXED:
            self.skip(struct.calcsize(_FIXED[element]) * count)
        elif element == _STRING:
            for _ in range(count):
                self.skip(self.unpack("Q"))
        else:
            # Nested arrays are allowed by the spec but used by no model berth knows.
            raise ModelFileError(f"{key}: an array of value type {element}", path=self._path)
