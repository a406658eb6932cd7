"""The store's own refusals beyond :mod:`berth.errors` (``StoreError``, ``NotFoundError``,
``ConflictError``, ``InvalidTransitionError``, which callers everywhere know): those of
shared leadership (:mod:`berth.store.lease`, :mod:`berth.store.leadership`)."""

from __future__ import annotations

from berth.errors import BerthError, StoreError


class FencedError(StoreError):
    """A write refused because this leader's ``epoch`` is no longer the lease's.

    ``current`` is the lease row's epoch (0: no lease), ``active_address`` the address of
    the leader that holds it now, or ``None`` when no lease is live.  The leader that gets
    it has lost leadership: it must step down, not retry.  Through the APIs: 503.
    """

    http_status = 503
    error_code = "not_active_leader"

    def __init__(self, epoch: int, current: int, active_address: str | None):
        self.epoch = epoch
        self.current = current
        self.active_address = active_address
        held = f"held by {active_address}" if active_address else "not held by anyone now"
        super().__init__(
            f"write refused: this leader's epoch {epoch} is not the lease's "
            f"(epoch {current}, {held}); it is not the active leader"
        )


class StandbyError(BerthError):
    """A request a standby leader does not serve: 503 with ``Retry-After``
    (``retry_after_s``), naming the active leader's ``active_address`` when there is one."""

    http_status = 503
    error_code = "standby_leader"

    def __init__(self, active_address: str | None, *, retry_after_s: float):
        self.active_address = active_address
        self.retry_after_s = retry_after_s
        if active_address:
            message = f"this berth leader is a standby; the active leader is at {active_address}"
        else:
            message = "no berth leader is active right now (a standby is taking over)"
        super().__init__(f"{message}; retry in {max(1, round(retry_after_s))} s")


class StoreDeadlineError(StoreError):
    """A database call that outlived its deadline (``call_s`` seconds) and was cut
    (:mod:`berth.store.deadlines`); its connection was discarded.  Through the APIs: 503."""

    http_status = 503

    def __init__(self, call_s: float):
        self.call_s = call_s
        super().__init__(
            f"database error: no answer within the call's {call_s:g} s deadline "
            "(the database or the network to it stopped answering)"
        )


class NotControllerError(BerthError):
    """A control command (deployments started or stopped, nodes, services, routes, the CA
    ...) sent to a leader that is not the controller (shared leadership: it does not hold
    the lease).  Names the controller's address (``None`` while no lease is live) and the
    lease's ``epoch``.  Through the APIs: 409 ``not_controller``; nothing was changed."""

    http_status = 409
    error_type = "invalid_request_error"
    error_code = "not_controller"
    exit_code = 2

    def __init__(self, controller_address: str | None, epoch: int):
        self.controller_address = controller_address
        self.epoch = epoch
        if controller_address:
            where = f"control commands go to the controller at {controller_address} (epoch {epoch})"
        else:
            where = "no leader is the controller right now (a standby is taking over); retry"
        super().__init__(f"this berth leader is a standby member, not the controller; {where}")
