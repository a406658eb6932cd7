"""The client certificates the leader issued to nodes: the :class:`Store`'s certificate half.

:class:`CertificateMethods` is mixed into :class:`berth.store.Store`.  A node's *current*
certificate is the one ``nodes.cert_fingerprint`` names (the newest issued); a renewal adds
a row and moves that column, and the older certificate keeps identifying the node until it
expires, so an agent that renewed but had not yet redialled (or crashed before writing its
new pair) is still let in.  Re-enrolling a node forgets every certificate it had.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from berth.errors import NotFoundError
from berth.store.tables import NodeCertificateRow, NodeRow
from berth.vocab.records import NodeCertificate


class CertificateMethods:
    """Store methods for issued node certificates (see the module doc)."""

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def record_node_certificate(self, certificate: NodeCertificate, *, replace: bool) -> None:
        """Record ``certificate`` as its node's current one.

        ``replace`` (an enrollment): the node's earlier certificates no longer identify
        it; otherwise (a renewal) they do until they expire.  Raises :class:`NotFoundError`
        for an unknown node.
        """
        with self._write() as session:
            node = session.get(NodeRow, certificate.node_id)
            if node is None:
                raise NotFoundError("node", certificate.node_id)
            if replace:
                session.execute(
                    delete(NodeCertificateRow).where(
                        NodeCertificateRow.node_id == certificate.node_id
                    )
                )
            session.merge(
                NodeCertificateRow(
                    fingerprint=certificate.fingerprint,
                    node_id=certificate.node_id,
                    serial=certificate.serial,
                    not_after=certificate.not_after,
                    issuer_fingerprint=certificate.issuer_fingerprint,
                    issued_at=certificate.issued_at,
                )
            )
            node.cert_fingerprint = certificate.fingerprint

    def node_certificate(self, fingerprint: str) -> NodeCertificate | None:
        """The recorded certificate with ``fingerprint``, or ``None``."""
        with self._read() as session:
            row = session.get(NodeCertificateRow, fingerprint)
            return None if row is None else _record(row)

    def current_node_certificates(self) -> dict[str, NodeCertificate]:
        """Each node's current certificate (the one ``nodes.cert_fingerprint`` names), by
        node id; nodes enrolled before certificates were recorded are absent."""
        query = select(NodeCertificateRow).join(
            NodeRow, NodeRow.cert_fingerprint == NodeCertificateRow.fingerprint
        )
        with self._read() as session:
            return {row.node_id: _record(row) for row in session.scalars(query)}

    def forget_expired_certificates(self, now: float) -> int:
        """Delete recorded certificates that expired before ``now`` and are no node's
        current one; returns how many went."""
        with self._write() as session:
            current = select(NodeRow.cert_fingerprint).where(NodeRow.cert_fingerprint.is_not(None))
            result = session.execute(
                delete(NodeCertificateRow).where(
                    NodeCertificateRow.not_after < now,
                    NodeCertificateRow.fingerprint.not_in(current),
                )
            )
            return int(getattr(result, "rowcount", 0) or 0)


def _record(row: NodeCertificateRow) -> NodeCertificate:
    return NodeCertificate(
        node_id=row.node_id,
        fingerprint=row.fingerprint,
        serial=row.serial,
        not_after=row.not_after,
        issuer_fingerprint=row.issuer_fingerprint,
        issued_at=row.issued_at,
    )
