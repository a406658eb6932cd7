"""How many requests a deployment's engine serves at once: its slots, the capacity the fair
admission queue (:mod:`berth.admission.fair_queue`) fills and no more.

Each engine says it with a flag, which a service or a deployment gives in its engine
arguments (``berth service create ... -- --parallel 2``):

=========  ===============================  ==========================================
engine     flag                             without it
=========  ===============================  ==========================================
llamacpp   ``--parallel N`` / ``-np N``     4: llama-server's ``-1`` ("auto") gives 4
                                            slots (its log: "n_parallel is set to auto,
                                            using n_parallel = 4")
vllm       ``--max-num-seqs N``             not gated: the default depends on the vLLM
                                            version and the GPU, and vLLM queues itself
sglang     ``--max-running-requests N``     not gated: SGLang sizes it from free memory
=========  ===============================  ==========================================

``N`` may follow the flag or be joined to it with ``=``; the last one given wins, as in the
engines' own argument parsers. A value that is not a positive whole number (llama.cpp's
``-1`` included) is the engine's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

#: The flags that set an engine's slots, by berth's engine name.
SLOT_FLAGS: Final[dict[str, tuple[str, ...]]] = {
    "llamacpp": ("--parallel", "-np"),
    "vllm": ("--max-num-seqs",),
    "sglang": ("--max-running-requests",),
}
#: Slots of an engine started without its flag (``None``: not gated by berth).
DEFAULT_SLOTS: Final[dict[str, int | None]] = {"llamacpp": 4, "vllm": None, "sglang": None}


def engine_slots(engine: str, args: Sequence[str]) -> int | None:
    """The slots of an ``engine`` (berth's name: ``llamacpp``, ``vllm``, ``sglang``) started
    with the extra arguments ``args``; ``None`` when berth does not know them (another
    engine, or one that sizes itself), so its requests are never held at the leader."""
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
    if given is not None and given.isdigit() and int(given) > 0:
        return int(given)
    return DEFAULT_SLOTS.get(engine)
