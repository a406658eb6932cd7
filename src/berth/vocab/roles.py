"""A key's tier and an admin key's role: the names the store records, the admin API shows and
checks, the CLI parses, and the console signs in with.

A key's tier says what it may reach (``admin`` also ``/admin/*``; every other tier only
``/v1/*``) and which limits apply (``config.toml``'s ``[tiers.NAME]``); an ``admin`` key's
role says what it may do on the admin API. Plain values, the standard library and
:mod:`berth.errors` only (the vocabulary, ``docs/architecture.md``).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Final

from berth.errors import ConfigError


class Tier(StrEnum):
    """The two tiers every leader has: ``admin`` keys also reach ``/admin/*``; ``standard``
    ones, like every tier defined in ``config.toml``, only ``/v1/*``."""

    ADMIN = "admin"
    STANDARD = "standard"


class Role(StrEnum):
    """What an ``admin`` key may do on the admin API, lowest first.

    - ``viewer``: reads only (every ``GET``, and the dry-run placement of ``POST
      /admin/plan``);
    - ``operator``: also deploys and stops, and manages models, services, routes, adapters,
      pulls, drains and the keys of tiers other than ``admin``;
    - ``admin``: everything, ``/admin/shutdown``, the CA, leaders, enrollment and admin keys
      included.

    Keys of other tiers have no role: they never reach ``/admin``.  The leader's Unix socket
    is the host's root user: every request there is ``admin``.
    """

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        """0 for ``viewer``, 1 for ``operator``, 2 for ``admin``."""
        return _ROLE_RANKS[self]

    def allows(self, needed: Role) -> bool:
        """Whether a key with this role may use a route that needs ``needed``."""
        return self.rank >= needed.rank


_ROLE_RANKS: Final = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}


def parse_role(text: str) -> Role:
    """A role as typed (any case, edge spaces ignored).

    Raises :class:`ConfigError` naming the three roles for anything else.
    """
    try:
        return Role(text.strip().lower())
    except ValueError:
        raise ConfigError(
            f"unknown role {text!r}: use one of {', '.join(r.value for r in Role)}"
        ) from None


def role_of_tier(tier: str, role: str | None) -> Role | None:
    """The role a key of ``tier`` holds, given the ``role`` stored or asked for: ``None``
    for a key outside the ``admin`` tier, ``role`` (default ``admin``, as every admin key
    made before roles existed) for an admin key.  Raises :class:`ConfigError` for a role
    given to a key of another tier, or an unknown role."""
    if tier != Tier.ADMIN:
        if role is not None:
            raise ConfigError(
                f"a role is for admin keys only; this key's tier is {tier!r} (give --tier admin)"
            )
        return None
    return Role.ADMIN if role is None else parse_role(role)


#: A tier's name: a lower-case letter or digit, then up to 31 of those, ``-`` and ``_``.
_TIER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def parse_tier(text: str) -> str:
    """A tier's name as typed (any case, edge spaces ignored), lower-cased.

    Raises :class:`ConfigError` unless it is 1 to 32 lower-case letters, digits, ``-`` or
    ``_`` starting with a letter or digit.  Whether a leader defines that tier is the
    leader's to say (``[tiers.NAME]`` in ``config.toml``; ``admin`` and ``standard`` always).
    """
    name = text.strip().lower()
    if not _TIER_NAME.fullmatch(name):
        raise ConfigError(
            f"invalid tier name {text!r}: use 1 to 32 letters, digits, '-' or '_' "
            f"(built-in tiers: {', '.join(t.value for t in Tier)})"
        )
    return name
