"""The leader's hub of agent links (skeleton; the lead engineer is filling this in).

``NodeHub`` owns the live WebSocket session of every connected agent.
"""

from __future__ import annotations

from aiohttp import web


class NodeHub:
    """Live agent sessions by node id."""

    def is_connected(self, node_id: str) -> bool:
        return False

    async def disconnect_node(self, node_id: str) -> None:
        """Close the node's live link at once (close code ``node removed``); no-op if none."""

    async def handle_agent(self, request: web.Request) -> web.StreamResponse:
        """The ``/cluster/agent`` WebSocket endpoint."""
        raise web.HTTPServiceUnavailable(text="agent links are not served yet")
