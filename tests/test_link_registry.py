"""The leader's registry of live links: one per node, a superseded session's end changes
nothing, and whoever watches hears each change (the router forgets a lost node's affinity)."""

from __future__ import annotations

from berth.cluster.leader.agent_link import AgentLink
from berth.cluster.leader.link_registry import LinkRegistry
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from support.fakes import FakeLink


def test_attach_replace_and_detach_keep_one_link_per_node() -> None:
    local, first, second = FakeLink(), FakeLink("n-1"), FakeLink("n-1")
    links = LinkRegistry([local])
    seen: list[tuple[str, AgentLink | None]] = []
    links.watch(lambda node_id, link: seen.append((node_id, link)))
    assert links.attach(first) is None
    assert links.attach(second) is first  # a newer session of the same node
    assert (links.get("n-1"), len(links), links.node_ids()) == (second, 2, ["local", "n-1"])
    assert not links.is_current(first) and links.is_current(second)
    assert links.detach(first) is False  # the old session ending takes nothing away
    assert links.get("n-1") is second
    assert links.detach(second) is True
    assert "n-1" not in links and list(links) == [local]
    assert seen == [("n-1", first), ("n-1", second), ("n-1", None)]


def test_a_watcher_stops_hearing_once_unwatched_and_iteration_is_a_snapshot() -> None:
    links = LinkRegistry([FakeLink("n-1"), FakeLink("n-2")])
    seen: list[str] = []
    unwatch = links.watch(lambda node_id, _link: seen.append(node_id))
    for link in links:  # detaching while iterating is safe
        links.detach(link)
    unwatch()
    links.attach(FakeLink("n-3"))
    assert seen == ["n-1", "n-2"] and links.node_ids() == ["n-3"]


def test_the_router_forgets_the_affinity_of_a_node_whose_link_goes() -> None:
    agent = FakeLink("n-1")
    links = LinkRegistry([FakeLink(), agent])
    router = Router(_NoModels(), links=links)
    router.affinity.record("session-a", "n-1")
    router.affinity.record("session-b", "local")
    links.attach(FakeLink("n-1"))  # superseded, not lost: kept
    assert router.affinity.peek("session-a") == "n-1"
    links.detach(links.get("n-1") or agent)
    assert router.affinity.peek("session-a") is None
    assert router.affinity.peek("session-b") == "local"


class _NoModels:
    def candidates(self, model: str) -> list[Upstream]:
        raise AssertionError("not asked here")

    def models(self) -> list[str]:
        return []
