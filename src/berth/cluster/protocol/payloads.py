"""The typed values nested in the agent link's frame bodies (no I/O).

What frames carry inside them: a host's hardware (:class:`Inventory`, :class:`GpuState`) and
the engines and adopted servers its agent runs (:class:`EngineState`, :class:`AdoptedState`),
in ``HELLO`` and op results; per-deployment load and the loop-lag histogram
(:class:`DeploymentLoad`, :class:`LoopLag`) and the engines that ended
(:class:`EngineEnded`) in ``HEARTBEAT``; and why a request failed
(:class:`ErrorInfo` with its :class:`ErrorCode`) in ``RESPONSE``. Like the frames, they leave
defaults out on the wire and ignore unknown fields; :mod:`berth.cluster.protocol.frames` is
their one codec and ``docs/protocol.md`` the specification.
"""

from __future__ import annotations

import itertools
from enum import StrEnum
from pathlib import Path

import msgspec

from berth.vocab.agent_policy import AgentPolicy
from berth.vocab.engines import ENGINE_NAMES


class _Body(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of every nested payload; defaults are left out on the wire."""


# -- nested payloads ---------------------------------------------------------------------------


class GpuState(_Body, kw_only=True):
    index: int
    name: str
    uuid: str = ""
    memory_total_mb: int = 0
    memory_used_mb: int = 0
    utilization_pct: int | None = None


class Inventory(_Body, kw_only=True):
    """A host's hardware as its agent reports it."""

    hostname: str
    cpu_count: int = 0
    memory_total_mb: int = 0
    gpus: list[GpuState] = []


class EngineState(_Body, kw_only=True):
    """One engine an agent runs: its deployment, pid and port, and whether it is alive."""

    deployment_id: str
    pid: int
    port: int
    alive: bool = True


class EngineEnded(_Body, kw_only=True):
    """A running engine that ended by itself, reported in the next ``HEARTBEAT``, which the
    agent sends at once: its deployment, and its exit code or the signal that killed it when
    the agent knows (a container's code is 128 + N for signal N)."""

    deployment_id: str
    exit_code: int | None = None
    exit_signal: str | None = None


class DeploymentLoad(_Body, kw_only=True):
    """Per-deployment load in a heartbeat, measured by the agent that serves the requests.

    ``requests_total``/``errors_total`` count tunneled requests finished since the agent
    started (an error: engine status >= 500, or the exchange failed); the latencies, in
    milliseconds, are percentiles over the agent's last 60 s (absent when it served none).
    """

    deployment_id: str
    in_flight: int = 0
    alive: bool = True
    requests_total: int = 0
    errors_total: int = 0
    latency_p50_ms: float | None = None
    latency_p95_ms: float | None = None


#: Most buckets a heartbeat's loop-lag histogram may carry.
MAX_LAG_BUCKETS = 64


class LoopLag(_Body, kw_only=True):
    """The agent's event-loop lag histogram, cumulative since the agent started.

    ``bounds_s`` are the buckets' upper bounds in seconds, increasing (at most
    :data:`MAX_LAG_BUCKETS`); ``counts`` holds one count per bucket (not cumulative) and a
    last one for lags above the largest bound; ``sum_s`` adds up every lag, in seconds.
    Decoding anything else raises (a malformed ``HEARTBEAT``).
    """

    bounds_s: list[float]
    counts: list[int]
    sum_s: float = 0.0

    def __post_init__(self) -> None:
        bounds = self.bounds_s
        if not 0 < len(bounds) <= MAX_LAG_BUCKETS:
            raise ValueError(f"loop_lag needs 1 to {MAX_LAG_BUCKETS} bounds, not {len(bounds)}")
        if any(not b > a for a, b in itertools.pairwise(bounds)):
            raise ValueError("loop_lag bounds_s must increase")
        if len(self.counts) != len(bounds) + 1 or any(c < 0 for c in self.counts):
            raise ValueError("loop_lag counts must be one non-negative count per bound, plus one")
        if not self.sum_s >= 0:
            raise ValueError("loop_lag sum_s must be a non-negative number")


class AdoptedState(_Body, kw_only=True):
    """An OpenAI-compatible server the agent adopted (it did not start it): where it
    answers on the agent's host, the name clients use for it (``served_model_name``) and the
    one it serves (``engine_model``), the GPUs and memory it declares, and whether its last
    probe answered."""

    name: str
    served_model_name: str
    engine_model: str
    host: str
    port: int
    gpus: list[int] = []
    vram_mb: int | None = None
    alive: bool = False


class ErrorCode(StrEnum):
    """Why a request failed (``RESPONSE.error.code``, ``docs/protocol.md``, Control operations).

    A code this side does not know (a newer peer's) reads as :attr:`INTERNAL`.
    """

    #: an op the peer does not know or does not serve
    UNSUPPORTED = "unsupported"
    #: malformed arguments, or a request the peer refuses as given
    INVALID = "invalid"
    #: no such deployment or engine
    NOT_FOUND = "not_found"
    #: the engine failed (to start, or was stopped while starting); ``log_tail`` says more
    ENGINE_ERROR = "engine_error"
    #: the agent's policy refuses the start; ``rule`` names the rule (a leader older than
    #: this code reads it as ``internal``, and shows the message all the same)
    POLICY_REFUSED = "policy_refused"
    #: an unexpected failure; the agent's log has the traceback
    INTERNAL = "internal"
    #: a start whose spec carries no valid signature of the cluster's signing key, or asks
    #: for something the signed spec does not say (``SpecRefusedError``); the message names
    #: the deployment and what did not match
    SPEC_REFUSED = "spec_refused"

    @classmethod
    def _missing_(cls, value: object) -> ErrorCode:
        return cls.INTERNAL


class ErrorInfo(_Body, kw_only=True):
    """Why a request failed: ``code`` is for programs, ``message`` for people, ``log_tail``
    the engine's last log lines (``engine_error``)."""

    code: ErrorCode
    message: str
    log_tail: str = ""
    #: the policy rule broken (``policy_refused`` only)
    rule: str = ""


class PolicyState(_Body, kw_only=True):
    """An agent's policy as it reports it in Hello (:class:`berth.vocab.agent_policy.AgentPolicy`):
    ``gpus`` ``None`` means every GPU."""

    engines: list[str] = []
    images: list[str] = []
    model_roots: list[str] = []
    gpus: list[int] | None = None
    allow_args: list[str] = []
    refuse_args: list[str] = []


def policy_state(policy: AgentPolicy) -> PolicyState:
    """``policy`` as an agent reports it."""
    return PolicyState(
        engines=sorted(policy.engines),
        images=list(policy.images),
        model_roots=[str(root) for root in policy.model_roots],
        gpus=None if policy.gpus is None else list(policy.gpus),
        allow_args=sorted(policy.allow_args),
        refuse_args=sorted(policy.refuse_args),
    )


def policy_of(state: PolicyState) -> AgentPolicy:
    """The policy an agent reported; engines this side does not know are left out (a
    newer agent's), so the leader never places one there."""
    return AgentPolicy(
        engines=frozenset(e for e in ENGINE_NAMES if e in state.engines),
        images=tuple(state.images),
        model_roots=tuple(Path(root) for root in state.model_roots),
        gpus=None if state.gpus is None else tuple(state.gpus),
        allow_args=frozenset(state.allow_args),
        refuse_args=frozenset(state.refuse_args),
    )
