"""Short-lived agent certificates on the leader's side of the link: renewal and expiry.

An agent's client certificate lives ``agent_cert_lifetime_s`` (a day by default).  At about
two thirds of it the agent sends ``renew`` (:data:`~berth.cluster.protocol.ops.RENEW`) over
its live link with a CSR signed by a new key; :class:`LinkCertificates` issues a new
certificate only when

- the node still exists and is not removed,
- the certificate the link is made with (or last renewed to) is still valid, and
- the CSR's self-signature verifies: the agent holds the new key (the link's mutual TLS
  already proved it holds the current one).

The new certificate is recorded as the node's current one (the old one keeps identifying
the node until it expires) and the link's deadline moves to the new ``notAfter``: the link
and its streams carry on, the agent dials with the new pair next time.  A link whose
deadline passes is closed with ``CERTIFICATE_EXPIRED`` (:meth:`LinkCertificates.watch`),
and a dial with an expired certificate is refused with the same code, naming the node
(:func:`expiry_refusal`): the cluster listener leaves certificate times to this module
(:func:`berth.cluster.leader.listener.cluster_ssl_context`) so that the refusal is typed and
logged, not a TLS alert.

The decisions (:func:`renewal_refusal`, :func:`expiry_refusal`) are pure; times are epoch
seconds from the caller's clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography import x509

from berth.cluster.link.connection import LinkConnection
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.enrollment import AuditLog, issued_certificate
from berth.cluster.pki.signing_key import trusted_in
from berth.cluster.protocol.errors import CloseCode, ProtocolError
from berth.cluster.protocol.frames import Request
from berth.cluster.protocol.ops import RENEW, RenewResult
from berth.cluster.protocol.payloads import ErrorCode, ErrorInfo
from berth.errors import BerthError
from berth.store import Store
from berth.vocab.records import NodeRecord

log = logging.getLogger(__name__)

#: Longest wait, in seconds, between two looks at a link's deadline (it may move).
WATCH_INTERVAL_S = 1.0


class RenewalRefused(BerthError):
    """The leader will not renew this node's certificate (the message says why)."""

    http_status = 403
    error_type = "permission_error"


@dataclass
class LinkDeadline:
    """When the certificate a live link stands on expires (epoch seconds; ``None``: not
    known, e.g. a forwarded fingerprint of a certificate issued before they were
    recorded).  A renewal over the link moves it."""

    not_after: float | None


def certificate_not_after(der: bytes) -> float | None:
    """``notAfter`` of a DER certificate in epoch seconds (``None`` when it does not parse)."""
    try:
        return x509.load_der_x509_certificate(der).not_valid_after_utc.timestamp()
    except ValueError:
        return None


def expiry_refusal(node: NodeRecord, not_after: float | None, now: float) -> str | None:
    """Why a link with a certificate valid until ``not_after`` is refused at ``now``, or
    ``None`` when it is still valid (or its end is unknown).  Names the node (the agent
    adds how to bring it back: enrolling it again)."""
    if not_after is None or not_after > now:
        return None
    return f"the certificate of node {node.id} ({node.label}) expired at {_iso(not_after)}"


def renewal_refusal(
    node: NodeRecord | None, not_after: float | None, csr_pem: str, now: float
) -> str | None:
    """Why a renewal asked over a link of ``node`` whose certificate is valid until
    ``not_after`` must be refused at ``now``, or ``None`` when it may go ahead.

    Refused: an unknown or removed node, an expired certificate, a CSR that does not parse
    or whose signature does not verify (no proof that the agent holds the new key).
    """
    if node is None:
        return "this node is not enrolled"
    if node.status == "removed":
        return f"node {node.id} was removed"
    if not_after is not None and not_after <= now:
        return f"the link's certificate expired at {_iso(not_after)}"
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
    except ValueError as exc:
        return f"invalid certificate signing request: {exc}"
    if not csr.is_signature_valid:
        return "the certificate signing request's signature does not verify"
    return None


class LinkCertificates:
    """Renews certificates over live links and closes links whose certificate expired.

    ``lifetime_s`` is the new certificates' lifetime (the ``agent_cert_lifetime_s``
    setting); ``clock`` returns epoch seconds; ``audit`` gets a ``node.renew`` line per
    attempt.  Store and signing work runs on a worker thread.
    """

    def __init__(
        self,
        store: Store,
        ca: CertificateAuthority,
        *,
        lifetime_s: float,
        audit: AuditLog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._ca = ca
        self.lifetime_s = lifetime_s
        self._audit = audit
        self._clock = clock
        #: the deadline of each live link, while :meth:`watch` runs for it
        self._deadlines: dict[LinkConnection, LinkDeadline] = {}
        #: why each node's last renewal was refused (``berth nodes ls``)
        self.refusals: dict[str, str] = {}

    def renew(self, node_id: str, not_after: float | None, csr_pem: str) -> RenewResult:
        """Issue ``node_id`` a certificate for the key of ``csr_pem`` (blocking).

        Raises :class:`RenewalRefused` saying why (see :func:`renewal_refusal`), and
        :class:`ConfigError` for a CSR key the CA does not sign (weak or of another type).
        """
        now = self._clock()
        try:
            node: NodeRecord | None = self._store.get_node(node_id)
        except BerthError:
            node = None
        event: dict[str, object] = {"event": "node.renew", "node_id": node_id, "time": now}
        refusal = renewal_refusal(node, not_after, csr_pem, now)
        try:
            if refusal is not None:
                raise RenewalRefused(refusal)
            cert_pem = self._ca.sign_csr(
                csr_pem.encode(), common_name=node_id, lifetime_s=self.lifetime_s
            )
            issued = issued_certificate(node_id, cert_pem, self._ca, now)
            self._store.record_node_certificate(issued, replace=False)
            self._store.forget_expired_certificates(now)
        except BerthError as exc:
            self.refusals[node_id] = str(exc)
            self._append({**event, "outcome": "refused", "reason": str(exc)})
            raise
        self.refusals.pop(node_id, None)
        self._append(
            {**event, "outcome": "renewed", "serial": issued.serial, "not_after": issued.not_after}
        )
        log.info("node %s: certificate renewed (serial %s, until %s)", node_id, issued.serial,
                 _iso(issued.not_after))  # fmt: skip
        return RenewResult(
            certificate_pem=cert_pem.decode(),
            not_after=issued.not_after,
            ca_bundle_pem=self._ca.trust_bundle_pem.decode(),
            spec_keys_pem=trusted_in(self._ca.ca_dir).to_pem().decode("ascii"),
        )

    async def serve(self, conn: LinkConnection, request: Request) -> None:
        """Answer a ``renew`` request on ``conn`` (a link :meth:`watch` runs for): the new
        certificate, or ``invalid`` saying why not.  A renewal moves the link's deadline."""
        deadline = self._deadlines.get(conn)
        try:
            args = RENEW.decode_args(request.args)
            result = await asyncio.to_thread(
                self.renew, conn.peer, deadline.not_after if deadline else None, args.csr_pem
            )
        except (ProtocolError, BerthError) as exc:
            log.warning("node %s: certificate renewal refused: %s", conn.peer, exc)
            conn.respond(request.id, error=ErrorInfo(code=ErrorCode.INVALID, message=str(exc)))
            return
        if deadline is not None:
            deadline.not_after = result.not_after
        conn.respond(request.id, result=RENEW.encode_result(result))

    async def watch(self, conn: LinkConnection, deadline: LinkDeadline) -> None:
        """Until ``conn`` closes: close it with ``CERTIFICATE_EXPIRED`` once ``deadline``
        passes (at most :data:`WATCH_INTERVAL_S` late).  Cancel it when the link ends."""
        self._deadlines[conn] = deadline
        try:
            while not conn.closed:
                not_after = deadline.not_after
                now = self._clock()
                if not_after is not None and now >= not_after:
                    reason = f"the certificate expired at {_iso(not_after)} and was not renewed"
                    log.warning("node %s: closing its link: %s", conn.peer, reason)
                    event = {"event": "node.expired", "node_id": conn.peer, "time": now}
                    await asyncio.to_thread(self._append, event)
                    await conn.close(CloseCode.CERTIFICATE_EXPIRED, reason)
                    return
                wait_s = WATCH_INTERVAL_S if not_after is None else not_after - now
                await asyncio.sleep(min(WATCH_INTERVAL_S, max(0.05, wait_s)))
        finally:
            self._deadlines.pop(conn, None)

    def _append(self, event: dict[str, object]) -> None:
        if self._audit is not None:
            self._audit.append(event)


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="seconds")
