"""The route resolver, pure: routes over a fixed table of ready deployments."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from berth.errors import NotFoundError
from berth.openai_errors import error_from_exception
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.resolver import Upstream
from berth.routing.routes import (
    ROUTE_RETRY_AFTER_S,
    RouteResolver,
    RouteTable,
    UnroutedServiceError,
)
from berth.store.routes import fallback_cycle
from berth.vocab.records import RouteRecord, RouteTarget

EPOCH = datetime(2025, 1, 1, tzinfo=UTC)


class Deployments:
    """What the lifecycle manager answers: ``ready`` names have one deployment each
    (``d-<name>``), ``loading`` names are known with none ready, the rest are unknown."""

    def __init__(self, ready: tuple[str, ...] = (), loading: tuple[str, ...] = ()) -> None:
        self.ready = {
            name: [Upstream(f"http://{name}", f"d-{name}", "local", name)] for name in ready
        }
        self.loading = loading

    def candidates(self, model: str) -> list[Upstream]:
        if model in self.ready:
            return list(self.ready[model])
        if model in self.loading:
            raise NoReadyDeploymentError(model, retry_after_s=2.0, detail="loading")
        raise NotFoundError("model", model)

    def models(self) -> list[str]:
        return sorted(self.ready)


def route(name: str, *targets: tuple[str, int], fallback: str | None = None) -> RouteRecord:
    return RouteRecord(name, tuple(RouteTarget(s, p) for s, p in targets), fallback, EPOCH)


#: chat: big (10) first, then small-a and small-b (5) together; falls back to backup (tiny).
ROUTES = (
    route("chat", ("big", 10), ("small-a", 5), ("small-b", 5), fallback="backup"),
    route("backup", ("tiny", 0)),
)
SERVICES = ("big", "small-a", "small-b", "tiny", "spare")


def resolver(ready: tuple[str, ...], loading: tuple[str, ...] = ()) -> RouteResolver:
    routes = RouteResolver(Deployments(ready, loading))
    routes.load(ROUTES, SERVICES)
    return routes


def served_by(upstreams: list[Upstream]) -> list[str]:
    return sorted(u.deployment_id[2:] for u in upstreams)


@pytest.mark.parametrize(
    ("ready", "expected"),
    [
        # the highest priority with a ready deployment answers, alone
        (("big", "small-a", "small-b", "tiny"), ["big"]),
        # equal priorities are merged, so the scorer balances them
        (("small-a", "small-b", "tiny"), ["small-a", "small-b"]),
        (("small-b", "tiny"), ["small-b"]),
        # nothing behind the route is ready: its fallback answers
        (("tiny",), ["tiny"]),
        # a route's own targets win over its fallback whatever their priority
        (("small-a", "tiny"), ["small-a"]),
    ],
)
def test_priority_order_merge_and_fallback(ready: tuple[str, ...], expected: list[str]) -> None:
    upstreams = resolver(ready).candidates("chat")

    assert served_by(upstreams) == expected
    assert {u.model for u in upstreams} == {"chat"}  # the name the client asked for
    assert {u.engine_model for u in upstreams} == set(expected)  # what the engine serves


def test_a_route_named_like_its_service_needs_no_rewrite() -> None:
    routes = RouteResolver(Deployments(("chat",)))
    routes.load([route("chat", ("chat", 0))], ["chat"])
    (upstream,) = routes.candidates("chat")
    assert (upstream.model, upstream.engine_model) == ("chat", None)


def test_nothing_ready_is_a_503_naming_every_service_tried() -> None:
    with pytest.raises(NoReadyDeploymentError) as caught:
        resolver((), loading=("small-a",)).candidates("chat")

    error = caught.value
    assert error.model == "chat" and error.retry_after_s == 2.0
    message = str(error)
    assert message.startswith("model 'chat' has no ready deployment: services: big (not deployed)")
    assert "small-a (loading)" in message
    assert "fallback route 'backup': tiny (not deployed)" in message
    status, _, headers = error_from_exception(error)
    assert (status, headers) == (503, {"Retry-After": "2"})


class Unready(Deployments):
    """Like :class:`Deployments`; ``quiet`` has none ready and says nothing more, ``xl`` none
    ready with a reason that starts with an X."""

    def candidates(self, model: str) -> list[Upstream]:
        if model == "quiet":
            raise NoReadyDeploymentError(model, retry_after_s=3.0)
        if model == "xl":
            raise NoReadyDeploymentError(model, retry_after_s=3.0, detail="XL weights loading")
        return super().candidates(model)


def test_the_503_names_each_service_and_why_in_one_line() -> None:
    routes = RouteResolver(Unready((), loading=("small-a",)))
    routes.load(
        (route("chat", ("quiet", 9), ("xl", 9), ("small-a", 5), fallback="backup"), ROUTES[1]),
        ("quiet", "xl", "small-a", "tiny"),
    )
    with pytest.raises(NoReadyDeploymentError) as caught:
        routes.candidates("chat")
    assert str(caught.value) == (
        "model 'chat' has no ready deployment: services: quiet (none ready), xl (XL weights "
        "loading), small-a (loading); fallback route 'backup': tiny (not deployed)"
    )
    assert caught.value.retry_after_s == 2.0  # the shortest wait any service suggested


def test_a_route_with_nothing_deployed_suggests_the_default_wait() -> None:
    with pytest.raises(NoReadyDeploymentError) as caught:
        resolver(()).candidates("backup")
    assert caught.value.retry_after_s == ROUTE_RETRY_AFTER_S


@pytest.mark.parametrize("name", ["nope", "org/other:q4"])
def test_an_unknown_name_is_the_lifecycles_404(name: str) -> None:
    with pytest.raises(NotFoundError) as caught:
        resolver(("big",)).candidates(name)
    status, body, _ = error_from_exception(caught.value)
    assert status == 404 and b'"code":"model_not_found"' in body


@pytest.mark.parametrize("name", ["big", "spare"])
def test_a_services_own_name_is_not_public(name: str) -> None:
    with pytest.raises(UnroutedServiceError, match="clients reach through a route") as caught:
        resolver(("big", "spare")).candidates(name)
    status, body, _ = error_from_exception(caught.value)
    assert status == 404 and b'"code":"model_not_found"' in body


def test_a_services_own_name_is_refused_naming_it() -> None:
    with pytest.raises(UnroutedServiceError) as caught:
        resolver(("spare",)).candidates("spare")
    assert (caught.value.kind, caught.value.ident) == ("model", "spare")


def test_names_not_made_from_a_service_pass_through() -> None:
    routes = resolver(("big", "direct"))
    (upstream,) = routes.candidates("direct")
    assert (upstream.model, upstream.engine_model) == ("direct", None)


@pytest.mark.parametrize(
    ("ready", "models"),
    [
        # routes are listed whether or not something behind them is ready
        ((), ["backup", "chat"]),
        # ready names not made from a service are listed; services' names are not
        (("big", "direct", "tiny"), ["backup", "chat", "direct"]),
    ],
)
def test_models_lists_routes_and_direct_names(ready: tuple[str, ...], models: list[str]) -> None:
    assert resolver(ready).models() == models


def test_without_routes_the_lifecycles_names_are_unchanged() -> None:
    routes = RouteResolver(Deployments(("a", "b")))
    assert routes.models() == ["a", "b"]
    assert served_by(routes.candidates("a")) == ["a"]


def test_load_swaps_the_table() -> None:
    routes = resolver(("big",))
    routes.load([route("code", ("big", 0))], ["big"])
    assert routes.models() == ["code"]
    with pytest.raises(NotFoundError):
        routes.candidates("chat")


def test_a_fallback_loop_in_the_table_is_walked_once() -> None:
    # The store refuses loops; the resolver still never spins on one.
    table = RouteTable.build(
        [route("a", ("x", 0), fallback="b"), route("b", ("y", 0), fallback="a")], ["x", "y"]
    )
    assert table.chain("a") == ["a", "b"]
    routes = RouteResolver(Deployments(), table)
    with pytest.raises(NoReadyDeploymentError, match="fallback route 'b': y"):
        routes.candidates("a")


def test_tiers_group_equal_priorities_highest_first() -> None:
    table = RouteTable.build(ROUTES, SERVICES)
    assert table.tiers["chat"] == (("big",), ("small-a", "small-b"))
    assert table.chain("chat") == ["chat", "backup"]


@pytest.mark.parametrize(
    ("fallbacks", "name", "fallback", "loop"),
    [
        ({}, "a", "a", ("a", "a")),
        ({"b": None}, "a", "b", None),
        ({"b": "a", "a": None}, "a", "b", ("a", "b", "a")),
        ({"b": "c", "c": "a"}, "a", "b", ("a", "b", "c", "a")),
        # a loop elsewhere (b <-> c) that a does not close is not a's to refuse
        ({"b": "c", "c": "b"}, "a", "b", None),
        # the old fallback of a does not count: it is being replaced
        ({"a": "b", "b": None}, "a", "b", None),
    ],
)
def test_fallback_cycle(
    fallbacks: dict[str, str | None], name: str, fallback: str, loop: tuple[str, ...] | None
) -> None:
    assert fallback_cycle(fallbacks, name, fallback) == loop
