"""The table the proxy resolves models from: ready deployments on reachable nodes.

Memory only, read on every request, so no method here does I/O.  The lifecycle manager
keeps it in step with the store: a deployment is in it from ready until it stops, fails or
its node's link drops (then it is *parked*, so a request is told where its deployments
are); an adopted endpoint is in it while its node reports it alive.  A ready deployment whose
last health probe failed is *suspect*: it stays in the table (its state in the store is still
ready) but gets no new request while another deployment of its model can take it, until a
probe answers again.  A ready deployment a drain *retired* (its replacement elsewhere is
ready) likewise gets no new request while another of its model can take it, until it stops.

Each upstream carries its deployment's slots at the fair admission gate
(:func:`berth.admission.capacity.gate_slots`), and where they came from: a service's
``capacity`` setting for the deployments serving its name
(:meth:`ReadyTable.set_service_capacities`, told of every change to services, so a new
setting holds from the next request on), else its engine's, else the ``default_slots``
setting (an adopted endpoint, SGLang without its flag), so every upstream is held; and its
service's stream timeouts, where the service set them (:meth:`ReadyTable.set_service_timeouts`,
told likewise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from berth.admission.capacity import DEFAULT_SLOTS, GateSlots, gate_slots
from berth.agent.adopted import ADOPTED_ID_PREFIX
from berth.cluster.leader.agent_link import LOCAL_NODE_ID, EngineEndpoint
from berth.cluster.protocol.payloads import AdoptedState
from berth.errors import NotFoundError
from berth.placement import GpuReservation
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.resolver import Upstream
from berth.vocab.policies import RoutingPolicy
from berth.vocab.records import DeploymentRecord, StreamTimeouts

#: Seconds a client is told to wait (``Retry-After``) for a model that is still loading.
LOADING_RETRY_AFTER_S = 5
#: ... and for any model before the known names were first loaded (a leader starting or
#: taking over: a moment).
UNLOADED_RETRY_AFTER_S = 1


class ReadyTable:
    """Ready upstreams by public model name, plus what a refusal needs to explain itself.

    Implements the proxy's ``UpstreamResolver`` (:meth:`candidates`, :meth:`models`).
    ``on_slots(deployment_id, slots)`` hears of a ready deployment whose slots changed (a
    service's ``capacity`` set): the gate lets its waiters into new slots at once.
    ``default_slots`` is the gate's number for a deployment whose engine does not say.
    """

    def __init__(
        self,
        on_slots: Callable[[str, int | None], None] | None = None,
        *,
        default_slots: int = DEFAULT_SLOTS,
    ) -> None:
        self._on_slots = on_slots
        self._default_slots = default_slots
        #: service name -> its ``capacity`` setting (services without one are not here)
        self._capacities: dict[str, int] = {}
        #: service name -> its stream timeouts (services that set none are not here)
        self._timeouts: dict[str, StreamTimeouts] = {}
        #: service name -> its routing policy (services that set none are not here)
        self._policies: dict[str, RoutingPolicy] = {}
        #: deployment id -> (engine, extra args) of the ready ones berth started
        self._engines: dict[str, tuple[str, tuple[str, ...]]] = {}
        #: model -> deployment id -> upstream
        self._ready: dict[str, dict[str, Upstream]] = {}
        #: ready deployments whose node is unreachable: model -> deployment id -> node id
        self._parked: dict[str, dict[str, str]] = {}
        #: names that answer 503 rather than 404 while nothing serves them; ``None`` until
        #: the lifecycle first loads them from the store
        self._known_models: set[str] | None = None
        #: adopted endpoints as each node last reported them: node id -> name -> state
        self._adopted: dict[str, dict[str, AdoptedState]] = {}
        #: ready deployments whose last health probe failed: deployment id -> why
        self._suspect: dict[str, str] = {}
        #: ready deployments a drain retired (their replacement is ready): no new requests
        self._retired: set[str] = set()

    # -- the proxy's view ---------------------------------------------------------------

    def candidates(self, model: str) -> list[Upstream]:
        """Every ready deployment serving ``model`` on a reachable node (the router ranks
        them).

        Raises ``NotFoundError`` for a model berth does not know and
        ``NoReadyDeploymentError`` (503, ``Retry-After``) for one with no ready deployment,
        and for any model before :meth:`set_known_models` was first called.
        """
        ready = self._ready.get(model)
        if ready:
            if self._retired:
                serving = {d: u for d, u in ready.items() if d not in self._retired}
                # Every one retired: none is refused a request while it still runs.
                ready = serving or ready
            if self._suspect:
                sound = [u for d, u in ready.items() if d not in self._suspect]
                if sound:
                    return sound
                # Every one is suspect: a slow probe is no proof that the engine is gone, and
                # there is nowhere better to go (the failed state follows if it is).
            return list(ready.values())
        parked = self._parked.get(model)
        if parked:
            nodes = ", ".join(sorted(set(parked.values())))
            detail = f"its ready deployments are on unreachable nodes ({nodes})"
            raise NoReadyDeploymentError(model, retry_after_s=LOADING_RETRY_AFTER_S, detail=detail)
        down = [f"{state.name} on node {node_id}"
                for node_id, states in self._adopted.items()
                for state in states.values() if state.served_model_name == model]  # fmt: skip
        if down:
            detail = f"its adopted endpoint does not answer ({', '.join(sorted(down))})"
            raise NoReadyDeploymentError(model, retry_after_s=LOADING_RETRY_AFTER_S, detail=detail)
        if self._known_models is None:
            # A leader that has just taken the lease over (or is starting) serves before its
            # lifecycle has read the models: no name is unknown yet (issue 25's step-down
            # benchmark caught a 404 here for a registered model).
            detail = "this leader is still loading its models"
            raise NoReadyDeploymentError(model, retry_after_s=UNLOADED_RETRY_AFTER_S, detail=detail)
        if model in self._known_models:
            raise NoReadyDeploymentError(model, retry_after_s=LOADING_RETRY_AFTER_S)
        raise NotFoundError("model", model)

    def models(self) -> list[str]:
        """Public model names with at least one ready deployment."""
        return sorted(name for name, ready in self._ready.items() if ready)

    @property
    def loaded(self) -> bool:
        """Whether the known names were loaded (:meth:`set_known_models`): before, every
        request is told the leader is still loading its models."""
        return self._known_models is not None

    def engines_to_watch(self) -> list[Upstream]:
        """The ready deployments berth started (adopted endpoints are probed by the node
        that adopted them, and never stopped)."""
        return [u for ready in self._ready.values() for u in ready.values()
                if not u.deployment_id.startswith(ADOPTED_ID_PREFIX)]  # fmt: skip

    # -- deployments --------------------------------------------------------------------

    def set_known_models(self, names: set[str]) -> None:
        """Every name a request may ask for: registered models and active served names."""
        self._known_models = set(names)

    def add_known_model(self, name: str) -> None:
        if self._known_models is not None:  # else the first load will hold it
            self._known_models.add(name)

    def mark_ready(self, record: DeploymentRecord, endpoint: EngineEndpoint) -> None:
        """Route ``record``'s served name to ``endpoint``."""
        slots = gate_slots(
            record.engine,
            record.extra_args,
            self._capacities.get(record.served_model_name),
            default_slots=self._default_slots,
        )
        upstream = _with_slots(
            Upstream(
                base_url=endpoint.base_url,
                deployment_id=record.id,
                node_id=record.node_id,
                model=record.served_model_name,
                timeouts=self._timeouts.get(record.served_model_name),
                routing_policy=self._policies.get(record.served_model_name),
                engine=record.engine,
                remote=endpoint.remote,
            ),
            slots,
        )
        self._engines[record.id] = (record.engine, record.extra_args)
        self._ready.setdefault(record.served_model_name, {})[record.id] = upstream
        self._parked.get(record.served_model_name, {}).pop(record.id, None)
        self._suspect.pop(record.id, None)

    def set_service_capacities(self, capacities: Mapping[str, int | None]) -> None:
        """The services are now those of ``capacities`` (service name -> its ``capacity``
        setting, ``None``: none): the ready deployments serving each name get that many
        slots at the gate, or their engine's again when it has none."""
        self._capacities = {name: c for name, c in capacities.items() if c is not None}
        for model, upstreams in self._ready.items():
            capacity = self._capacities.get(model)
            for deployment_id, upstream in upstreams.items():
                engine = self._engines.get(deployment_id)
                if engine is None:  # an adopted endpoint: no service's replica
                    continue
                slots = gate_slots(*engine, capacity, default_slots=self._default_slots)
                if slots.slots == upstream.slots and slots.detail == upstream.slots_from:
                    continue
                upstreams[deployment_id] = _with_slots(upstream, slots)
                if self._on_slots is not None and slots.slots != upstream.slots:
                    self._on_slots(deployment_id, slots.slots)

    def set_service_timeouts(self, timeouts: Mapping[str, StreamTimeouts]) -> None:
        """The services' stream timeouts are now those of ``timeouts`` (service name ->
        its :class:`StreamTimeouts`): the ready deployments serving each name carry them
        from the next request on (the proxy's settings where a service set none)."""
        unset = StreamTimeouts()
        self._timeouts = {name: t for name, t in timeouts.items() if t != unset}
        for model, upstreams in self._ready.items():
            wanted = self._timeouts.get(model)
            for deployment_id, upstream in upstreams.items():
                if deployment_id in self._engines and upstream.timeouts != wanted:
                    upstreams[deployment_id] = dataclasses.replace(upstream, timeouts=wanted)

    def set_service_routing_policies(self, policies: Mapping[str, RoutingPolicy | None]) -> None:
        """The services' routing policies are now those of ``policies`` (service name ->
        its policy, ``None``: the leader's setting): the ready deployments serving each
        name carry it from the next request on."""
        self._policies = {name: p for name, p in policies.items() if p is not None}
        for model, upstreams in self._ready.items():
            wanted = self._policies.get(model)
            for deployment_id, upstream in upstreams.items():
                if deployment_id in self._engines and upstream.routing_policy != wanted:
                    upstreams[deployment_id] = dataclasses.replace(upstream, routing_policy=wanted)

    def unmark(self, model: str, deployment_id: str) -> None:
        """Stop routing ``model`` to the deployment (ready or parked)."""
        self._engines.pop(deployment_id, None)
        self._ready.get(model, {}).pop(deployment_id, None)
        self._parked.get(model, {}).pop(deployment_id, None)
        self._suspect.pop(deployment_id, None)
        self._retired.discard(deployment_id)

    def retire(self, deployment_id: str) -> None:
        """A drain retired the deployment (its replacement is ready): it gets no new
        request while another deployment of its model can take it; those in flight go on."""
        self._retired.add(deployment_id)

    def unretire(self, deployment_id: str) -> None:
        """Route to the deployment again (its drain was called off, or its replacement
        went)."""
        self._retired.discard(deployment_id)

    def retired(self) -> frozenset[str]:
        """The deployments a drain retired."""
        return frozenset(self._retired)

    def mark_suspect(self, deployment_id: str, reason: str) -> bool:
        """The deployment's health probe failed (``reason`` says how): no new requests go to
        it while another deployment of its model can take them.  Whether it was sound until
        now (``False``: already suspect, or not ready)."""
        if deployment_id in self._suspect or not self._is_ready(deployment_id):
            return False
        self._suspect[deployment_id] = reason
        return True

    def clear_suspect(self, deployment_id: str) -> bool:
        """A probe answered: route to the deployment again.  Whether it was suspect."""
        return self._suspect.pop(deployment_id, None) is not None

    def _is_ready(self, deployment_id: str) -> bool:
        return any(deployment_id in ready for ready in self._ready.values())

    def ready_upstream(self, deployment_id: str) -> Upstream | None:
        """The deployment's upstream while it is ready (suspect or not), else ``None``."""
        for ready in self._ready.values():
            upstream = ready.get(deployment_id)
            if upstream is not None:
                return upstream
        return None

    def park_node(self, node_id: str) -> None:
        """The node's link ended: its deployments leave the table, remembered as parked, and
        its adopted endpoints are forgotten until it reports them again."""
        self._adopted.pop(node_id, None)
        for model, upstreams in self._ready.items():
            for deployment_id in [d for d, u in upstreams.items() if u.node_id == node_id]:
                del upstreams[deployment_id]
                self._suspect.pop(deployment_id, None)
                self._engines.pop(deployment_id, None)
                self._parked.setdefault(model, {})[deployment_id] = node_id

    # -- adopted endpoints ----------------------------------------------------------------

    def adopted_reported(self, node_id: str, adopted: Sequence[AdoptedState]) -> None:
        """Route to the node's adopted endpoints whose last probe answered, under their
        served names; the others answer 503 naming them."""
        previous = self._adopted.get(node_id, {})
        current = {state.name: state for state in adopted}
        if current == previous:
            return
        for state in previous.values():
            self.unmark(state.served_model_name, ADOPTED_ID_PREFIX + state.name)
        self._adopted[node_id] = current
        for state in current.values():
            endpoint_id = ADOPTED_ID_PREFIX + state.name
            self._parked.get(state.served_model_name, {}).pop(endpoint_id, None)
            if not state.alive:
                continue
            # a remote one is reached through its node's agent, at no URL of its own
            base_url = f"http://{state.host}:{state.port}" if node_id == LOCAL_NODE_ID else ""
            engine_model = None
            if state.engine_model != state.served_model_name:
                engine_model = state.engine_model
            upstream = Upstream(
                base_url=base_url,
                deployment_id=endpoint_id,
                node_id=node_id,
                model=state.served_model_name,
                engine_model=engine_model,
                remote=node_id != LOCAL_NODE_ID,
            )
            # Its engine is not berth's to know: the gate holds it to default_slots.
            upstream = _with_slots(upstream, gate_slots(None, default_slots=self._default_slots))
            self._ready.setdefault(state.served_model_name, {})[endpoint_id] = upstream

    def adopted(self) -> dict[str, list[AdoptedState]]:
        """Adopted endpoints by node id, as last reported."""
        return {node: list(states.values()) for node, states in self._adopted.items()}

    def reserved_gpus(self, node_id: str) -> tuple[GpuReservation, ...]:
        """The GPUs the node's adopted endpoints declare (placement puts nothing there)."""
        return tuple(
            GpuReservation(gpu, state.name)
            for state in self._adopted.get(node_id, {}).values()
            for gpu in state.gpus
        )


def _with_slots(upstream: Upstream, slots: GateSlots) -> Upstream:
    """``upstream`` held to ``slots`` at the gate, saying where they came from."""
    return dataclasses.replace(
        upstream, slots=slots.slots, slots_from=slots.detail, slots_assumed=slots.assumed
    )
