"""Which GGUF file of a model llama.cpp loads: the file itself, or the one model file in a
folder (multimodal projectors aside), or the first shard of a split model."""

from __future__ import annotations

import re
from pathlib import Path

from berth.errors import ConfigError

#: The shard suffix of a split GGUF model (``gguf-split``'s naming): ``-00001-of-00003.gguf``.
_GGUF_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def resolve_gguf(model_path: Path) -> Path:
    """The GGUF file llama.cpp should load for ``model_path``.

    A file is returned as is.  In a directory, multimodal projector files (``mmproj*``) are
    ignored; the one remaining ``.gguf`` is chosen, or the first shard (``-00001-of-N``) when
    all remaining files are shards of one split model (llama.cpp loads the rest itself).

    Raises :class:`~berth.errors.ConfigError` when the directory holds no GGUF, or several
    that are not shards of one model.
    """
    if not model_path.is_dir():
        return model_path
    candidates = sorted(
        entry
        for entry in model_path.iterdir()
        if entry.is_file()
        and entry.name.lower().endswith(".gguf")
        and not entry.name.lower().startswith("mmproj")
    )
    if not candidates:
        raise ConfigError(f"no .gguf file in {model_path}", path=model_path)
    if len(candidates) == 1:
        return candidates[0]
    first_shard = _first_shard_of_one_model(candidates)
    if first_shard is not None:
        return first_shard
    names = ", ".join(entry.name for entry in candidates)
    raise ConfigError(
        f"several .gguf files in {model_path} ({names}): pass the file to use",
        path=model_path,
    )


def _first_shard_of_one_model(files: list[Path]) -> Path | None:
    stems: set[tuple[str, str]] = set()
    first: Path | None = None
    for entry in files:
        match = _GGUF_SHARD.search(entry.name)
        if match is None:
            return None
        stems.add((entry.name[: match.start()], match.group(2)))
        if int(match.group(1)) == 1:
            first = entry
    return first if len(stems) == 1 else None
