"""How many requests an engine decodes at once (its *slots*), read from the arguments it is
started with.  Pure: no I/O.

Each engine sets it with a flag, which a service or a deployment gives in its engine
arguments (``berth service create ... -- --parallel 2``):

=========  ===============================  =====================================================
engine     flag                             without it (each caller picks its own default)
=========  ===============================  =====================================================
llamacpp   ``-np N`` / ``--parallel N``     ``-1``, "auto" (``llama-server --help`` of the bundled
                                            build: "number of server slots (default: -1, -1 =
                                            auto)"); auto gives 4 slots (its log: "n_parallel is
                                            set to auto, using n_parallel = 4")
vllm       ``--max-num-seqs N``             a default that depends on the vLLM version and GPU
sglang     ``--max-running-requests N``     sized from free memory when SGLang starts
=========  ===============================  =====================================================

:func:`engine_slots` returns ``None`` for every "without it" case; the callers assume the
same numbers instead: :data:`LLAMACPP_AUTO_SLOTS` for llama.cpp, :data:`VLLM_DEFAULT_SLOTS`
for vLLM, and :data:`ASSUMED_SLOTS` where the engine decides at start or is not known (an
adopted endpoint): the fair admission gate (:mod:`berth.admission.capacity`, where the
``default_slots`` setting replaces :data:`ASSUMED_SLOTS`) and scaling
(:mod:`berth.scaling.capacity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

#: The flags that set an engine's slots, by berth's engine name.
SLOT_FLAGS: Final[dict[str, tuple[str, ...]]] = {
    "llamacpp": ("-np", "--parallel"),
    "vllm": ("--max-num-seqs",),
    "sglang": ("--max-running-requests",),
}
#: llama-server's slots when ``--parallel`` is left at ``-1`` ("auto"), as its log says.
LLAMACPP_AUTO_SLOTS: Final = 4
#: vLLM's ``--max-num-seqs`` default (its engine arguments; newer versions raise it to 1024 on
#: the largest GPUs, so this is the least a vLLM engine without the flag runs at once).
VLLM_DEFAULT_SLOTS: Final = 256
#: Slots assumed for an engine whose count nothing says: SGLang without
#: ``--max-running-requests`` (it sizes its batch from free memory at start), an adopted
#: endpoint, an argument that does not parse.  8 keeps the leader's fair queue in front of a
#: small engine (llama.cpp runs 4 by default, Ollama 1 to 4) without cutting a large one to
#: a trickle; the ``default_slots`` setting changes it at the gate.
ASSUMED_SLOTS: Final = 8


def engine_slots(engine: str, args: Sequence[str]) -> int | None:
    """The slots an ``engine`` (berth's name: ``llamacpp``, ``vllm``, ``sglang``) started with
    the extra arguments ``args`` has, when ``args`` say: the value of its flag (see the module
    doc).  ``N`` may follow the flag or be joined to it with ``=``; the last one given wins,
    as in the engines' own argument parsers.

    ``None`` when ``args`` do not say: another engine, no flag, or a value that is not a
    positive whole number (llama.cpp's ``-1`` included), which leaves the engine's default.
    """
    flags = SLOT_FLAGS.get(engine)
    if flags is None:
        return None
    given: str | None = None
    for index, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name not in flags:
            continue
        if sep:
            given = value
        elif index + 1 < len(args):
            given = args[index + 1]
    if given is not None and given.isascii() and given.isdigit() and int(given) > 0:
        return int(given)
    return None
