"""How many requests one replica of a service serves at once: its concurrency capacity.

A service may set it (``capacity``); otherwise it is the engine's slots, read from the
service's engine arguments the way each engine reads them:

- llama.cpp's ``llama-server``: ``-np``/``--parallel N``; its default, ``-1`` ("auto"), is 4
  slots with a unified KV cache (``llama-server --help``, and what its log prints:
  ``n_slots = 4``);
- vLLM: ``--max-num-seqs N``, default 256 (vLLM's engine arguments);
- SGLang: ``--max-running-requests N``; without it SGLang sizes the batch from free memory
  at start, which the leader cannot know, so :data:`UNKNOWN_SLOTS` is assumed.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from berth.runtime.engines import EngineName
from berth.store import ServiceProfileRecord

#: llama-server's slots when ``--parallel`` is left at its default ("auto").
LLAMACPP_DEFAULT_SLOTS: Final = 4
#: vLLM's ``--max-num-seqs`` default.
VLLM_DEFAULT_SLOTS: Final = 256
#: Assumed where an engine decides its slots at start (SGLang without
#: ``--max-running-requests``), or an argument does not parse.
UNKNOWN_SLOTS: Final = 8

_SLOT_FLAGS: Final[dict[str, tuple[str, ...]]] = {
    "llamacpp": ("-np", "--parallel"),
    "vllm": ("--max-num-seqs",),
    "sglang": ("--max-running-requests",),
}
_DEFAULT_SLOTS: Final[dict[str, int]] = {
    "llamacpp": LLAMACPP_DEFAULT_SLOTS,
    "vllm": VLLM_DEFAULT_SLOTS,
    "sglang": UNKNOWN_SLOTS,
}


def engine_slots(engine: EngineName | str, extra_args: Sequence[str]) -> int:
    """The requests an engine started with ``extra_args`` decodes at once (see the module
    docstring); the last of repeated flags wins, as in each engine's argument parser, and
    ``--flag=N`` is read like ``--flag N``.  A value that is not a positive number (llama's
    ``-1``, "auto") leaves the engine's default."""
    flags = _SLOT_FLAGS.get(engine, ())
    found: str | None = None
    args = list(extra_args)
    for index, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name not in flags:
            continue
        if equals:
            found = value
        elif index + 1 < len(args):
            found = args[index + 1]
    if found is not None:
        try:
            slots = int(found)
        except ValueError:
            return UNKNOWN_SLOTS
        if slots > 0:
            return slots
    return _DEFAULT_SLOTS.get(engine, UNKNOWN_SLOTS)


def replica_capacity(service: ServiceProfileRecord) -> int:
    """The concurrency capacity of one replica of ``service``: its ``capacity`` setting, else
    its engine's slots (:func:`engine_slots`)."""
    if service.scaling.capacity is not None:
        return service.scaling.capacity
    return engine_slots(service.engine, service.extra_args)
