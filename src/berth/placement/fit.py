"""Fitting a deployment's VRAM estimate on a node's GPUs: pure, over plain values.

The leader's view of a GPU is :class:`GpuFacts`: what the node reports (total and free, from
NVML or its simulated inventory) and berth's own deployments there (:class:`Resident`, each
with its estimate).  Its free memory for placement (:attr:`GpuFacts.free_mb`) is the smaller
of

* what the node reports free, less the estimates of berth's deployments there that are still
  starting (their engines have not allocated yet, so the report cannot show them), and
* the GPU's total less the estimates of every berth deployment there (a simulated GPU
  reports nothing used, so this is what fills it up; on a real GPU it covers an estimate
  the report has not caught up with).

:func:`gpu_options` judges each GPU of a node for an estimate; :func:`choose_gpus` picks the
GPUs a deployment goes to: fewest replicas of the same service first (replicas spread over
nodes, then over GPUs), then the most memory left free after it (deployments spread over
GPUs rather than pack), then the node's and GPU's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from berth.placement.estimate import FitVerdict, VramEstimate, mib


@dataclass(frozen=True)
class Resident:
    """A berth deployment holding VRAM on one GPU, as the leader accounts for it.

    ``vram_mb``: its estimate on this GPU (what it holds there).  ``starting``: pending or
    loading (not yet visible in the node's report).  ``started_at`` (when it became
    resident: ready, or placed while still starting) and ``last_request_at`` are epoch
    seconds (``None``: no request since it started); ``in_flight`` and ``queued``
    count requests; ``pinned`` deployments are never evicted.  A deployment on several GPUs
    is a resident of each.
    """

    deployment_id: str
    served_model_name: str
    vram_mb: int
    starting: bool = False
    started_at: float = 0.0
    last_request_at: float | None = None
    in_flight: int = 0
    queued: int = 0
    pinned: bool = False


@dataclass(frozen=True)
class GpuFacts:
    """One GPU of a node, for placement: NVML's ``index`` and ``name``, memory in MiB as the
    node reports it, berth's ``residents`` on it, and whether the node simulates it
    (``simulated_gpus``)."""

    index: int
    name: str
    total_mb: int
    reported_free_mb: int
    residents: tuple[Resident, ...] = ()
    simulated: bool = False

    @property
    def held_mb(self) -> int:
        """What berth's deployments on this GPU are estimated to hold."""
        return sum(r.vram_mb for r in self.residents)

    @property
    def unfloored_free_mb(self) -> int:
        """:attr:`free_mb` before it is floored at 0 (negative: berth's estimates exceed what
        the GPU has)."""
        starting = sum(r.vram_mb for r in self.residents if r.starting)
        return min(self.reported_free_mb - starting, self.total_mb - self.held_mb)

    @property
    def free_mb(self) -> int:
        """Free memory for placement (see the module docstring), at least 0."""
        return max(0, self.unfloored_free_mb)


@dataclass(frozen=True)
class ReplicaAt:
    """An active deployment of the same service (served model name) on ``node_id``'s
    ``gpus``: replicas spread over nodes first, then over GPUs."""

    node_id: str
    gpus: tuple[int, ...] = ()


OptionVerdict = FitVerdict | Literal["reserved", "unchecked"]


@dataclass(frozen=True)
class GpuOption:
    """A GPU placement looked at: ``verdict`` for the estimate (``reserved``: an adopted
    endpoint declares it; ``unchecked``: no estimate), ``detail`` the line saying why, and
    the memory left free after the deployment (``free_after_mb``; negative: short by
    that much)."""

    node_id: str
    label: str
    index: int
    name: str
    total_mb: int
    free_mb: int
    verdict: OptionVerdict
    detail: str
    free_after_mb: int
    simulated: bool = False

    def line(self) -> str:
        """``node gpu-a GPU 0 (H100, 24.0 GiB, 20.0 GiB free): fits, takes 1.4 GiB …``."""
        sim = ", simulated" if self.simulated and "simulated" not in self.name else ""
        return (
            f"node {self.label} GPU {self.index} ({self.name}{sim}, {mib(self.total_mb)}, "
            f"{mib(self.free_mb)} free): {self.verdict.replace('_', ' ')}, {self.detail}"
        )


def gpu_options(
    estimate: VramEstimate | None,
    node_id: str,
    label: str,
    gpus: Sequence[GpuFacts],
    reserved: Sequence[int] = (),
) -> list[GpuOption]:
    """Each of ``gpus`` judged for ``estimate`` (``None``: unchecked), in index order;
    indexes in ``reserved`` are declared by adopted endpoints."""
    options = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        free = gpu.free_mb
        if gpu.index in reserved:
            verdict: OptionVerdict = "reserved"
            detail, after = "an adopted endpoint declares it", -1
        elif estimate is None:
            verdict, detail, after = "unchecked", "no estimate", free
        else:
            verdict, detail = estimate.fit(gpu.total_mb, free)
            after = free - estimate.holds_mb(gpu.total_mb)
        options.append(
            GpuOption(
                node_id, label, gpu.index, gpu.name, gpu.total_mb, free, verdict, detail, after,
                gpu.simulated,
            )
        )  # fmt: skip
    return options


def replicas_on(replicas: Sequence[ReplicaAt], node_id: str, gpu: int | None = None) -> int:
    """How many of ``replicas`` run on ``node_id`` (on its ``gpu``, when given)."""
    return sum(1 for r in replicas if r.node_id == node_id and (gpu is None or gpu in r.gpus))


def choose_gpus(
    options: Sequence[GpuOption],
    count: int,
    replicas: Sequence[ReplicaAt],
    node_order: Sequence[str],
) -> tuple[GpuOption, ...] | None:
    """The best ``count`` GPUs of one node among ``options`` whose verdict is ``fits``, by
    the order of the module docstring; ``None`` when no node has ``count`` of them.

    ``node_order`` ranks nodes that tie (the order the leader lists them).
    """
    by_node: dict[str, list[GpuOption]] = {}
    for option in options:
        if option.verdict == "fits":
            by_node.setdefault(option.node_id, []).append(option)
    picks: list[tuple[tuple[int, int, int, int], tuple[GpuOption, ...]]] = []
    for node_id, fitting in by_node.items():
        if len(fitting) < count:
            continue
        fitting.sort(key=lambda o: (replicas_on(replicas, node_id, o.index), -o.free_after_mb,
                                    o.index))  # fmt: skip
        chosen = tuple(fitting[:count])
        rank = node_order.index(node_id) if node_id in node_order else len(node_order)
        key = (
            replicas_on(replicas, node_id),
            sum(replicas_on(replicas, node_id, o.index) for o in chosen),
            -min(o.free_after_mb for o in chosen),
            rank,
        )
        picks.append((key, chosen))
    if not picks:
        return None
    return min(picks, key=lambda pick: pick[0])[1]


def most_free(options: Sequence[GpuOption]) -> GpuOption | None:
    """The option with the most free memory (not a reserved one); ties by node and index
    order as given."""
    usable = [o for o in options if o.verdict != "reserved"]
    return max(usable, key=lambda o: o.free_mb, default=None)
