"""The cluster's sealed bootstrap data: one row, written once, read by every shared leader.

With ``leader_ha`` and a ``cluster_secret`` the first leader to start seals its CA key and
certificate and its key pepper (:mod:`berth.cluster.pki.bootstrap` does the sealing) and
publishes them in ``cluster_bootstrap``; every later leader reads that row and unseals it
into its home.  The store keeps only the sealed form: ``salt`` (the key derivation's),
``nonce`` (AES-GCM's) and ``ciphertext`` (with its tag), so the database alone opens
nothing.  :meth:`BootstrapMethods.publish_cluster_bootstrap` inserts only where no row is
yet: two leaders starting at once both end with the one that won.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Final

from sqlalchemy.orm import Session

from berth.store.tables import ClusterBootstrapRow

#: The row's key (one cluster per database).
BOOTSTRAP_NAME: Final = "cluster"


@dataclass(frozen=True)
class SealedBootstrap:
    """The sealed bootstrap data: ``salt`` and ``nonce`` (bytes), ``ciphertext`` (AES-GCM
    output, tag included) and ``created_at`` (Unix seconds)."""

    salt: bytes
    nonce: bytes
    ciphertext: bytes
    created_at: float


class BootstrapMethods:
    """Store methods for ``cluster_bootstrap`` (see the module doc)."""

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def cluster_bootstrap(self, name: str = BOOTSTRAP_NAME) -> SealedBootstrap | None:
        """The published sealed bootstrap data, or ``None`` when no leader published yet.
        ``name``: which sealed row (the CA and pepper's, or the spec signing key's,
        :mod:`berth.cluster.pki.signing_key`)."""
        with self._read() as session:
            row = session.get(ClusterBootstrapRow, name)
            return None if row is None else _record(row)

    def publish_cluster_bootstrap(
        self, sealed: SealedBootstrap, *, name: str = BOOTSTRAP_NAME
    ) -> SealedBootstrap:
        """Store ``sealed`` unless a row is already there; return the stored one (``sealed``
        itself, or what another leader published first).  Not fenced: it is written before
        any leader holds the lease.  Writers take turns (:mod:`berth.store.db`), so the look
        and the insert cannot be split by another leader's insert."""
        with self._write() as session:
            row = session.get(ClusterBootstrapRow, name)
            if row is not None:
                return _record(row)
            session.add(
                ClusterBootstrapRow(
                    name=name,
                    salt=sealed.salt,
                    nonce=sealed.nonce,
                    ciphertext=sealed.ciphertext,
                    created_at=sealed.created_at,
                )
            )
            return sealed


def _record(row: ClusterBootstrapRow) -> SealedBootstrap:
    return SealedBootstrap(
        salt=bytes(row.salt),
        nonce=bytes(row.nonce),
        ciphertext=bytes(row.ciphertext),
        created_at=row.created_at,
    )
