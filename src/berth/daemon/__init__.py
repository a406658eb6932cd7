"""The leader daemon's wiring: build the object graph from settings, serve the listeners.

Owns the leader you build, start and stop (:mod:`.server`: :class:`~berth.daemon.server.Leader`),
its builder (:mod:`.build`, from the small builders of :mod:`.pieces`; the sockets bound
first by :mod:`.sockets`), the leader's object graph (:mod:`.graph`:
:class:`~berth.daemon.graph.LeaderGraph`, built once and frozen), the admin app with each
router given the graph's objects it uses (:mod:`.admin_routes`), the listeners' request
handler (:mod:`.app`: ``/v1`` to the gateway, the rest to the admin app), shared leadership
(:mod:`.ha`, :mod:`.leader_roster`), the public listener's TLS (:mod:`.public_tls`) and the
leader's service unit (:mod:`.systemd_unit`). The subsystems it wires live in
:mod:`berth.gateway` (the ``/v1`` request path), :mod:`berth.deployments` (the deployment
manager) and :mod:`berth.admin` (the admin and console routes).

May import every layer below it; nothing below imports it (the graph stays here).
"""
