"""What the VRAM estimate needs to know of a model: its weights' size and attention shape.

:class:`ModelShape` is a plain value, read from a GGUF header (:mod:`berth.placement.gguf`)
or an HF directory's ``config.json`` and weight files (:mod:`berth.placement.hf_config`);
:func:`berth.placement.model_files.read_model_shape` picks the reader by what the path is.
Those readers are the only code in ``placement`` that touches files; the estimate
(:mod:`berth.placement.estimate`) is pure over the shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ModelFormat = Literal["gguf", "hf"]


@dataclass(frozen=True)
class ModelShape:
    """A model's size and attention shape, as its files state them.

    ``weights_bytes``: the GGUF file's size, or the sum of an HF directory's weight files.
    ``block_count``: transformer layers.  ``layer_kv_heads``: the key/value heads of each
    layer (one entry per layer; grouped-query attention has fewer than ``head_count``; a
    layer without attention has 0).  ``key_length``/``value_length``: the size of one head's
    key and value vectors.  ``context_length``: the context the model was trained for
    (``None``: not stated).  ``dtype``: an HF model's ``torch_dtype`` (the KV cache's type
    when the engine is not told otherwise; ``None`` for GGUF, whose cache type is the
    engine's ``--cache-type-k/-v``).  ``source`` is the file the shape was read from, on
    the host of node ``host`` (a label; ``None``: the leader's own host).
    """

    format: ModelFormat
    architecture: str
    weights_bytes: int
    block_count: int
    embedding_length: int
    head_count: int
    layer_kv_heads: tuple[int, ...]
    key_length: int
    value_length: int
    context_length: int | None
    vocab_size: int | None
    dtype: str | None
    source: Path
    host: str | None = None

    @property
    def head_count_kv(self) -> int:
        """The most key/value heads any layer has."""
        return max(self.layer_kv_heads, default=0)
