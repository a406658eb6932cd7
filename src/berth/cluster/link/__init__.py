"""The link adapter both ends run: one agent link's WebSocket over the sans-I/O session.

Its one job is carrying :mod:`berth.cluster.protocol`'s session over a WebSocket, shaped
like websockets' ``asyncio`` connection: :mod:`.connection` (``LinkConnection``: the
handshake, typed calls, the reader and the link's end, with the pending calls and the
link's tasks), its writer (:mod:`.link_output`, :mod:`.write_batch`), its streams
(:mod:`.link_streams`, :mod:`.tunnel_stream`) and its liveness (:mod:`.liveness`). The
agent's dialer and the leader's hub each hold one ``LinkConnection`` per link.

May import :mod:`berth.cluster.protocol`, aiohttp and the standard library only (layer 4 of
``docs/architecture.md``): nothing of the certificates (:mod:`berth.cluster.pki`), the
leader's side (:mod:`berth.cluster.leader`), the store or the runtime, so an agent carries
it as it is.
"""
