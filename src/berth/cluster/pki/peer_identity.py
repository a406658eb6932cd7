"""Who is dialing the cluster listener: the verified client certificate, or, in the
reverse-proxy fingerprint mode, the fingerprint a trusted TLS-terminating proxy forwards.

By default an agent's identity is the SHA-256 fingerprint of the client certificate it
presented in the TLS handshake, which the listener verified against the berth CA.

Some operators put a TLS-terminating proxy in front of the cluster port.  The proxy then
verifies the agent's certificate itself and reaches the leader over a new TLS connection
without one, so the leader never sees the agent's certificate.  With
``BERTH_TRUST_FORWARDED_FP=1`` the leader accepts the fingerprint such a proxy forwards in
the ``x-berth-client-fingerprint`` header, under two conditions that keep anyone else from
claiming a node's identity:

- the TCP peer's address is in ``BERTH_FORWARDED_ALLOW_IPS`` (a comma list of addresses or
  networks, default ``127.0.0.1``): only the proxy may speak for an agent;
- the connection carries no client certificate: a presented certificate always wins.

From any other peer the header is ignored, as if it were absent.  Both variables are read
once, when the daemon starts (:meth:`ForwardedFingerprintTrust.from_env`).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from berth.cluster.pki.ca import fingerprint_of_der
from berth.errors import ConfigError

#: The header a trusted proxy sets to the SHA-256 fingerprint of the agent's certificate.
FORWARDED_FINGERPRINT_HEADER: Final = "x-berth-client-fingerprint"
#: Environment variable that turns the reverse-proxy fingerprint mode on (``1``).
TRUST_FORWARDED_ENV: Final = "BERTH_TRUST_FORWARDED_FP"
#: Environment variable listing the proxies' addresses (comma list of IPs or networks).
ALLOW_IPS_ENV: Final = "BERTH_FORWARDED_ALLOW_IPS"
DEFAULT_ALLOW_IPS: Final = "127.0.0.1"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
# 64 hex digits, optionally in colon-separated pairs and behind a "sha256:" or "sha256="
# label: how Caddy ({http.request.tls.client.fingerprint}), HAProxy (ssl_c_sha256,hex),
# Envoy (Hash= in x-forwarded-client-cert) and berth itself write one.
_FINGERPRINT = re.compile(r"(?:sha-?256[:=])?((?:[0-9a-f]{2}:?){31}[0-9a-f]{2})", re.IGNORECASE)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def peer_certificate_der(request: web.Request) -> bytes | None:
    """The DER client certificate the peer presented (already verified against the berth
    CA by the handshake), or ``None`` when it presented none or the link is not TLS."""
    transport = request.transport
    if transport is None:
        return None
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    der: bytes | None = ssl_object.getpeercert(binary_form=True)
    return der


def parse_forwarded_fingerprint(value: str) -> str | None:
    """The fingerprint in a forwarded header value as berth stores it (``sha256:<hex>``,
    lowercase, no colons), or ``None`` when ``value`` is not a SHA-256 fingerprint."""
    found = _FINGERPRINT.fullmatch(value.strip())
    if found is None:
        return None
    return "sha256:" + found.group(1).replace(":", "").lower()


def _peer_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d
    return address


@dataclass(frozen=True)
class ForwardedFingerprintTrust:
    """The reverse-proxy fingerprint mode is on, trusting proxies in ``allowed``."""

    allowed: tuple[IPNetwork, ...]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ForwardedFingerprintTrust | None:
        """The mode as ``env`` sets it: ``None`` unless ``BERTH_TRUST_FORWARDED_FP`` is
        ``1`` (or ``true``, ``yes``, ``on``).

        Raises :class:`ConfigError` naming the variable for a value that is neither true nor
        false, or an allow list with an entry that is not an address or network.
        """
        raw = env.get(TRUST_FORWARDED_ENV, "").strip().lower()
        if raw in _FALSE:
            return None
        if raw not in _TRUE:
            raise ConfigError(
                f"environment variable {TRUST_FORWARDED_ENV}: expected 1 or 0, got {raw!r}"
            )
        return cls(parse_allow_list(env.get(ALLOW_IPS_ENV, DEFAULT_ALLOW_IPS)))

    def allows(self, peer: str | None) -> bool:
        """Whether the TCP peer address ``peer`` (as the socket reports it) is a trusted
        proxy."""
        address = _peer_address(peer) if peer else None
        return address is not None and any(address in network for network in self.allowed)

    def describe(self) -> str:
        """The allow list as text, for the daemon's log."""
        return ", ".join(str(network) for network in self.allowed)


def parse_allow_list(text: str) -> tuple[IPNetwork, ...]:
    """Parse a comma list of addresses (``127.0.0.1``) and networks (``10.0.0.0/8``).

    Raises :class:`ConfigError` naming ``BERTH_FORWARDED_ALLOW_IPS`` for an entry that is
    neither, or for an empty list.
    """
    networks: list[IPNetwork] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ConfigError(
                f"environment variable {ALLOW_IPS_ENV}: {entry!r} is not an IP address or network"
            ) from None
    if not networks:
        raise ConfigError(f"environment variable {ALLOW_IPS_ENV}: no address given")
    return tuple(networks)


@dataclass(frozen=True)
class ClientIdentity:
    """Who a connection speaks for: the certificate fingerprint (``sha256:<hex>``), the DER
    certificate when the peer presented one, and the proxy's address when the fingerprint
    was forwarded instead."""

    fingerprint: str
    certificate_der: bytes | None
    forwarded_by: str | None = None


def client_identity(
    request: web.Request, forwarded: ForwardedFingerprintTrust | None
) -> ClientIdentity | None:
    """The identity of the peer of ``request``, or ``None`` when it proved none.

    A client certificate the peer presented (already verified against the berth CA by the
    handshake) wins.  Without one, the ``x-berth-client-fingerprint`` header counts only when
    ``forwarded`` is set and the peer's address is among its trusted proxies; otherwise, or
    when the value is not a SHA-256 fingerprint, it is ignored.
    """
    der = peer_certificate_der(request)
    if der is not None:
        return ClientIdentity(fingerprint_of_der(der), der)
    if forwarded is None:
        return None
    header = request.headers.get(FORWARDED_FINGERPRINT_HEADER)
    if header is None:
        return None
    transport = request.transport
    peername = transport.get_extra_info("peername") if transport is not None else None
    # The socket's peer, never X-Forwarded-For: a header cannot vouch for itself.
    peer = str(peername[0]) if isinstance(peername, tuple) and peername else None
    if not forwarded.allows(peer):
        return None
    fingerprint = parse_forwarded_fingerprint(header)
    if fingerprint is None:
        return None
    return ClientIdentity(fingerprint, None, forwarded_by=peer)
