"""Admission: what a key may do, checked on the request path before the router, and what
it did, kept in the usage ledger.

- :mod:`.quotas`: :class:`Admission` (admit, settle; per-key limits and counters in
  memory), :class:`Ticket`, :class:`KeyUse`;
- :mod:`.bucket`: the per-minute limits as token buckets; :mod:`.calendar`: UTC days and
  months of the token budgets; :mod:`.estimate`: the token estimates;
- :mod:`.headers`: OpenAI's rate-limit headers and duration format;
- :mod:`.ledger`: the usage buffer written to the store in batches;
- :mod:`.metrics`: the per-key Prometheus series; :mod:`.errors`: the refusals;
- :mod:`.clock`: the clocks (a manual one for tests).

A request passes :meth:`Admission.admit`, then waits for a slot at a deployment (the fair
admission queue, ordered by :attr:`Ticket.priority`), then is answered, and
:meth:`Admission.settle` accounts for it. The package sits beside ``routing`` (layer 9): it
uses the tiers of ``config``, the records of ``store``, and nothing of the daemon.
"""

from berth.admission.clock import Clock, ManualClock, SystemClock
from berth.admission.errors import (
    AdmissionError,
    KeyExpiredError,
    KeyPausedError,
    ModelNotAllowedError,
    QuotaExceededError,
)
from berth.admission.ledger import DEFAULT_FLUSH_INTERVAL_S, UsageLedger, UsageSink
from berth.admission.metrics import UsageCollector
from berth.admission.quotas import (
    SOCKET_KEY_ID,
    SOCKET_KEY_NAME,
    Admission,
    KeyUse,
    Ticket,
)

__all__ = [
    "DEFAULT_FLUSH_INTERVAL_S",
    "SOCKET_KEY_ID",
    "SOCKET_KEY_NAME",
    "Admission",
    "AdmissionError",
    "Clock",
    "KeyExpiredError",
    "KeyPausedError",
    "KeyUse",
    "ManualClock",
    "ModelNotAllowedError",
    "QuotaExceededError",
    "SystemClock",
    "Ticket",
    "UsageCollector",
    "UsageLedger",
    "UsageSink",
]
