"""The state database check: can the leader open ``database_url``, and at what schema.

SQLite: a file not made yet is fine (the first daemon start makes it).  PostgreSQL: the
server must answer and take the URL's credentials.  The schema version is compared with the
one this berth knows: older is migrated at the next start (warn), newer is refused by it
(fail).  With ``leader_ha`` the lease is shown: who is active, under which epoch.
"""

from __future__ import annotations

import time
from pathlib import Path

from berth.config import Settings
from berth.doctor.check import Check
from berth.errors import BerthError
from berth.store import LATEST_VERSION, Store
from berth.store.db import is_sqlite, parse_database_url

_URL_HINT = "check database_url (berth config show), that the server runs and takes the login"


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
            lease = store.read_lease() if version >= 10 and settings.leader_ha else None
    except BerthError as exc:
        return Check("store", "fail", f"{shown}: {exc}", _URL_HINT)
    detail = f"{shown}: schema version {version}"
    if lease is not None:
        held = "held" if lease.live(time.time()) else "expired"
        detail += f"; leader lease {held} by {lease.address} (epoch {lease.epoch})"
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
