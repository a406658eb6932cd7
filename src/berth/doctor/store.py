"""The state database check: can the leader open ``database_url``, and at what schema.

SQLite: a file not made yet is fine (the first daemon start makes it).  PostgreSQL: the
server must answer and take the URL's credentials.  The schema version is compared with the
one this berth knows: older is migrated at the next start (warn), newer is refused by it
(fail).  With ``leader_ha`` the lease is shown: who is active, under which epoch, and how
many leaders noted themselves within the lease; it fails when no leader holds the lease (no
leader serves: after a step-down with no standby, or with every leader stopped).
"""

from __future__ import annotations

import time
from pathlib import Path

from berth.config import Settings
from berth.doctor.check import Check
from berth.errors import BerthError
from berth.humanize import age
from berth.store import LATEST_VERSION, Store
from berth.store.db import is_sqlite, parse_database_url
from berth.store.lease import LeaseRecord

_URL_HINT = "check database_url (berth config show), that the server runs and takes the login"
_NO_LEADER_HINT = (
    "start a leader on this database (berth daemon start, or systemctl start berth-leader); "
    "berth leader status on each leader says what it sees"
)
#: The schema versions that added ``leader_lease`` and ``leader_members``.
_LEASE_VERSION, _MEMBERS_VERSION = 10, 14


def _no_leader(lease: LeaseRecord | None, now_s: float) -> str | None:
    """Why no leader serves the cluster (``leader_ha``: the lease is its only active), or
    ``None`` while one holds the lease at ``now_s``."""
    if lease is None:
        return "no leader holds the lease: none has ever taken it"
    if lease.live(now_s):
        return None
    return (
        f"no leader holds the lease: it ran out {age(now_s - lease.expires_at)} ago "
        f"(epoch {lease.epoch}, last held by {lease.address or lease.holder}); nothing is "
        "served until a leader takes it"
    )


def store_check(settings: Settings) -> Check:
    """One line for the store at ``settings.database_url``; never raises for what it
    checks."""
    try:
        url = parse_database_url(settings.database_url)
    except BerthError as exc:
        return Check("store", "fail", str(exc), _URL_HINT)
    shown = url.render_as_string(hide_password=True)
    if is_sqlite(url) and url.database and not Path(url.database).expanduser().exists():
        return Check("store", "ok", f"{shown}: none yet (made at the first daemon start)")
    try:
        with Store(settings.database_url) as store:
            version = store.schema_version()
            leased = settings.leader_ha and version >= _LEASE_VERSION
            lease = store.read_lease() if leased else None
            members = store.leader_members() if leased and version >= _MEMBERS_VERSION else []
    except BerthError as exc:
        return Check("store", "fail", f"{shown}: {exc}", _URL_HINT)
    detail = f"{shown}: schema version {version}"
    now_s = time.time()
    if leased:
        no_leader = _no_leader(lease, now_s)
        if no_leader is not None:
            return Check("store", "fail", f"{detail}; {no_leader}", _NO_LEADER_HINT)
        assert lease is not None  # _no_leader said it is held
        seen = [m for m in members if 0 <= now_s - m.seen_at < settings.leader_lease_s]
        detail += (
            f"; leader lease held by {lease.address} (epoch {lease.epoch}); "
            f"{len(seen)} leader(s) seen within the lease"
        )
    if version > LATEST_VERSION:
        return Check(
            "store",
            "fail",
            f"{detail}, newer than this berth knows ({LATEST_VERSION})",
            "upgrade berth, or point database_url at another database",
        )
    if version < LATEST_VERSION:
        return Check(
            "store",
            "warn",
            f"{detail}; {LATEST_VERSION} after the migrations the next daemon start applies",
            "berth daemon start",
        )
    return Check("store", "ok", detail)
