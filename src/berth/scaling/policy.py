"""The leader-wide scaling settings, as the controller and the on-demand stage use them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from berth.vocab.slots import ASSUMED_SLOTS

#: Defaults of the settings of the same names (``docs/fleet.md``).
DEFAULT_LOAD_WAIT_S: Final = 120.0
DEFAULT_LOAD_QUEUE_MAX: Final = 256
DEFAULT_SCALE_OUT_AFTER_S: Final = 15.0
DEFAULT_SCALING_INTERVAL_S: Final = 1.0


@dataclass(frozen=True)
class ScalingPolicy:
    """How the controller and the on-demand stage behave.

    ``load_wait_s``: how long a request waits at the leader for its service to load before
    it is answered 503.  ``load_queue_max``: how many requests may wait for one service at
    once (the next is answered 503 at once).  ``scale_out_after_s``: how long every replica
    must have had its capacity in flight or queued before another starts.
    ``interval_s``: seconds between the controller's looks at every service.
    ``retry_after_s``: the ``Retry-After`` of a 503 for a load.  ``failed_load_hold_s``:
    for this long after a load failed, a new request for the service is answered 503 with
    that failure instead of starting another load (an engine that cannot start is not
    restarted by every request).  ``default_slots``: a replica's capacity when neither its
    service nor its engine says (the setting of that name, as the fair admission gate
    holds it).
    """

    load_wait_s: float = DEFAULT_LOAD_WAIT_S
    load_queue_max: int = DEFAULT_LOAD_QUEUE_MAX
    scale_out_after_s: float = DEFAULT_SCALE_OUT_AFTER_S
    interval_s: float = DEFAULT_SCALING_INTERVAL_S
    retry_after_s: float = 5.0
    failed_load_hold_s: float = 10.0
    default_slots: int = ASSUMED_SLOTS
