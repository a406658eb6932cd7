"""The admin API's key and usage routes.

- ``GET /admin/keys``: every key, with the limits it works under and what it uses now;
- ``POST /admin/keys`` (:class:`~berth.api.KeyIn`): a new key; its secret is in this answer
  only;
- ``PATCH /admin/keys/{name or id}`` (:class:`~berth.api.KeyChangeIn`): tier, role,
  limits, expiry;
- ``DELETE /admin/keys/{name or id}``: revoke;
- ``GET /admin/usage``: the usage ledger (:mod:`berth.api.usage`), with what is not yet
  written to the store.

An ``operator`` manages the keys of every tier but ``admin``: creating, changing or revoking
an admin key (or giving a role) needs the ``admin`` role.

Every change is written to the store, then handed to admission (the request path's limits
live in memory) and the authenticator's cache is dropped, so the next request sees it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import WithJsonSchema

from berth.admin.roles import needs, require_role
from berth.admission import SOCKET_KEY_ID, SOCKET_KEY_NAME, Admission, SocketCaller
from berth.api import (
    DEFAULT_SINCE,
    SINCE_DAYS_PATTERN,
    ApiKey,
    CreatedApiKey,
    KeyChangeIn,
    KeyIn,
    KeyLimitsOut,
    KeyUseOut,
    UsageGrouping,
    UsageReport,
    UsageRow,
    parse_grouping,
    parse_since,
    role_name,
)
from berth.auth.authenticator import Authenticator
from berth.config import TierTable
from berth.errors import ConfigError
from berth.keys import generate_secret, hash_secret, key_prefix
from berth.store import UNCHANGED, Store, Unchanged
from berth.vocab.limits import KeyLimits
from berth.vocab.records import ApiKeyRecord, UsageRecord
from berth.vocab.roles import Role, Tier, parse_role, role_of_tier

#: ``since`` in the schema: a number of days or a date.
SINCE_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "pattern": SINCE_DAYS_PATTERN},
            {"type": "string", "format": "date"},
        ],
        "examples": ["30d", "2026-01-31"],
    }
)

#: The usage ledger's names for requests over the Unix socket, by name: each caller's, and
#: the one rows from before berth told them apart have.
_SOCKET_IDS: dict[str, str] = {
    SOCKET_KEY_NAME: SOCKET_KEY_ID,
    **{caller.value: caller.value for caller in SocketCaller},
}


def key_view(record: ApiKeyRecord, admission: Admission | None = None) -> ApiKey:
    """A key for the admin API (never its secret): its limits and use as the leader's
    ``admission`` knows them (without it, its own limits only)."""
    use = KeyUseOut()
    limits = record.limits.apply(KeyLimits())
    if admission is not None:
        limits = admission.limits_of(record)
        if not record.is_revoked:
            now = admission.use_of(record.id)
            use = KeyUseOut(
                in_flight=now.in_flight,
                day_tokens=now.day_tokens,
                month_tokens=now.month_tokens,
                requests_remaining=now.requests_remaining,
                tokens_remaining=now.tokens_remaining,
            )
    return ApiKey(
        id=record.id,
        name=record.name,
        tier=record.tier,
        role=None if record.role is None else role_name(record.role),
        prefix=record.prefix,
        created_at=record.created_at,
        revoked_at=record.revoked_at,
        expires_at=record.expires_at,
        limits=KeyLimitsOut.of(limits),
        overridden=list(record.limits.overridden()),
        use=use,
    )


def _future_expiry(expires_at: datetime | None, now: datetime) -> datetime | None:
    if expires_at is None:
        return None
    if expires_at.tzinfo is None:
        raise ConfigError("expires_at must carry a time zone (e.g. 2027-01-01T00:00:00+00:00)")
    if expires_at <= now:
        raise ConfigError(
            f"expires_at {expires_at.isoformat()} is in the past (now {now.isoformat()})"
        )
    return expires_at.astimezone(UTC)


def build_key_router(
    store: Store,
    admission: Admission,
    authenticator: Authenticator,
    pepper: bytes,
    tiers: TierTable,
    *,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> APIRouter:
    """The routes of the module doc over the store, the request path's ``admission`` and
    ``authenticator`` (told of every change), the ``pepper`` new keys are hashed with and
    the key ``tiers``; ``now`` is the wall clock expiries are checked with."""
    router = APIRouter()

    def changed(record: ApiKeyRecord) -> None:
        admission.update(record)
        authenticator.forget([record.id])

    @router.get("/admin/keys", dependencies=[needs(Role.VIEWER)])
    async def list_keys() -> list[ApiKey]:
        records = await asyncio.to_thread(store.list_api_keys)
        return [key_view(r, admission) for r in records]

    @router.post("/admin/keys", status_code=201, dependencies=[needs(Role.OPERATOR)])
    async def create_key(body: KeyIn, request: Request) -> CreatedApiKey:
        tier = tiers.require(body.tier)
        role = role_of_tier(tier.name, body.role)
        if role is not None:
            require_role(request, Role.ADMIN, "creating an admin key")
        expires_at = _future_expiry(body.expires_at, now())
        secret = generate_secret()
        key_hash = hash_secret(secret, pepper)
        record = await asyncio.to_thread(
            lambda: store.add_api_key(
                body.name,
                tier.name,
                key_hash,
                key_prefix(secret),
                limits=body.overrides(),
                expires_at=expires_at,
                role=role,
            )
        )
        changed(record)
        authenticator.know([key_hash])  # its first use is never rate limited
        return key_view(record, admission).extended(CreatedApiKey, secret=secret)

    # ``:path``: a key made before names were refused a ``/`` is still found by its name.
    @router.patch("/admin/keys/{ident:path}", dependencies=[needs(Role.OPERATOR)])
    async def change_key(ident: str, body: KeyChangeIn, request: Request) -> ApiKey:
        changes = body.overrides()
        both = sorted(set(changes.overridden()) & set(body.clear))
        if both:
            raise ConfigError(f"{', '.join(both)}: set and cleared at once; do one or the other")
        tier = tiers.require(body.tier).name if body.tier else None
        expires_at = _future_expiry(body.expires_at, now()) if body.changes_expiry else None
        current = await asyncio.to_thread(store.lookup_api_key, ident)
        if Tier.ADMIN in (current.tier, tier) or body.role is not None:
            require_role(request, Role.ADMIN, "changing an admin key")
        limits = current.limits.updated(changes, body.clear)
        role: Role | Unchanged = UNCHANGED if body.role is None else parse_role(body.role)

        def update() -> ApiKeyRecord:
            if body.changes_expiry:
                return store.update_api_key(
                    current.id,
                    tier=tier or current.tier,
                    limits=limits,
                    expires_at=expires_at,
                    role=role,
                )
            return store.update_api_key(
                current.id, tier=tier or current.tier, limits=limits, role=role
            )

        record = await asyncio.to_thread(update)
        changed(record)
        return key_view(record, admission)

    @router.delete("/admin/keys/{ident:path}", dependencies=[needs(Role.OPERATOR)])
    async def revoke_key(ident: str, request: Request) -> ApiKey:
        current = await asyncio.to_thread(store.lookup_api_key, ident)
        if current.tier == Tier.ADMIN:
            require_role(request, Role.ADMIN, "revoking an admin key")
        record = await asyncio.to_thread(store.revoke_api_key, current.id)
        changed(record)
        return key_view(record, admission)

    @router.get("/admin/usage", dependencies=[needs(Role.VIEWER)])
    async def usage(
        since: Annotated[str, SINCE_SCHEMA] = DEFAULT_SINCE,
        by: UsageGrouping = "day",
        key: str | None = None,
        model: str | None = None,
    ) -> UsageReport:
        today = now().date()
        first = parse_since(since, today, future_ok=True)
        grouping = parse_grouping(by)
        await admission.ledger.flush()  # what is still in memory counts too
        key_id = None
        if key is not None:
            found = _SOCKET_IDS.get(key)
            key_id = (
                found
                if found is not None
                else (await asyncio.to_thread(store.lookup_api_key, key)).id
            )
        records = await asyncio.to_thread(
            lambda: store.list_usage(since=first, until=today, key_id=key_id, model=model)
        )
        names = {r.id: r.name for r in await asyncio.to_thread(store.list_api_keys)}
        names.update({v: k for k, v in _SOCKET_IDS.items()})
        rows = summarise(records, grouping, names)
        return UsageReport(
            since=first,
            until=today,
            by=grouping,
            key=key,
            model=model,
            rows=rows,
            total=_total(rows),
        )

    return router


def summarise(
    records: list[UsageRecord], grouping: UsageGrouping, names: dict[str, str]
) -> list[UsageRow]:
    """Ledger rows summed per day, key, model or node, in that order (keys by name)."""
    sums: dict[str, list[int]] = {}
    for record in records:
        if grouping == "day":
            group = record.day.isoformat()
        elif grouping == "key":
            group = record.key_id
        elif grouping == "model":
            group = record.model
        else:
            group = record.node_id
        into = sums.setdefault(group, [0, 0, 0, 0, 0, 0, 0])
        into[0] += record.requests
        into[1] += record.errors
        into[2] += record.prompt_tokens
        into[3] += record.completion_tokens
        into[4] += record.estimated_requests
        into[5] += record.estimated_tokens
        into[6] += record.cached_tokens

    def order(group: str) -> tuple[str, str]:
        return (names.get(group, group), group) if grouping == "key" else (group, "")

    rows = []
    for group in sorted(sums, key=order):
        counts = sums[group]
        fields: dict[str, object] = {}
        if grouping == "day":
            fields["day"] = group
        elif grouping == "key":
            fields["key_id"], fields["key"] = group, names.get(group, group)
        elif grouping == "model":
            fields["model"] = group
        else:
            fields["node_id"] = group
        rows.append(_row(counts, **fields))
    return rows


def _row(counts: list[int], **group: object) -> UsageRow:
    return UsageRow.model_validate(
        {
            **group,
            "requests": counts[0],
            "errors": counts[1],
            "prompt_tokens": counts[2],
            "completion_tokens": counts[3],
            "total_tokens": counts[2] + counts[3],
            "estimated_requests": counts[4],
            "estimated_tokens": counts[5],
            "cached_tokens": counts[6],
        }
    )


def _total(rows: list[UsageRow]) -> UsageRow:
    counts = [0, 0, 0, 0, 0, 0, 0]
    for row in rows:
        counts[0] += row.requests
        counts[1] += row.errors
        counts[2] += row.prompt_tokens
        counts[3] += row.completion_tokens
        counts[4] += row.estimated_requests
        counts[5] += row.estimated_tokens
        counts[6] += row.cached_tokens
    return _row(counts)
