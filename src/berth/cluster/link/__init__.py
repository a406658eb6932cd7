"""The link adapter both ends run: one agent link's WebSocket over the sans-I/O session.

Shaped like websockets' ``asyncio`` connection: :mod:`.connection` (``LinkConnection``, the
adapter over :mod:`berth.cluster.protocol`'s session), its writer, its streams, its calls,
its tasks and its liveness. The agent's dialer and the leader's hub each hold one per link.

May import the protocol, the engine HTTP client's values and the layers below ``cluster``;
nothing of the leader's side (``cluster.leader``) or of the certificates (``cluster.pki``).
"""
