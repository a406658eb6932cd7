"""What every serving process on one host shares without a round trip: the per-key
admission counters, the per-deployment requests in flight and engine slots, and the
affinity records (prompt prefixes, sessions), each counted once for the host whichever
process admits, routes or relays the request.

Two kinds behind the seams of ``admission`` and ``routing`` (constructor injection):

- **in process** (the default, today's behaviour at no extra cost): the key's own fields
  (:data:`~berth.host.keys.LOCAL_KEYS`), and the dictionaries of
  :class:`~berth.admission.fair_queue.SlotScheduler`,
  :class:`~berth.routing.signals.SignalBoard`,
  :class:`~berth.routing.prefix_index.PrefixIndex` and
  :class:`~berth.routing.affinity.AffinityMap` when they are given no shared table;
- **shared** (:class:`~berth.host.state.HostState`): one mapped file made by the supervisor
  (:meth:`HostState.create`) and attached to by each worker (:meth:`HostState.attach`),
  fixed-size open-addressing tables with ``fcntl`` row locks (:mod:`.region`), a column per
  worker for what a process holds, so :meth:`HostState.reclaim` gives back all a dead worker
  held, and a datagram socket per worker to wake it when a slot is handed to it
  (:mod:`.wake`).

Modules: :mod:`.region` (the file, its locks, the tables), :mod:`.keys` (per-key counters),
:mod:`.deployments` (in flight, slots, the hand-over of slots across processes and how fair
it is), :mod:`.prefixes` and :mod:`.affinity` (the routing records), :mod:`.wake`,
:mod:`.state` (the whole, made and attached to), :mod:`.errors`. What each does when its
table is full is in its docstring. The package imports only the base layer.
"""

from berth.host.errors import HostFileError, HostStateError
from berth.host.keys import LOCAL_KEYS, CountedKey, KeyCounters, LocalKeyCounters
from berth.host.state import HostState

__all__ = [
    "LOCAL_KEYS",
    "CountedKey",
    "HostFileError",
    "HostState",
    "HostStateError",
    "KeyCounters",
    "LocalKeyCounters",
]
