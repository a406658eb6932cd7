"""The CA routes: ``GET /admin/ca``, ``POST /admin/ca/rotate``, ``POST /admin/ca/retire``
(:mod:`berth.cluster.pki.ca_rotation` does the work, on a worker thread)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter

from berth.admin.roles import needs
from berth.api.ca import CaStatus, OldLeafHolder, RetireIn
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.ca_rotation import holders_of_old_leaves, retire, rotate
from berth.cluster.pki.signing_key import SpecSigner, carry_over
from berth.store import Store
from berth.vocab.roles import Role

log = logging.getLogger(__name__)


def build_ca_router(ca: CertificateAuthority, store: Store) -> APIRouter:
    """The CA routes over the cluster's ``ca`` and the store (its nodes' certificates)."""
    router = APIRouter()

    def status() -> CaStatus:
        return CaStatus(
            fingerprint=ca.fingerprint_sha256,
            not_after=ca.certificate.not_valid_after_utc.timestamp(),
            previous_fingerprint=ca.previous_fingerprint,
            rotating=ca.previous is not None,
            old_leaf_holders=[
                OldLeafHolder(node_id=h.node_id, label=h.label, issuer=h.issuer)
                for h in holders_of_old_leaves(store, ca)
            ],
        )

    @router.get("/admin/ca", dependencies=[needs(Role.VIEWER)])
    async def ca_status() -> CaStatus:
        return await asyncio.to_thread(status)

    @router.post("/admin/ca/rotate", dependencies=[needs(Role.ADMIN)])
    async def ca_rotate() -> CaStatus:
        await asyncio.to_thread(rotate, ca)
        signer = SpecSigner.load_or_create(ca.ca_dir)
        moved = await asyncio.to_thread(carry_over, store, signer)
        log.warning("cluster CA rotated: new leaves under %s, specs signed by %s (%d signed "
                    "again)", ca.fingerprint_sha256, signer.key_id, moved)  # fmt: skip
        return await asyncio.to_thread(status)

    @router.post("/admin/ca/retire", dependencies=[needs(Role.ADMIN)])
    async def ca_retire(body: RetireIn) -> CaStatus:
        def work() -> None:
            retire(ca, holders_of_old_leaves(store, ca), force=body.force)

        await asyncio.to_thread(work)
        log.warning("cluster CA: the old root was retired%s", " (forced)" if body.force else "")
        return await asyncio.to_thread(status)

    return router
