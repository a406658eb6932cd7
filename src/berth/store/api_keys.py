"""API keys: stored by hash only, with a name, a tier, limit overrides and an expiry.

:class:`ApiKeyMethods` is mixed into :class:`berth.store.Store`.  A key is found by the
hash of its secret when a request authenticates (:meth:`ApiKeyMethods.find_api_key`) and
by its id or name when an operator manages it (:meth:`ApiKeyMethods.lookup_api_key`).
Every change is recorded for the other leaders on the database (:mod:`berth.store.changes`,
topic ``keys``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from berth.errors import ConflictError, NotFoundError
from berth.keys import validate_key_name
from berth.store.changes import KEYS_TOPIC, record_change
from berth.store.tables import ApiKeyRow
from berth.store.values import UNCHANGED, Unchanged, aware, fresh_id
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import ApiKeyRecord
from berth.vocab.roles import Role, parse_role, parse_tier, role_of_tier


class ApiKeyMethods:
    """Store methods for API keys (see the module doc)."""

    _clock: Callable[[], datetime]

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def add_api_key(
        self,
        name: str,
        tier: str,
        key_hash: str,
        prefix: str,
        *,
        limits: LimitOverrides = LimitOverrides(),
        expires_at: datetime | None = None,
        role: str | None = None,
    ) -> ApiKeyRecord:
        """Record a key by its hash (see :func:`berth.keys.hash_secret`); id ``k-`` + 8 hex.

        ``limits`` are the key's own values over its tier's; ``expires_at`` (aware) the
        moment it stops authenticating; ``role`` an admin key's role (default ``admin``;
        :func:`berth.vocab.roles.role_of_tier`).  Raises :class:`ConfigError` for an invalid tier
        name, a role for a key of another tier or an unknown one, or an unsafe name
        (:func:`berth.keys.validate_key_name`) and :class:`ConflictError` when the hash is
        already stored.  Whether the tier exists is the caller's to check.
        """
        parsed_tier = parse_tier(tier)
        parsed_role = role_of_tier(parsed_tier, role)
        validate_key_name(name)
        with self._write() as session:
            existing = session.scalars(select(ApiKeyRow.id).where(ApiKeyRow.key_hash == key_hash))
            if existing.first() is not None:
                raise ConflictError("an API key with this hash already exists")
            row = ApiKeyRow(
                id=fresh_id(session, ApiKeyRow, "k-"),
                name=name,
                tier=parsed_tier,
                key_hash=key_hash,
                prefix=prefix,
                created_at=self._clock(),
                revoked_at=None,
                limits=limits.to_json() or None,
                expires_at=expires_at,
                role=None if parsed_role is None else parsed_role.value,
            )
            session.add(row)
            record_change(session, KEYS_TOPIC, row.id)
        return _api_key_record(row)

    def find_api_key(self, key_hash: str) -> ApiKeyRecord | None:
        """The unrevoked key whose hash is ``key_hash``, or ``None``."""
        with self._read() as session:
            row = session.scalars(
                select(ApiKeyRow)
                .where(ApiKeyRow.key_hash == key_hash)
                .where(ApiKeyRow.revoked_at.is_(None))
            ).first()
            return None if row is None else _api_key_record(row)

    def api_key_hashes(self) -> set[str]:
        """The hashes of every unrevoked key."""
        with self._read() as session:
            return set(
                session.scalars(select(ApiKeyRow.key_hash).where(ApiKeyRow.revoked_at.is_(None)))
            )

    def list_api_keys(self) -> list[ApiKeyRecord]:
        """Every key, revoked ones included, oldest first."""
        with self._read() as session:
            rows = session.scalars(select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id))
            return [_api_key_record(row) for row in rows]

    def lookup_api_key(self, ident: str) -> ApiKeyRecord:
        """The key whose id is ``ident``, else the one named ``ident``.

        A name is looked up among unrevoked keys first, then revoked ones.  Raises
        :class:`NotFoundError` when no key has that id or name, and :class:`ConflictError`
        when several keys share the name (the message lists their ids, to use instead).
        """
        with self._read() as session:
            return _api_key_record(_lookup_api_key_row(session, ident))

    def update_api_key(
        self,
        ident: str,
        *,
        tier: str | Unchanged = UNCHANGED,
        limits: LimitOverrides | Unchanged = UNCHANGED,
        expires_at: datetime | Unchanged | None = UNCHANGED,
        role: str | Unchanged = UNCHANGED,
    ) -> ApiKeyRecord:
        """Change a key's tier, role, limit overrides (replaced whole) or expiry (``None``:
        never); return the updated record.  ``ident`` is an id or name
        (:meth:`lookup_api_key`).  A key moved into the ``admin`` tier without a role is an
        ``admin``; one moved out of it loses its role.

        Raises :class:`NotFoundError` / :class:`ConflictError` as :meth:`lookup_api_key`
        does, :class:`ConflictError` for a revoked key, and :class:`ConfigError` for an
        invalid tier name, an unknown role or a role for a key outside the admin tier.
        """
        parsed_tier = parse_tier(tier) if not isinstance(tier, Unchanged) else tier
        if not isinstance(role, Unchanged):
            parse_role(role)
        with self._write() as session:
            row = _lookup_api_key_row(session, ident)
            if row.revoked_at is not None:
                raise ConflictError(f"API key {row.id} ({row.name}) is revoked; create a new one")
            new_tier = row.tier if isinstance(parsed_tier, Unchanged) else parsed_tier
            kept_role = row.role if new_tier == row.tier else None
            new_role = role_of_tier(new_tier, kept_role if isinstance(role, Unchanged) else role)
            row.role = None if new_role is None else new_role.value
            if not isinstance(parsed_tier, Unchanged):
                row.tier = parsed_tier
            if not isinstance(limits, Unchanged):
                row.limits = limits.to_json() or None
            if not isinstance(expires_at, Unchanged):
                row.expires_at = expires_at
            record_change(session, KEYS_TOPIC, row.id)
        return _api_key_record(row)

    def revoke_api_key(self, ident: str) -> ApiKeyRecord:
        """Revoke the key ``ident`` (an id or name, :meth:`lookup_api_key`) and return it;
        revoking twice keeps the first time.

        Raises :class:`NotFoundError` for an unknown key and :class:`ConflictError` for a
        name several keys share.
        """
        with self._write() as session:
            row = _lookup_api_key_row(session, ident)
            if row.revoked_at is None:
                row.revoked_at = self._clock()
                record_change(session, KEYS_TOPIC, row.id)
        return _api_key_record(row)


def _lookup_api_key_row(session: Session, ident: str) -> ApiKeyRow:
    row = session.get(ApiKeyRow, ident)
    if row is not None:
        return row
    named = session.scalars(
        select(ApiKeyRow).where(ApiKeyRow.name == ident).order_by(ApiKeyRow.created_at)
    ).all()
    live = [r for r in named if r.revoked_at is None]
    candidates = live or named
    if not candidates:
        raise NotFoundError("API key", ident)
    if len(candidates) > 1:
        ids = ", ".join(r.id for r in candidates)
        state = "" if live else "revoked "
        raise ConflictError(f"{len(candidates)} {state}keys are named {ident!r} ({ids}); use an id")
    return candidates[0]


def _api_key_record(row: ApiKeyRow) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=row.id,
        name=row.name,
        tier=row.tier,
        prefix=row.prefix,
        created_at=aware(row.created_at),
        revoked_at=None if row.revoked_at is None else aware(row.revoked_at),
        limits=LimitOverrides.from_json(row.limits, where=f"API key {row.id}'s stored limits"),
        expires_at=None if row.expires_at is None else aware(row.expires_at),
        role=_stored_role(row),
    )


def _stored_role(row: ApiKeyRow) -> Role | None:
    """The role of a stored key: ``None`` outside the admin tier, ``admin`` for an admin
    key with none, and the lowest (``viewer``) for one this berth does not know."""
    if row.tier != "admin":
        return None
    if row.role is None:
        return Role.ADMIN
    try:
        return Role(row.role)
    except ValueError:
        return Role.VIEWER
