"""API keys: ``/admin/keys``."""

from __future__ import annotations

from pydantic import Field

from berth.api.base import ApiModel, Timestamp
from berth.keys import Tier


class KeyIn(ApiModel):
    """``POST /admin/keys``: a key labelled ``name``; ``tier`` as a user typed it (``admin``
    or ``standard``, any case), checked by :func:`berth.keys.parse_tier`."""

    name: str = Field(min_length=1, max_length=200)
    tier: str = "standard"


class ApiKey(ApiModel):
    """A key's metadata: ``prefix`` is the start of its secret, for recognising it; the
    secret itself is never stored.  ``revoked_at`` is set once revoked."""

    id: str
    name: str
    tier: Tier
    prefix: str
    created_at: Timestamp
    revoked_at: Timestamp | None


class CreatedApiKey(ApiKey):
    """``POST /admin/keys`` (201): the new key with its secret, shown this once."""

    secret: str
