"""The proxy's resolver with LoRA adapters (the request body llama.cpp gets for one is
written per engine by :class:`berth.gateway.attempt.EngineBodies`).

An adapter's name resolves to the ready deployments of its base that can serve it, tagged
with the adapter and their tier (:meth:`berth.deployments.adapters.AdapterManager.upstreams`);
every other name goes to the routes unchanged, with llama.cpp engines started with adapters
told to apply none (:meth:`~berth.deployments.adapters.AdapterManager.base_request`).
"""

from __future__ import annotations

from berth.deployments.adapters import AdapterManager
from berth.errors import NotFoundError
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.resolver import Upstream, UpstreamResolver


class AdapterResolver:
    """The proxy's resolver with adapters: an adapter's name resolves to the ready
    deployments of its base that can serve it (:meth:`AdapterManager.upstreams`), every
    other name to ``routes`` unchanged. ``direct`` (the lifecycle manager) finds the base's
    deployments by their served names, service or not."""

    def __init__(
        self, routes: UpstreamResolver, direct: UpstreamResolver, manager: AdapterManager
    ) -> None:
        self._routes = routes
        self._direct = direct
        self._manager = manager

    def candidates(self, model: str) -> list[Upstream]:
        """See :meth:`berth.routing.resolver.UpstreamResolver.candidates`; an adapter with
        no deployment able to serve it is a :class:`NoReadyDeploymentError` saying why."""
        adapter = self._manager.entry(model)
        if adapter is None:
            return [self._manager.base_request(u) for u in self._routes.candidates(model)]
        return self._manager.upstreams(adapter, self._base_upstreams(adapter.base))

    def _base_upstreams(self, base: str) -> list[Upstream]:
        """The ready deployments of the model ``base``, whatever name each is served under."""
        deployments = self._manager.deployments_of(base)
        found: list[Upstream] = []
        for name in sorted(set(deployments.values())):
            try:
                ready = self._direct.candidates(name)
            except (NotFoundError, NoReadyDeploymentError):
                continue
            found.extend(u for u in ready if u.deployment_id in deployments)
        return found

    def models(self) -> list[str]:
        """The routes' names, and each adapter whose base has a ready deployment."""
        names = set(self._routes.models())
        for adapter in self._manager.adapters():
            if self._base_upstreams(adapter.base):
                names.add(adapter.name)
        return sorted(names)

    def parent(self, model: str) -> str | None:
        """The base model of the adapter ``model`` (``/v1/models``' ``parent``), else ``None``."""
        adapter = self._manager.entry(model)
        return None if adapter is None else adapter.base
