"""The desk worker's pure decisions: what a pulse says and when one is due.

A pulse (the protocol's "Heartbeat") describes one offered model:

- ``chip``, ``vram_gb``, ``vram_used_gb``: the GPUs of the deployments that serve the model
  (a deployment's own GPUs, else every GPU of its node; each GPU counted once), from NVML as
  the nodes report it. ``chip`` is the GPUs' distinct names joined with ``" + "``; the memory
  fields are GB (GiB, as ``nvidia-smi`` counts) to one decimal. All three are ``None`` where
  no GPU serves the model (llama.cpp on CPU).
- ``slots``: one per ready deployment the router would use for the model;
- ``busy``: whether the requests in flight on those deployments (berth's count from the
  nodes' latest samples, or the worker's own jobs and speed test when it knows of more) fill
  the slots;
- ``tok_per_s``: the speed test's result, ``None`` until measured.

A pulse is sent when ``busy`` or the model list changed since the last one, otherwise every
:data:`PULSE_EVERY_S` seconds (the protocol's "about every 30 seconds").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from berth.desk.wire import Pulse

#: Seconds between pulses when nothing changes.
PULSE_EVERY_S: Final = 30.0
_MIB_PER_GIB = 1024


@dataclass(frozen=True)
class GpuView:
    """One GPU of a node that serves a model; memory in MiB."""

    node_id: str
    index: int
    name: str
    memory_total_mb: int
    memory_used_mb: int


@dataclass(frozen=True)
class ModelServing:
    """What serves one model right now (see the module docstring for each field)."""

    model: str
    slots: int
    in_flight: int
    chip: str | None
    vram_gb: float | None
    vram_used_gb: float | None


def serving_of(model: str, *, slots: int, in_flight: int, gpus: Sequence[GpuView]) -> ModelServing:
    """Sum up ``gpus`` (a GPU listed twice counts once) for ``model``'s pulse."""
    unique = list({(gpu.node_id, gpu.index): gpu for gpu in gpus}.values())
    if not unique:
        return ModelServing(model, slots, in_flight, chip=None, vram_gb=None, vram_used_gb=None)
    names = list(dict.fromkeys(gpu.name for gpu in unique))
    total_mb = sum(gpu.memory_total_mb for gpu in unique)
    used_mb = sum(gpu.memory_used_mb for gpu in unique)
    return ModelServing(
        model,
        slots,
        in_flight,
        chip=" + ".join(names),
        vram_gb=round(total_mb / _MIB_PER_GIB, 1),
        vram_used_gb=round(used_mb / _MIB_PER_GIB, 1),
    )


def is_busy(serving: ModelServing, own_jobs: int) -> bool:
    """Whether the model's slots are full: berth's in-flight count or the worker's own
    running jobs (whichever is higher: the samples lag behind a job just started)."""
    return max(serving.in_flight, own_jobs) >= serving.slots


def build_pulse(
    serving: ModelServing,
    *,
    own_jobs: int,
    tok_per_s: float | None,
    models: Sequence[str],
    enc_pubkey: str,
) -> Pulse:
    """The pulse of ``serving``'s node; ``models`` is every model this host offers."""
    return Pulse(
        chip=serving.chip,
        vram_gb=serving.vram_gb,
        vram_used_gb=serving.vram_used_gb,
        tok_per_s=tok_per_s,
        busy=is_busy(serving, own_jobs),
        slots=serving.slots,
        models=list(models),
        enc_pubkey=enc_pubkey,
    )


@dataclass(frozen=True)
class SentPulse:
    """What the last pulse of a node said, and when it was sent (monotonic seconds)."""

    at: float
    busy: bool
    models: tuple[str, ...]


def pulse_due(
    last: SentPulse | None, pulse: Pulse, now: float, *, every_s: float = PULSE_EVERY_S
) -> bool:
    """Whether ``pulse`` should go now: none was sent yet, ``busy`` or the model list
    changed, or ``every_s`` passed since the last one."""
    if last is None:
        return True
    if pulse.busy != last.busy or tuple(pulse.models) != last.models:
        return True
    return now - last.at >= every_s


def tokens_per_second(completion_tokens: int, wall_s: float) -> float | None:
    """The speed test's figure: completion tokens over wall time, one decimal; ``None`` when
    the engine gave no count (nothing was measured)."""
    if completion_tokens <= 0 or wall_s <= 0:
        return None
    return round(completion_tokens / wall_s, 1)
