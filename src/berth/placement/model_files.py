"""Reading a model's shape from its files: the one entry point, by what the path is.

Blocking file I/O (a GGUF header is a few MiB at most, a ``config.json`` a few KiB); async
callers run it with ``asyncio.to_thread``.
"""

from __future__ import annotations

from pathlib import Path

from berth.placement.errors import ModelFileError
from berth.placement.gguf import read_gguf_shape
from berth.placement.hf_config import read_hf_shape
from berth.placement.shape import ModelShape


def read_model_shape(path: Path) -> ModelShape:
    """The shape of the model at ``path``: a ``.gguf`` file (its header), or a directory
    with a ``config.json`` (the HF layout vLLM and SGLang load) or with GGUF files (a split
    model: the first part's header, every part's size).

    Raises :class:`ModelFileError` when nothing there can be read.
    """
    if path.is_dir():
        if (path / "config.json").is_file():
            return read_hf_shape(path)
        parts = sorted(path.glob("*.gguf"))
        if parts:
            return read_gguf_shape(parts[0], weights_bytes=sum(p.stat().st_size for p in parts))
        raise ModelFileError("no config.json and no .gguf file in the model folder", path=path)
    if path.is_file():
        return read_gguf_shape(path)
    raise ModelFileError("the model's path does not exist on the leader's host", path=path)
