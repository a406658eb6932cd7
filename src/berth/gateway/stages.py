"""The stages of a completion request before its attempts, each a function (or a small
object) that takes the :class:`~berth.gateway.request.PublicRequest` and returns it (or
what it decided), testable alone:

- :func:`admit` (admission): the key's limits, :class:`~berth.admission.Ticket` or a
  403/429 refusal;
- :func:`ask_usage` (rewriter): a stream the client did not ask usage of asks the engine
  for it, the relay to take that event out (``strip_usage``);
- :class:`Routing` (routing): the router's ranked plan and the request's affinity key,
  held by the on-demand stage while nothing is ready, kept to the engines that serve the
  path for a Messages request (or the request translated to a chat completion for
  engines that serve none: :mod:`berth.gateway.messages_bridge`);
- :func:`take_slot` (fair admission): a slot at one of the planned deployments, at once
  or after waiting in the fair queue, with that deployment first in the plan.

The attempts follow (:mod:`berth.gateway.attempt`), then the relay
(:mod:`berth.gateway.relay`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from berth.admission import MUST_WAIT, SOCKET_KEY_ID, Admission, SlotGate, Ticket
from berth.gateway.exchange import ClientRequest
from berth.gateway.messages_bridge import route_messages
from berth.gateway.request import PublicRequest
from berth.gateway.usage import asking_for_usage
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.scaling.on_demand import OnDemandStage

if TYPE_CHECKING:  # imported only where tracing is on (berth.daemon.build opens it)
    from berth.observability.tracing import RequestTrace

__all__ = ["Routing", "admit", "ask_usage", "take_slot"]


def admit(admission: Admission, request: PublicRequest) -> Ticket:
    """The admission stage: ``request`` admitted against its key's limits (before the
    router sees it: a request its key may not make is never planned). Raises what
    :meth:`Admission.admit` raises (403, or 429 with the key's rate-limit headers)."""
    body = request.body
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = asked if type(asked) is int else None  # for the budgets' reservation
    return admission.admit(request.key, request.model, request.received_bytes, max_tokens)


def ask_usage(request: PublicRequest) -> PublicRequest:
    """The usage rewriter: ``request`` asking the engine for its stream's usage when the
    client did not (``strip_usage`` set: the relay takes that event out of the client's
    stream), else ``request`` itself (:func:`berth.gateway.usage.asking_for_usage`)."""
    asked = asking_for_usage(request.path, request.raw, request.body)
    if asked is None:
        return request
    body, raw = asked
    return request._replace(body=body, raw=raw, strip_usage=True)


class Routing:
    """The routing stage: :meth:`route` plans ``request`` with ``router`` (ranked
    candidates, best first); a model with nothing ready is held by ``on_demand`` until its
    service loads, when there is one."""

    __slots__ = ("_on_demand", "_router")

    def __init__(self, router: Router, on_demand: OnDemandStage | None) -> None:
        self._router = router
        self._on_demand = on_demand

    async def route(
        self, request: PublicRequest, client: ClientRequest, trace: RequestTrace | None = None
    ) -> tuple[PublicRequest, list[Upstream]] | None:
        """``request`` with its ``affinity_key``, and its plan (never empty); ``None`` when
        the client left while its service loaded.

        A Messages request's plan keeps only the engines that serve its path, in the
        router's order, or, when none serves ``/v1/messages``, the request is translated to
        a chat completion for all of them (:mod:`berth.gateway.messages_bridge`). Raises
        :class:`NoReadyDeploymentError` (503) or the errors of the resolver (404) and of the
        on-demand stage (503), and
        :class:`~berth.routing.errors.InvalidRequestError` (``path_not_served``, or what
        the translation refuses: ``not_translated``, ``invalid_request``). With ``trace``
        (tracing on): the load's wait is a span, the plan and why its first leads are the
        request's span's attributes.
        """
        try:
            # The body too: the prefix policy routes by its messages (or prompt).
            plan, key = self._router.plan_request(request.model, request.headers, request.body)
        except NoReadyDeploymentError:
            if self._on_demand is None:
                raise
            wait = None if trace is None else trace.waiting("berth.load_wait")
            loaded = await self._hold(self._on_demand, request, client)
            if wait is not None:
                wait.end()
            if loaded is None:  # the client left while its service loaded
                return None
            plan, key = loaded
        if request.dialect:  # the engines that serve the path, or all as chat completions
            request, plan = route_messages(request, plan)
        if trace is not None and plan:
            trace.routed([u.deployment_id for u in plan], self._router.why_first(plan, key))
        if key is not None:
            request = request._replace(affinity_key=key)
        return request, plan

    async def _hold(
        self, on_demand: OnDemandStage, request: PublicRequest, client: ClientRequest
    ) -> tuple[list[Upstream], str | None] | None:
        """The on-demand stage: the plan once the model has a ready deployment (raising what
        the stage raises: 503 for a load that timed out, was refused or failed), ``None``
        when the client left while it waited (it leaves the stage's queue at once)."""
        task = asyncio.current_task()
        assert task is not None, "requests are served in a task"
        left = False

        def client_left() -> None:
            nonlocal left
            left = True
            task.cancel()

        model, headers, body, router = request.model, request.headers, request.body, self._router
        client.watch_disconnect(client_left)
        try:
            return await on_demand.until_ready(
                model, lambda: router.plan_request(model, headers, body)
            )
        except asyncio.CancelledError:
            # Ours if the client left; anyone else's (a server shutting down) goes on up.
            if not left or task.uncancel() > 0:
                raise
            return None
        finally:
            client.watch_disconnect(None)


async def take_slot(
    gate: SlotGate,
    request: PublicRequest,
    ticket: Ticket | None,
    plan: list[Upstream],
    trace: RequestTrace | None = None,
) -> tuple[str | None, list[Upstream]]:
    """The fair admission stage: the deployment whose slot ``request`` now holds (``None``:
    none of the plan's deployments is held), taken at once when one is free (no await), else
    waited for in the fair queue by the ticket's key and priority; and ``plan`` with that
    deployment first. Raises :class:`~berth.admission.QueueRefusedError` (429/503) for a
    full queue or a wait past its timeout. With ``trace``, a wait is a span.

    It returns holding the slot or holding nothing: a failure after the slot was taken
    gives it back before it goes up (the caller's ``finally`` begins at the return)."""
    taken = gate.take_free(plan)
    wait = None
    if taken is MUST_WAIT:
        key_id = ticket.key_id if ticket is not None else SOCKET_KEY_ID
        priority = ticket.priority if ticket is not None else 0
        wait = None if trace is None else trace.waiting("berth.queue_wait")
        taken = await gate.wait(key_id, priority, request.model, plan)
    if taken is None:
        return None, plan
    try:
        if wait is not None:
            wait.end()
        if taken != plan[0].deployment_id:
            plan = first(plan, taken)
    except BaseException:
        gate.release(taken)
        raise
    return taken, plan


def first(plan: Sequence[Upstream], deployment_id: str) -> list[Upstream]:
    """``plan`` with the upstream of ``deployment_id`` moved to its front."""
    chosen = [u for u in plan if u.deployment_id == deployment_id]
    return chosen + [u for u in plan if u.deployment_id != deployment_id]
