"""How many requests one replica of a service serves at once: its concurrency capacity.

A service may set it (``capacity``); otherwise it is the engine's slots, read from the
service's engine arguments (:func:`berth.vocab.slots.engine_slots`), and where those do
not say, a default per engine:

- llama.cpp's ``llama-server``: its default ``--parallel -1`` ("auto") is 4 slots
  (:data:`~berth.vocab.slots.LLAMACPP_AUTO_SLOTS`);
- vLLM: 256, vLLM's ``--max-num-seqs`` default (its engine arguments);
- SGLang, or an argument that does not parse: without ``--max-running-requests`` SGLang
  sizes the batch from free memory at start, which the leader cannot know, so
  :data:`UNKNOWN_SLOTS` is assumed.

The fair admission gate assumes the same numbers (:mod:`berth.admission.capacity`); the last
one is the ``default_slots`` setting for both. Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

from berth.vocab.records import ServiceProfileRecord
from berth.vocab.slots import ASSUMED_SLOTS, LLAMACPP_AUTO_SLOTS, VLLM_DEFAULT_SLOTS, engine_slots

#: Assumed where an engine decides its slots at start (SGLang without
#: ``--max-running-requests``), or an argument does not parse.
UNKNOWN_SLOTS: Final = ASSUMED_SLOTS

_DEFAULT_SLOTS: Final[dict[str, int]] = {
    "llamacpp": LLAMACPP_AUTO_SLOTS,
    "vllm": VLLM_DEFAULT_SLOTS,
}


def replica_capacity(service: ServiceProfileRecord, *, default_slots: int = UNKNOWN_SLOTS) -> int:
    """The concurrency capacity of one replica of ``service``: its ``capacity`` setting, else
    its engine's slots, else the engine's default, else ``default_slots`` (the setting; see
    the module doc)."""
    if service.scaling.capacity is not None:
        return service.scaling.capacity
    slots = engine_slots(service.engine, service.extra_args)
    if slots is not None:
        return slots
    return _DEFAULT_SLOTS.get(service.engine, default_slots)
