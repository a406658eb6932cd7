"""The leader's live links, by node id: one object shared by everything that reaches nodes.

The hub attaches a remote agent's link when it says Hello and detaches it when the link
ends; the daemon attaches node ``local``'s in-process link at start-up.  The lifecycle
manager and the admin API look links up; whoever must hear of a link coming or going (the
router, which forgets a lost node's affinity) watches the registry, given to it when it is
built.  Nothing else holds a table of links.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from berth.cluster.leader.agent_link import AgentLink

#: Hears ``(node_id, link)`` after every change: the node's link now, ``None`` once it has
#: none.  Called synchronously by :meth:`LinkRegistry.attach` and :meth:`LinkRegistry.detach`,
#: so it must not block; what it raises reaches the caller of that method.
LinkWatcher = Callable[[str, AgentLink | None], None]


class LinkRegistry:
    """Live :class:`AgentLink` objects by node id, at most one per node.

    ``links`` are attached at once (no watcher hears of them).
    """

    def __init__(self, links: Iterable[AgentLink] = ()) -> None:
        self._links: dict[str, AgentLink] = {link.node_id: link for link in links}
        self._watchers: list[LinkWatcher] = []

    def get(self, node_id: str) -> AgentLink | None:
        """The node's live link, or ``None`` when it has none."""
        return self._links.get(node_id)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._links

    def __iter__(self) -> Iterator[AgentLink]:
        """The links at this moment (a copy: attaching or detaching meanwhile is safe)."""
        return iter(list(self._links.values()))

    def __len__(self) -> int:
        return len(self._links)

    def node_ids(self) -> list[str]:
        """The ids of the nodes with a live link, sorted."""
        return sorted(self._links)

    def is_current(self, link: AgentLink) -> bool:
        """Whether ``link`` is still its node's link (not detached, not replaced by a newer
        session): work begun over a link checks this before it changes shared state."""
        return self._links.get(link.node_id) is link

    def attach(self, link: AgentLink) -> AgentLink | None:
        """Make ``link`` its node's link; returns the one it replaces (``None``: none).

        The replaced link is not closed here: its owner (the hub) closes it.
        """
        previous = self._links.get(link.node_id)
        self._links[link.node_id] = link
        self._tell(link.node_id, link)
        return previous

    def detach(self, link: AgentLink) -> bool:
        """Forget ``link`` if it is still its node's link; whether it was.

        A link that was already replaced by a newer one changes nothing, so the end of a
        superseded session never takes the node's new link away.
        """
        if not self.is_current(link):
            return False
        del self._links[link.node_id]
        self._tell(link.node_id, None)
        return True

    def watch(self, watcher: LinkWatcher) -> Callable[[], None]:
        """Call ``watcher`` after every attach and detach from now on; returns a function
        that stops it."""
        self._watchers.append(watcher)

        def unwatch() -> None:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

        return unwatch

    def _tell(self, node_id: str, link: AgentLink | None) -> None:
        for watcher in list(self._watchers):
            watcher(node_id, link)
