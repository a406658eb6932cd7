"""The agent link and who may hold one: how a leader and the agents on its other hosts reach
each other over one mutual-TLS WebSocket, and the certificates that say who each end is.

Its one job is the link between hosts; what travels on it (engine starts, tunneled requests)
is decided above, by the deployment manager and the proxy. Its parts, by reason to change,
bottom up (each a row of ``docs/architecture.md``'s layer table, which maps them):

- :mod:`.protocol` (layer 3): the sans-I/O core: frames and their codec, the ops, the session
  (``docs/protocol.md`` is its specification);
- :mod:`.link` (layer 4): the link adapter both ends run, shaped like websockets' connection;
- :mod:`.wire_forms` (layer 4): the wire forms of values other packages own (a host's GPUs, a
  model's shape), converted by both ends;
- :mod:`.pki` (layer 5): who may hold a link: the CA and its rotation, the CA shared by
  leaders in HA, enrollment, renewal, who is dialing, the direct data path's TLS;
- :mod:`.leader` (layer 6): the leader's side: the ``AgentLink`` interface it drives every
  node by, the live links, the listener and the hub that take agents, the link to one remote
  agent and the direct data path.

A part imports only the parts below it. The whole imports what lies below layer 6: the
runtime, the wire formats, the store, placement's values, observability's series and the
base modules; never the agent core (which implements ``AgentLink``), routing, the deployment
manager or the daemon, all above it. This module itself imports nothing.
"""
