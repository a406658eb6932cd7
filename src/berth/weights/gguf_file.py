"""Reading a GGUF file's header: its metadata and the shapes of its tensors (no tensor data).

The layout is the GGUF specification (``docs/gguf.md`` in ggml-org/ggml): ``magic "GGUF"``,
``uint32 version``, ``uint64 tensor_count``, ``uint64 metadata_kv_count``; then each key/value
pair (a string key, a ``uint32`` value type, the value); then each tensor's info (a string
name, ``uint32 n_dims``, ``n_dims`` ``uint64`` dimensions, ``uint32`` type, ``uint64``
offset). Strings are a ``uint64`` length and UTF-8 bytes. Value types: 0 uint8, 1 int8,
2 uint16, 3 int16, 4 uint32, 5 int32, 6 float32, 7 bool, 8 string, 9 array (``uint32``
element type, ``uint64`` count, elements), 10 uint64, 11 int64, 12 float64. Dimensions are
listed innermost first (``ne[0]`` is a row's length), as ggml numbers them.

Scalars and strings are kept from the metadata, and the integer arrays a caller asks for by
key (placement's ``head_count_kv`` per layer); other arrays (a tokenizer's 150k strings) are
stepped over and only their length kept, so a model's header costs one buffered pass over a
few MiB. Versions 2 and 3 are read (version 1 counted in ``uint32``; llama.cpp dropped it); a
version-3 file may be big-endian, which the version field gives away.

The one GGUF reader of berth: the adapter checks (:mod:`berth.weights.adapter_files`), the
pull's kind check and placement's model shape (:mod:`berth.placement.gguf`) all read here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from berth.errors import ConfigError

MAGIC = b"GGUF"
#: The versions read here: 2 (uint64 counts) and 3 (big-endian files allowed).
VERSIONS = (2, 3)
#: Bounds that keep a malformed header from making the reader allocate or loop for long.
MAX_KEY_BYTES = 65_536
MAX_STRING_BYTES = 1 << 20
MAX_METADATA_KVS = 1 << 20
MAX_ARRAY_ELEMENTS = 1 << 28
MAX_TENSORS = 1 << 24
MAX_DIMS = 8

_STRING, _ARRAY = 8, 9
#: struct codes of the fixed-size value types
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

Value = int | float | bool | str | tuple[int, ...]
#: Says which arrays' integers to keep, by key.
KeyFilter = Callable[[str], bool]


class GgufError(ConfigError):
    """A GGUF header that cannot be read: not GGUF, a version not read here, truncated or
    malformed. ``why`` is the reason without the file; ``path`` names the file."""

    def __init__(self, why: str, *, path: Path) -> None:
        self.why = why
        super().__init__(why, path=path)


@dataclass(frozen=True)
class GgufTensor:
    """One tensor's info: ``shape`` is ggml's ``ne`` (innermost dimension first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF header says: scalar and string metadata by key (and the integer arrays
    asked for, as tuples), the length of every array in ``array_lengths``, and every
    tensor's info by name (empty when the tensors were not read)."""

    version: int
    tensor_count: int
    metadata: dict[str, Value]
    array_lengths: dict[str, int]
    tensors: dict[str, GgufTensor] = field(default_factory=dict)

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


def read_gguf_header(
    path: Path, *, keep_arrays: KeyFilter | None = None, tensors: bool = True
) -> GgufHeader:
    """The metadata (and, with ``tensors``, the tensor infos) of the GGUF file at ``path``.

    Raises :class:`GgufError` naming the file when it cannot be read, is not GGUF, is of a
    version not read here, or is truncated or malformed.
    """
    try:
        with path.open("rb") as file:
            return parse_gguf_header(file, path, keep_arrays=keep_arrays, tensors=tensors)
    except OSError as exc:
        raise GgufError(f"cannot read the GGUF header: {exc.strerror or exc}", path=path) from None


def parse_gguf_header(
    file: BinaryIO, path: Path, *, keep_arrays: KeyFilter | None = None, tensors: bool = True
) -> GgufHeader:
    """Parse the header of the GGUF file open as ``file`` (positioned at its start).

    Integer arrays whose key ``keep_arrays(key)`` accepts are kept as tuples; other arrays
    are skipped (only their length is kept). Without ``tensors`` the tensor infos are not
    read (a file may end after its metadata). Raises :class:`GgufError` (naming ``path``)
    for a wrong magic, an unsupported version, a truncated or malformed header.
    """
    reader = _Reader(file, path)
    if file.read(4) != MAGIC:
        raise GgufError("not a GGUF file (its first bytes are not 'GGUF')", path=path)
    raw_version = reader.take(4)
    version = struct.unpack("<I", raw_version)[0]
    if version not in VERSIONS and struct.unpack(">I", raw_version)[0] in VERSIONS:
        reader.order = ">"  # version 3 allows big-endian files
        version = struct.unpack(">I", raw_version)[0]
    if version not in VERSIONS:
        raise GgufError(
            f"GGUF version {version} is not supported (versions 2 and 3 are)", path=path
        )
    tensor_count = reader.unpack("Q")
    kv_count = reader.unpack("Q")
    if kv_count > MAX_METADATA_KVS:
        raise GgufError(f"the GGUF header claims {kv_count} metadata keys", path=path)
    metadata: dict[str, Value] = {}
    lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key = reader.string(MAX_KEY_BYTES, what="a metadata key")
        kind = reader.unpack("I")
        if kind == _ARRAY:
            element = reader.unpack("I")
            count = reader.unpack("Q")
            if count > MAX_ARRAY_ELEMENTS:
                raise GgufError(f"{key}: an array of {count} elements", path=path)
            lengths[key] = count
            if keep_arrays is not None and keep_arrays(key) and element in _FIXED:
                metadata[key] = reader.integers(element, count, key)
            else:
                reader.skip_array(element, count, key)
        elif kind == _STRING:
            metadata[key] = reader.string(MAX_STRING_BYTES, what=key)
        elif kind in _FIXED:
            metadata[key] = struct.unpack(
                reader.order + _FIXED[kind], reader.take(struct.calcsize(_FIXED[kind]))
            )[0]
        else:
            raise GgufError(f"{key}: unknown GGUF value type {kind}", path=path)
    infos = _read_tensors(reader, tensor_count, path) if tensors else {}
    return GgufHeader(version, tensor_count, metadata, lengths, infos)


def _read_tensors(reader: _Reader, count: int, path: Path) -> dict[str, GgufTensor]:
    if count > MAX_TENSORS:
        raise GgufError(f"the GGUF header claims {count} tensors", path=path)
    tensors: dict[str, GgufTensor] = {}
    for _ in range(count):
        name = reader.string(MAX_STRING_BYTES, what="a tensor name")
        dims = reader.unpack("I")
        if dims > MAX_DIMS:
            raise GgufError(f"tensor {name!r} has {dims} dimensions", path=path)
        shape = tuple(reader.unpack("Q") for _ in range(dims))
        ggml_type = reader.unpack("I")
        reader.unpack("Q")  # the offset of its data
        tensors[name] = GgufTensor(name, shape, ggml_type)
    return tensors


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
                raise GgufError("the GGUF header is truncated", path=self._path)
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
        value: int = struct.unpack(self.order + code, self.take(struct.calcsize(code)))[0]
        return value

    def string(self, limit: int, *, what: str) -> str:
        size = self.unpack("Q")
        if size > limit:
            raise GgufError(f"{what} is {size} bytes long", path=self._path)
        try:
            return self.take(size).decode("utf-8")
        except UnicodeDecodeError:
            raise GgufError(f"{what} is not UTF-8", path=self._path) from None

    def integers(self, element: int, count: int, key: str) -> tuple[int, ...]:
        code = _FIXED[element]
        if code in "f?d":
            raise GgufError(f"{key}: expected integers", path=self._path)
        data = self.take(struct.calcsize(code) * count)
        return tuple(struct.unpack(f"{self.order}{count}{code}", data))

    def skip_array(self, element: int, count: int, key: str) -> None:
        if element in _FIXED:
            self.skip(struct.calcsize(_FIXED[element]) * count)
        elif element == _STRING:
            for _ in range(count):
                size = self.unpack("Q")
                if size > MAX_STRING_BYTES:
                    raise GgufError(f"{key}: a string of {size} bytes", path=self._path)
                self.skip(size)
        else:
            # Nested arrays are allowed by the spec but used by no model berth knows.
            raise GgufError(f"{key}: an array of value type {element}", path=self._path)
