"""How many requests of a deployment the fair admission gate lets through at once: its
capacity, the slots :mod:`berth.admission.fair_queue` fills and no more.

The rule, first match wins:

1. the ``capacity`` setting of the service the deployment is a replica of (``berth service
   create|scale NAME --capacity N``; per replica, as scaling reads it: each deployment of
   the service gets ``N``), so an operator can hold the leader's queue to what a replica
   really serves whatever its engine says;
2. the engine's slots from its arguments (:func:`berth.runtime.slots.engine_slots`:
   llama.cpp ``--parallel``, vLLM ``--max-num-seqs``, SGLang ``--max-running-requests``);
3. llama.cpp without a slot count: 4, what llama-server's default ``--parallel -1``
   ("auto") gives (:data:`berth.runtime.slots.LLAMACPP_AUTO_SLOTS`);
4. otherwise not gated (``None``): vLLM's default depends on its version and the GPU, and
   SGLang sizes its batch from free memory; both queue by themselves, so the leader does
   not hold their requests on a guess.

Scaling's idea of a replica's capacity (:mod:`berth.scaling.capacity`) follows the same
first two steps but must have a number, so it assumes more in the last two.
"""

from __future__ import annotations

from collections.abc import Sequence

from berth.runtime.slots import LLAMACPP_AUTO_SLOTS, engine_slots


def gate_slots(engine: str, args: Sequence[str], capacity: int | None = None) -> int | None:
    """The slots of a deployment of ``engine`` (berth's name) started with the extra
    arguments ``args``, a replica of a service whose ``capacity`` setting is given
    (``None``: no such setting, or no service); ``None`` when its requests are not held at
    the leader. See the module doc for the rule."""
    if capacity is not None:
        return capacity
    slots = engine_slots(engine, args)
    if slots is not None:
        return slots
    return LLAMACPP_AUTO_SLOTS if engine == "llamacpp" else None
