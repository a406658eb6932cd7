"""The store's own refusals beyond :mod:`berth.errors` (``StoreError``, ``NotFoundError``,
``ConflictError``, ``InvalidTransitionError``, which callers everywhere know)."""

from __future__ import annotations

from berth.errors import StoreError


class FencedError(StoreError):
    """A write refused because this leader's ``epoch`` is no longer the lease's.

    ``current`` is the lease row's epoch (0: no lease), ``active_address`` the address of
    the leader that holds it now, or ``None`` when no lease is live.  The leader that gets
    it has lost leadership: it must step down, not retry.
    """

    def __init__(self, epoch: int, current: int, active_address: str | None):
        self.epoch = epoch
        self.current = current
        self.active_address = active_address
        held = f"held by {active_address}" if active_address else "not held by anyone now"
        super().__init__(
            f"write refused: this leader's epoch {epoch} is not the lease's "
            f"(epoch {current}, {held}); it is no longer the active leader"
        )
