"""What the router ranks: an :class:`Upstream` (one engine that can serve a request), and the
:class:`UpstreamResolver` that lists them for a public model name.

The lifecycle manager resolves from its in-memory table of ready deployments;
:class:`berth.routing.routes.RouteResolver` wraps it for route names. The proxy
(:mod:`berth.gateway.proxy`) sends a request to the upstreams the router ranked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from berth.routing.prefix_blocks import PromptBlocks
from berth.vocab.policies import RoutingPolicy
from berth.vocab.records import StreamTimeouts


@dataclass(frozen=True)
class AdapterUse:
    """The LoRA adapter a request for ``name`` (of base model ``base``) is served with."""

    name: str
    base: str


@dataclass(frozen=True)
class Upstream:
    """Where one request goes: an engine serving the public model name ``model``.

    ``adapter`` is set for a request for a LoRA adapter; ``tier`` then ranks the
    deployment's readiness for it (0: loaded, 1: a free slot, 2: another adapter must be
    unloaded first, :mod:`berth.routing.adapters`); the router scores each tier apart,
    best first; ``lora_scales`` applies it on llama.cpp.
    """

    #: ``http://127.0.0.1:PORT`` of a local engine; empty for a remote one (``remote``),
    #: which is reached through its node's agent, at no URL of its own
    base_url: str
    deployment_id: str
    node_id: str
    model: str  # the public model name the client asked for
    #: the name the engine serves when it is not ``model`` (e.g. a route to a service): the
    #: request's ``"model"`` is rewritten to it, since vLLM and SGLang refuse other names
    engine_model: str | None = None
    adapter: AdapterUse | None = None
    tier: int = 0
    #: llama.cpp started with adapters: the scale of each (by ``--lora`` index) for this
    #: request, sent as its ``lora`` field: 1 for the adapter asked for, 0 for the others,
    #: all 0 for the base model (a request without the field gets the engine's global
    #: scales, which ``--lora-init-without-apply`` does not zero in every build)
    lora_scales: tuple[float, ...] = ()
    #: requests the engine serves at once (its slots: ``--parallel``, ``--max-num-seqs``),
    #: the most the leader's fair admission queue lets through; ``None``: not held
    slots: int | None = None
    #: where ``slots`` came from, in words (``--parallel 2``), and whether the number is
    #: assumed (an engine's default, the ``default_slots`` setting) rather than known
    slots_from: str = ""
    slots_assumed: bool = False
    #: its service's bounds on a streamed answer (first byte, longest silence), ``None``:
    #: the proxy's own settings
    timeouts: StreamTimeouts | None = None
    #: the kind of engine berth started (``llamacpp``, ``vllm``, ``sglang``), for the paths
    #: only some serve (:func:`berth.runtime.engines.serves_path`); ``None``: an adopted
    #: endpoint, whose engine berth does not know
    engine: str | None = None
    #: its service's routing policy (``None``: the ``routing_policy`` setting)
    routing_policy: RoutingPolicy | None = None
    #: the request's prompt blocks, set by the router under the ``prefix`` policy so that
    #: the deployment that answers (a retry's too) is recorded as holding them
    prompt_blocks: PromptBlocks | None = None
    #: on another node: reached through the agent there (its link, or its direct data
    #: path: :class:`berth.engine_http.answer.HttpOpener`), not at ``base_url``
    remote: bool = False


class UpstreamResolver(Protocol):
    """Chooses an engine for a model; implemented from the table of ready deployments."""

    def candidates(self, model: str) -> list[Upstream]:
        """Every engine that can serve ``model`` now (ready, on a reachable node); never
        empty. The router ranks them.

        Raises :class:`berth.errors.NotFoundError` for a model berth does not know (404) and
        :class:`berth.routing.errors.NoReadyDeploymentError` when none of its deployments is
        ready (503).
        """
        ...

    def models(self) -> list[str]:
        """Public model names with at least one deployment."""
        ...
