"""The leader daemon's wiring: build the object graph from settings, serve the listeners.

Owns the leader you build, start and stop (:mod:`.server`: :class:`~berth.daemon.server.Leader`),
its builder (:mod:`.build`, from the small builders of :mod:`.pieces`; the sockets bound
first by :mod:`.sockets`), the leader's object graph (:mod:`.graph`:
:class:`~berth.daemon.graph.LeaderGraph`, the long-lived objects the apps share), the
listeners' request handler (:mod:`.app`: ``/v1`` to the gateway, the rest to
the admin app) and the public listener's TLS (:mod:`.public_tls`). The subsystems it wires
live in :mod:`berth.gateway` (the ``/v1`` request path), :mod:`berth.deployments` (the
deployment manager) and :mod:`berth.admin` (the admin and console routes).

May import every layer below it. :mod:`.graph` is a layer of its own under
:mod:`berth.admin` (the admin routes take the graph), so it may import only
:mod:`berth.gateway`, :mod:`berth.deployments` and what lies below them.
"""
