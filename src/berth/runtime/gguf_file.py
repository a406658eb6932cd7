"""Reading a GGUF file's header: its metadata and the shapes of its tensors (no tensor data).

The layout is the GGUF specification (``docs/gguf.md`` in ggml-org/ggml): ``magic "GGUF"``,
``uint32 version``, ``uint64 tensor_count``, ``uint64 metadata_kv_count``; then each key/value
pair (a string key, a ``uint32`` value type, the value); then each tensor's info (a string
name, ``uint32 n_dims``, ``n_dims`` ``uint64`` dimensions, ``uint32`` type, ``uint64``
offset). Strings are a ``uint64`` length and UTF-8 bytes. Value types: 0 uint8, 1 int8,
2 uint16, 3 int16, 4 uint32, 5 int32, 6 float32, 7 bool, 8 string, 9 array (``uint32``
element type, ``uint64`` count, elements), 10 uint64, 11 int64, 12 float64. Dimensions are
listed innermost first (``ne[0]`` is a row's length), as ggml numbers them.

Only scalars and strings are kept from the metadata; arrays (a tokenizer's 150k strings)
are stepped over and only their length kept, so a model's header costs one pass over a few
MiB. Versions 2 and 3 are read (version 1 counted in ``uint32``; llama.cpp dropped it); a
version-3 file may be big-endian, which the version field gives away.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from berth.errors import ConfigError

MAGIC = b"GGUF"
#: Bounds that keep a malformed header from making the reader allocate or loop for long.
MAX_STRING_BYTES = 1 << 20
MAX_ENTRIES = 1 << 24
MAX_DIMS = 8

_STRING, _ARRAY = 8, 9
#: struct codes of the fixed-size value types
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

Value = int | float | bool | str


@dataclass(frozen=True)
class GgufTensor:
    """One tensor's info: ``shape`` is ggml's ``ne`` (innermost dimension first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF header says: scalar and string metadata by key, the length of each array
    kept under its key in ``array_lengths``, and every tensor's info by name."""

    version: int
    metadata: dict[str, Value]
    array_lengths: dict[str, int]
    tensors: dict[str, GgufTensor]

    def text(self, key: str) -> str | None:
        """The string value at ``key``; ``None`` when absent or not a string."""
        found = self.metadata.get(key)
        return found if isinstance(found, str) else None


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:
        with path.open("rb") as file:
            return file.read(4) == MAGIC
    except OSError:
        return False


def read_gguf_header(path: Path) -> GgufHeader:
    """The metadata and tensor infos of the GGUF file at ``path``.

    Raises :class:`~berth.errors.ConfigError` naming the file when it cannot be read, is
    not GGUF, is of a version not read here, or is truncated or malformed.
    """
    try:
        with path.open("rb") as file:
            return _Reader(file, path).header()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


class _Reader:
    def __init__(self, file: BinaryIO, path: Path) -> None:
        self._file = file
        self._path = path
        self._order = "<"

    def header(self) -> GgufHeader:
        if self._file.read(4) != MAGIC:
            raise ConfigError(f"{self._path} is not a GGUF file")
        raw_version = self._take(4)
        version = struct.unpack("<I", raw_version)[0]
        if version not in (2, 3):
            swapped = struct.unpack(">I", raw_version)[0]
            if swapped == 3:
                self._order, version = ">", 3
            else:
                raise ConfigError(
                    f"{self._path}: GGUF version {version} is not supported (2 and 3 are)"
                )
        tensor_count = self._count()
        kv_count = self._count()
        metadata: dict[str, Value] = {}
        lengths: dict[str, int] = {}
        for _ in range(kv_count):
            key = self._string()
            kind = self._unpack("I")
            if kind == _ARRAY:
                lengths[key] = self._skip_array()
            else:
                metadata[key] = self._value(kind)
        tensors: dict[str, GgufTensor] = {}
        for _ in range(tensor_count):
            name = self._string()
            dims = self._unpack("I")
            if dims > MAX_DIMS:
                raise self._malformed(f"tensor {name!r} has {dims} dimensions")
            shape = tuple(self._unpack("Q") for _ in range(dims))
            ggml_type = self._unpack("I")
            self._unpack("Q")  # the offset of its data
            tensors[name] = GgufTensor(name, shape, ggml_type)
        return GgufHeader(version, metadata, lengths, tensors)

    def _malformed(self, why: str) -> ConfigError:
        return ConfigError(f"{self._path}: malformed GGUF header ({why})")

    def _take(self, size: int) -> bytes:
        data = self._file.read(size)
        if len(data) != size:
            raise self._malformed("the file ends inside its header")
        return data

    def _unpack(self, code: str) -> int:
        value: int = struct.unpack(self._order + code, self._take(struct.calcsize(code)))[0]
        return value

    def _count(self) -> int:
        count = self._unpack("Q")
        if count > MAX_ENTRIES:
            raise self._malformed(f"a count of {count}")
        return count

    def _string(self) -> str:
        size = self._unpack("Q")
        if size > MAX_STRING_BYTES:
            raise self._malformed(f"a string of {size} bytes")
        try:
            return self._take(size).decode("utf-8")
        except UnicodeDecodeError:
            raise self._malformed("a string that is not UTF-8") from None

    def _value(self, kind: int) -> Value:
        if kind == _STRING:
            return self._string()
        code = _FIXED.get(kind)
        if code is None:
            raise self._malformed(f"value type {kind}")
        value: Value = struct.unpack(self._order + code, self._take(struct.calcsize(code)))[0]
        return value

    def _skip_array(self) -> int:
        kind = self._unpack("I")
        count = self._count()
        if kind == _STRING:
            for _ in range(count):
                size = self._unpack("Q")
                if size > MAX_STRING_BYTES:
                    raise self._malformed(f"a string of {size} bytes")
                self._file.seek(size, 1)
        elif kind in _FIXED:
            self._file.seek(count * struct.calcsize(_FIXED[kind]), 1)
        else:
            raise self._malformed(f"an array of value type {kind}")
        return count
