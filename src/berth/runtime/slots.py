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

:func:`engine_slots` returns ``None`` for every "without it" case; the callers say what they
assume instead: the fair admission gate holds llama.cpp to :data:`LLAMACPP_AUTO_SLOTS` and
does not hold the others (:func:`berth.daemon.ready_table`), scaling assumes vLLM's 256 and 8
for the rest (:mod:`berth.scaling.capacity`).
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
