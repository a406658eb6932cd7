"""The agent link and who may hold one: how a leader and the agents on its other hosts reach
each other over one mutual-TLS WebSocket, and the certificates that say who each end is.

Its one job is the link between hosts; what travels on it (engine starts, tunneled requests)
is decided above, by the deployment manager and the proxy. Its parts, by reason to change:

- the sans-I/O core, :mod:`.protocol`: frames and their codec, the ops, the session
  (``docs/protocol.md`` is its specification);
- the link adapter both ends run, shaped like websockets' connection: :mod:`.connection` (the
  WebSocket adapter over a session), its writer (:mod:`.write_batch`, :mod:`.link_output`),
  its streams (:mod:`.link_streams`, :mod:`.tunnel_stream`), its calls (:mod:`.link_calls`),
  its tasks (:mod:`.link_tasks`) and its liveness (:mod:`.liveness`);
- the certificates: the CA (:mod:`.ca`, :mod:`.ca_rotation`, shared by leaders in HA through
  :mod:`.bootstrap`), enrollment of a new host (:mod:`.enrollment`), renewal of short-lived
  agent certificates (:mod:`.renewal`), who is dialing (:mod:`.peer_identity`,
  :mod:`.node_identity`) and the direct data path's TLS (:mod:`.direct_tls`);
- the leader's side: the interface it drives every node by (:mod:`.link`: ``AgentLink``, for
  node ``local`` too) and its live links (:mod:`.link_registry`), the listener and the hub
  that take agents (:mod:`.listener`, :mod:`.hub`, :mod:`.dial_limit`), the link to one
  remote agent (:mod:`.remote_link`) and the data path that goes straight to an agent's
  ingress when it can (:mod:`.direct_path`);
- the wire forms of values other packages own: a host's inventory (:mod:`.inventory`) and a
  model's shape (:mod:`.shape_wire`).

May import what lies below it (layer 8 of ``docs/architecture.md``): the runtime, the wire
formats, the store, placement's values, observability's series and the base modules; never
the agent core (which implements its interfaces), routing, the deployment manager or the
daemon, all above it.
"""
