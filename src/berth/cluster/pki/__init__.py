"""Who may hold an agent link: the cluster's CA and every certificate it signs.

Its one job is identity on the link: the berth CA (:mod:`.ca`) and its rotation
(:mod:`.ca_rotation`), the CA and key pepper shared by leaders in HA through the store
(:mod:`.bootstrap`), enrollment of a new host (:mod:`.enrollment`), renewal of short-lived
agent certificates (:mod:`.renewal`), who is dialing and which node that is
(:mod:`.peer_identity`, :mod:`.node_identity`) and the direct data path's TLS
(:mod:`.direct_tls`). The agent reads the CA's fingerprints and the enrollment URI from it
too.

May import (layer 5 of ``docs/architecture.md``) :mod:`berth.cluster.link` (renewal is an
op served over a link), :mod:`berth.cluster.protocol`, the store and the vocabulary,
cryptography and the base modules; never :mod:`berth.cluster.leader`, which uses it, nor
``admission`` or ``observability`` beside it.
"""
