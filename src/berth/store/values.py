"""Values the store's method groups share: the :data:`UNCHANGED` default of update
arguments, fresh row ids, stored times read back as aware UTC datetimes and not-found
errors with a message of their own."""

from __future__ import annotations

import enum
import secrets
from datetime import UTC, datetime
from typing import Final, Literal

from sqlalchemy.orm import Session

from berth.errors import NotFoundError, StoreError
from berth.store.tables import ApiKeyRow, DeploymentRow


class Unchanged(enum.Enum):
    """Type of :data:`UNCHANGED`, the "leave this column as it is" default."""

    UNCHANGED = enum.auto()


#: Default of optional update arguments: keep the stored value (``None`` clears it).
UNCHANGED: Final = Unchanged.UNCHANGED

#: Random ids tried before giving up (a clash among 2**32 is rare; eight in a row, absurd).
_ID_ATTEMPTS = 8


def fresh_id(
    session: Session, table: type[DeploymentRow] | type[ApiKeyRow], prefix: Literal["d-", "k-"]
) -> str:
    """An id for a new row of ``table``: ``prefix`` + 8 hex digits no row has yet.  Raises
    :class:`StoreError` when every attempt clashed."""
    for _ in range(_ID_ATTEMPTS):
        candidate = prefix + secrets.token_hex(4)
        if session.get(table, candidate) is None:
            return candidate
    raise StoreError(f"could not find a free {prefix}… id")  # pragma: no cover


def aware(value: datetime) -> datetime:
    """A stored time as an aware UTC datetime (SQLite gives naive ones back; rows built in
    this process still hold the clock's value)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def not_found(kind: str, ident: str, message: str) -> NotFoundError:
    """A :class:`NotFoundError` for ``kind``/``ident`` whose text is ``message``."""
    error = NotFoundError(kind, ident)
    error.args = (message,)
    return error
