"""The agent link protocol, sans-I/O: frames and their codec, control ops, the session.

``docs/protocol.md`` is the specification. Nothing in this package awaits or touches a
socket; ``berth.cluster.leader.hub`` (leader) and ``berth.agent.dialer`` (agent) pump WebSocket
messages through :class:`~berth.cluster.protocol.session.LinkSession`.
"""
