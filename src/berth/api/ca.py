"""The cluster CA and its rotation, ``/admin/ca`` (``berth ca``)."""

from __future__ import annotations

from berth.api.base import ApiInput, ApiModel


class OldLeafHolder(ApiModel):
    """A node whose current certificate the current CA did not issue; ``issuer`` is the
    issuing CA's fingerprint (``None``: issued before berth recorded certificates)."""

    node_id: str
    label: str
    issuer: str | None


class CaStatus(ApiModel):
    """``GET /admin/ca``: the CA that issues leaves (fingerprint ``sha256:<hex>``, expiry in
    epoch seconds), the old root while a rotation is under way, and the nodes still on an
    old-CA leaf (they move at their next renewal)."""

    fingerprint: str
    not_after: float
    previous_fingerprint: str | None
    rotating: bool
    old_leaf_holders: list[OldLeafHolder]


class RetireIn(ApiInput):
    """``POST /admin/ca/retire``: ``force`` retires the old root even while nodes hold
    leaves it issued (they must be enrolled again)."""

    force: bool = False
