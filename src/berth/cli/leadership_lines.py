"""What the CLI says of shared leadership: which leader is the controller, and where.

``berth daemon start`` says whether its leader joined as the controller (the lease holder)
or as a standby member, and on which database (:func:`role_line`, :func:`database_line`).
``berth status`` and ``berth leader status`` on a host whose leader is stopped still name
the controller when leadership is shared: the database's lease row knows it
(:func:`controller_from_database`).
"""

from __future__ import annotations

import time

from berth.api import LeaderStatus
from berth.cli.common import console
from berth.config import Settings
from berth.errors import BerthError, StoreError
from berth.paths import BerthHome
from berth.redact import mask_url_password
from berth.store import Store


def database_line(settings: Settings) -> str:
    """The state database's URL, its password masked."""
    return mask_url_password(settings.database_url)


def role_line(leader: LeaderStatus) -> str:
    """``controller (holds the lease, epoch 3)``, ``standby member: the controller is
    https://a.lan:11500 (epoch 3)``, or, without ``leader_ha``, ``controller (the only
    leader: leader_ha is off)``."""
    if not leader.ha:
        return "controller (the only leader: leader_ha is off)"
    if leader.role == "active":
        return f"controller (holds the lease, epoch {leader.epoch})"
    if leader.active_address:
        return (
            f"standby member: serves once it takes the lease; the controller is "
            f"{leader.active_address} (epoch {leader.epoch})"
        )
    return "standby member: no leader holds the lease yet (this one may take it at its next look)"


def controller_from_database(settings: Settings, *, now_s: float | None = None) -> str | None:
    """With ``leader_ha``, a line naming the controller as the database's lease row has it
    (``controller https://a.lan:11500 (epoch 3, lease renewed 0.4 s ago) per
    postgresql://berth:***@db/berth``), or saying none holds it, or that the database did
    not answer; ``None`` without ``leader_ha`` (a lone leader's database says nothing more
    than its socket)."""
    if not settings.leader_ha:
        return None
    database = database_line(settings)
    now_s = time.time() if now_s is None else now_s
    try:
        store = Store(settings.database_url)
        try:
            lease = store.read_lease()
        finally:
            store.close()
    except StoreError as exc:
        return f"controller unknown: the database {database} did not answer ({exc})"
    if lease is None:
        return f"no controller: no leader ever took the lease in {database}"
    if not lease.live(now_s):
        return (
            f"no controller now: the last, {lease.address} (epoch {lease.epoch}), let its "
            f"lease lapse {now_s - lease.expires_at:.1f} s ago, per {database}"
        )
    return (
        f"controller {lease.address} (epoch {lease.epoch}, lease renewed "
        f"{max(0.0, now_s - lease.renewed_at):.1f} s ago) per {database}"
    )


def say_controller_when_stopped(home: BerthHome) -> None:
    """On a host whose leader does not answer: print the controller per the database when
    leadership is shared (see :func:`controller_from_database`); settings that do not load
    say nothing here (the caller's own error follows)."""
    try:
        settings = Settings.load(home)
    except BerthError:
        return
    line = controller_from_database(settings)
    if line is not None:
        console.print(f"this leader is not running; {line}", soft_wrap=True, markup=False)
