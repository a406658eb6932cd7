"""How many requests of a deployment the fair admission gate lets through at once: its
capacity, the slots :mod:`berth.admission.fair_queue` fills and no more, and where that
number came from (``berth routing MODEL`` says it).

The rule, first match wins:

1. the ``capacity`` setting of the service the deployment is a replica of (``berth service
   create|scale NAME --capacity N``; per replica, as scaling reads it: each deployment of
   the service gets ``N``), so an operator can hold the leader's queue to what a replica
   really serves whatever its engine says;
2. the engine's slots from its arguments (:func:`berth.vocab.slots.engine_slots`:
   llama.cpp ``--parallel``, vLLM ``--max-num-seqs``, SGLang ``--max-running-requests``);
3. the engine's own default where it has a fixed one: llama.cpp 4, what llama-server's
   default ``--parallel -1`` ("auto") gives (:data:`~berth.vocab.slots.LLAMACPP_AUTO_SLOTS`),
   vLLM 256, its ``--max-num-seqs`` default (:data:`~berth.vocab.slots.VLLM_DEFAULT_SLOTS`);
4. otherwise the ``default_slots`` setting (8 unless set,
   :data:`~berth.vocab.slots.ASSUMED_SLOTS`): SGLang without the flag sizes its batch from
   free memory, and an adopted endpoint says nothing of its engine.

The first two are *known*; the last two are *assumed* (:attr:`GateSlots.assumed`). Every
deployment has a number, so one whose engine does not say cannot turn the fair queue off for
its whole model. Scaling's idea of a replica's capacity (:mod:`berth.scaling.capacity`)
assumes the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from berth.vocab.slots import (
    ASSUMED_SLOTS,
    LLAMACPP_AUTO_SLOTS,
    SLOT_FLAGS,
    VLLM_DEFAULT_SLOTS,
    engine_slots,
)

#: Where a deployment's slots at the gate came from (see the module doc, in rule order).
SlotSource = Literal["service", "flag", "engine_default", "default_slots"]

#: The gate's slots of a deployment whose engine does not say (the ``default_slots`` setting).
DEFAULT_SLOTS: Final = ASSUMED_SLOTS

_ENGINE_DEFAULTS: Final[dict[str, tuple[int, str]]] = {
    "llamacpp": (LLAMACPP_AUTO_SLOTS, "llama.cpp's default, --parallel auto"),
    "vllm": (VLLM_DEFAULT_SLOTS, "vLLM's default --max-num-seqs"),
}


@dataclass(frozen=True, slots=True)
class GateSlots:
    """A deployment's slots at the gate (``slots``, at least 1), the rule that gave them
    (``source``) and that rule in words (``detail``: ``the service's capacity setting``,
    ``--parallel 2``, ``vLLM's default --max-num-seqs``, ``default_slots: ...``)."""

    slots: int
    source: SlotSource
    detail: str

    @property
    def assumed(self) -> bool:
        """Whether the number is assumed (an engine's default, or ``default_slots``) rather
        than known (the service's setting, the engine's flag)."""
        return self.source in ("engine_default", "default_slots")


def gate_slots(
    engine: str | None,
    args: Sequence[str] = (),
    capacity: int | None = None,
    *,
    default_slots: int = DEFAULT_SLOTS,
) -> GateSlots:
    """The slots of a deployment of ``engine`` (berth's name; ``None``: an adopted endpoint,
    whose engine berth does not know) started with the extra arguments ``args``, a replica
    of a service whose ``capacity`` setting is given (``None``: no such setting, or no
    service); ``default_slots`` where nothing else says. See the module doc for the rule."""
    if capacity is not None:
        return GateSlots(capacity, "service", "the service's capacity setting")
    if engine is not None:
        slots = engine_slots(engine, args)
        if slots is not None:
            return GateSlots(slots, "flag", f"{SLOT_FLAGS[engine][-1]} {slots}")
        fixed = _ENGINE_DEFAULTS.get(engine)
        if fixed is not None:
            return GateSlots(fixed[0], "engine_default", fixed[1])
    why = "an adopted endpoint does not say" if engine is None else "its engine does not say"
    return GateSlots(default_slots, "default_slots", f"default_slots: {why}")
