"""Admission: what a key may do, checked on the request path before the router, and what
it did, kept in the usage ledger.

- :mod:`.quotas`: :class:`Admission` (admit, settle; per-key limits and counters in
  memory), :class:`KeyUse`; :mod:`.key_quota`: one key's limits and counters
  (:class:`KeyQuota`), an admitted request's :class:`Ticket` and the body bytes a
  request holds (:class:`BodyHold`);
- :mod:`.bucket`: the per-minute limits as token buckets; :mod:`.calendar`: UTC days and
  months of the token budgets; :mod:`.estimate`: the token estimates;
- :mod:`.headers`: OpenAI's rate-limit headers and duration format;
- :mod:`.ledger`: the usage buffer written to the store in batches;
- :mod:`.metrics`: the per-key Prometheus series; :mod:`.errors`: the refusals;
- :mod:`.clock`: the clocks (a manual one for tests);
- :mod:`.socket`: who calls over the Unix socket (:class:`SocketCaller`: the CLI, the desk
  worker), told by a header only that listener reads;
- fair admission: :mod:`.capacity` (a deployment's slots at the gate: its service's
  setting, its engine's flags or default, else the ``default_slots`` setting),
  :mod:`.fair_queue` (:class:`SlotScheduler`: the slots and the queue fair across keys,
  pure) and :mod:`.gate` (:class:`SlotGate`: the async wait in front of it).

A request passes :meth:`Admission.admit`, then, once the router has planned it, waits for a
slot at one of its deployments (:meth:`SlotGate.acquire`, ordered by :attr:`Ticket.priority`
and round-robin across keys), then is answered, and :meth:`Admission.settle` accounts for
it. The package sits beside ``observability`` (layer 5): it uses the tiers of ``config`` and
the key and usage records of the vocabulary (:mod:`berth.vocab.records`), and nothing of
the store, the cluster or the daemon.
"""

from berth.admission.capacity import DEFAULT_SLOTS, GateSlots, gate_slots
from berth.admission.clock import Clock, ManualClock, SystemClock
from berth.admission.errors import (
    AdmissionError,
    KeyExpiredError,
    KeyPausedError,
    ModelNotAllowedError,
    QueueFullError,
    QueueRefusedError,
    QueueTimeoutError,
    QuotaExceededError,
)
from berth.admission.fair_queue import SlotScheduler, Waiter
from berth.admission.gate import MUST_WAIT, QueueStats, SlotGate
from berth.admission.key_quota import BodyHold, Ticket
from berth.admission.ledger import DEFAULT_FLUSH_INTERVAL_S, UsageLedger, UsageSink
from berth.admission.metrics import QueueCollector, UsageCollector
from berth.admission.quotas import SOCKET_KEY_ID, SOCKET_KEY_NAME, Admission, KeyUse
from berth.admission.socket import SOCKET_CALLER_HEADER, SocketCaller, socket_caller

__all__ = [
    "DEFAULT_FLUSH_INTERVAL_S",
    "DEFAULT_SLOTS",
    "MUST_WAIT",
    "SOCKET_CALLER_HEADER",
    "SOCKET_KEY_ID",
    "SOCKET_KEY_NAME",
    "Admission",
    "AdmissionError",
    "BodyHold",
    "Clock",
    "GateSlots",
    "KeyExpiredError",
    "KeyPausedError",
    "KeyUse",
    "ManualClock",
    "ModelNotAllowedError",
    "QueueCollector",
    "QueueFullError",
    "QueueRefusedError",
    "QueueStats",
    "QueueTimeoutError",
    "QuotaExceededError",
    "SlotGate",
    "SlotScheduler",
    "SocketCaller",
    "SystemClock",
    "Ticket",
    "UsageCollector",
    "UsageLedger",
    "UsageSink",
    "Waiter",
    "gate_slots",
    "socket_caller",
]
