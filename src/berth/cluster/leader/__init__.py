"""The leader's side of the agent links: the interface it drives every node by, and the links.

``AgentLink`` (:mod:`.agent_link`, for node ``local`` too) and the live links
(:mod:`.link_registry`), the listener and the hub that take agents, the link to one remote
agent (:mod:`.remote_link`) and the data path straight to an agent's ingress
(:mod:`.direct_path`).
"""
