"""Secrets kept out of what people read: error messages, log lines, ``berth config show``.

A setting marked secret (``berth.config.table``, ``SettingDef.mask``) is shown through one
of these: the password of a URL (``database_url``), or the whole value (``cluster_secret``).
The store masks a database URL in its own errors with :func:`mask_url_password` too, since
it sits beside the settings and not above them.
"""

from __future__ import annotations

import re
from typing import Final

#: What a masked secret reads as.
MASK: Final = "***"

# ``scheme://user:password@``: the password runs to the last "@" before white space or a
# quote, so one holding "@", ":" or "/" (SQLAlchemy's URL parser allows all three) is
# masked whole, and a URL quoted inside a message (``'postgresql://u:p@h/db'``) stops at
# its quote.
_URL_USERINFO = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:@/\s'\"]*):(?P<password>[^\s'\"]*)@"
)


def mask_url_password(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@...`` in it replaced by
    :data:`MASK` (``postgresql+psycopg://berth:***@db.lan/berth``); text without one is
    returned unchanged."""
    return _URL_USERINFO.sub(lambda found: f"{found['head']}:{MASK}@", text)


def quoted_url(text: str) -> str:
    """A URL as a message may quote it: ``repr`` of :func:`mask_url_password`, or, when an
    "@" is left that no ``scheme://user:password@`` accounts for (a URL too malformed to
    tell its password from its host), a note that it is not shown."""
    masked = mask_url_password(text)
    if "@" in masked.replace(f":{MASK}@", ""):
        return "(not shown: malformed around its '@', and it may hold a password)"
    return repr(masked)


def mask_all(_text: str) -> str:
    """:data:`MASK`, whatever the value: for a setting that is a secret whole."""
    return MASK


def mask_header_values(text: str) -> str:
    """``key=value,...`` headers (``tracing_headers``) with each value masked and the names
    kept: ``authorization=***,x-tenant=***``."""
    return ",".join(pair.partition("=")[0] + "=" + MASK for pair in text.split(","))
