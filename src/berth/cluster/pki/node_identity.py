"""Which node a dialing agent is, and whether it may have a link now.

:func:`identify_node` is the hub's first check of a ``/cluster/agent`` connection, before
its WebSocket handshake: the identity comes from the verified client certificate (or, in the
reverse-proxy fingerprint mode, the forwarded fingerprint: :mod:`berth.cluster.pki.peer_identity`),
never from a frame; the node is the store's node of that fingerprint; a removed node, a
certificate naming another node, and an expired certificate
(:func:`~berth.cluster.pki.renewal.expiry_refusal`) are refused, each with the close code the
agent acts on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from cryptography import x509
from cryptography.x509.oid import NameOID

from berth.cluster.pki.peer_identity import ForwardedFingerprintTrust, client_identity
from berth.cluster.pki.renewal import certificate_not_after, expiry_refusal
from berth.cluster.protocol.errors import CloseCode
from berth.store import Store

# The hub's logger: these lines are the hub's refusals, where they always were.
log = logging.getLogger("berth.cluster.leader.hub")


async def identify_node(
    request: web.Request,
    store: Store,
    forwarded: ForwardedFingerprintTrust | None,
    clock: Callable[[], float],
) -> tuple[str | None, tuple[int, str] | None, bytes | None, float | None]:
    """(node id, refusal, the DER client certificate when the agent presented one, its
    ``notAfter`` in epoch seconds when known) of the agent dialing with ``request``.

    A refusal is (close code, reason), and then the other three are ``None``; ``clock()``
    is the time in epoch seconds (for the certificate's expiry).
    """
    identity = client_identity(request, forwarded)
    if identity is None:
        refusal = (CloseCode.BAD_CERTIFICATE, "a client certificate is required")
        return None, refusal, None, None
    node = await asyncio.to_thread(store.find_node_by_fingerprint, identity.fingerprint)
    if node is None:
        refusal = (CloseCode.BAD_CERTIFICATE, "this certificate belongs to no node")
        return None, refusal, None, None
    if node.status == "removed":
        return None, (CloseCode.NODE_REMOVED, f"node {node.id} was removed"), None, None
    der = identity.certificate_der
    # A forwarded fingerprint has no certificate to read; it matched the one issued.
    if der is not None and _common_name(der) != node.id:
        refusal = (CloseCode.BAD_CERTIFICATE, "the certificate names another node")
        return None, refusal, None, None
    if identity.forwarded_by is not None:
        log.info("node %s: fingerprint forwarded by %s", node.id, identity.forwarded_by)
    if der is not None:
        not_after = certificate_not_after(der)
    else:
        issued = await asyncio.to_thread(store.node_certificate, identity.fingerprint)
        not_after = issued.not_after if issued is not None else None
    expired = expiry_refusal(node, not_after, clock())
    if expired is not None:
        return None, (CloseCode.CERTIFICATE_EXPIRED, expired), None, None
    return node.id, None, der, not_after


def _common_name(der: bytes) -> str | None:
    try:
        names = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(
            NameOID.COMMON_NAME
        )
    except ValueError:
        return None
    value = names[0].value if names else None
    return value if isinstance(value, str) else None
