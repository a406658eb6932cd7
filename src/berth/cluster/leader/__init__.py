"""The leader's side of the agent links: the interface it drives every node by, and the links.

Its one job is the leader's end of every link: ``AgentLink`` and the values its calls
return (:mod:`.agent_link`, for node ``local`` too), the live links by node
(:mod:`.link_registry`), the listener and the hub that take agents (:mod:`.listener`,
:mod:`.hub`, :mod:`.dial_limit`), the link to one remote agent (:mod:`.remote_link`) and the
data path straight to an agent's ingress (:mod:`.direct_path`).

May import (layer 6 of ``docs/architecture.md``) the rest of ``cluster`` (protocol, link,
wire forms, pki), observability's series (the hub feeds heartbeats to them), the store, the
runtime's and placement's values, the engine HTTP client and the base modules; never the
agent core (which implements ``AgentLink``), routing, the deployment manager or the daemon.
"""
