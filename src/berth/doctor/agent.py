"""Checks of an agent home (one with ``agent.yaml``): its identity and certificate, the pinned
CA, and whether the leader answers and still serves the CA that was pinned at registration.

The leader is asked twice for ``/admin/ca.pem``: once without verification, as registration
does, to compare the CA it serves with the pin (so a replaced CA is named as such), then over
the agent's own TLS context (the pinned CA as the only root, its client certificate, host
names checked), which is what the dial loop will do.
"""

from __future__ import annotations

import ssl
import time
from datetime import datetime
from urllib.parse import urlsplit

import httpx
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from berth.agent.identity import (
    AgentIdentity,
    client_ssl_context,
    load_agent_identity,
    pinned_bundle,
)
from berth.agent.renewal import renewal_due_at
from berth.cluster.pki.ca import fingerprint_of_pem
from berth.doctor.certs import load_certificate, validity
from berth.doctor.check import Check
from berth.errors import AuthError, ConfigError
from berth.paths import BerthHome


def reregister_hint(label: str = "LABEL") -> str:
    """How an agent gets a new identity from its leader."""
    return (
        f"re-register: on the leader, berth nodes enroll {label}; here, "
        "berth agent register --force --uri URI"
    )


def agent_checks(home: BerthHome, *, now: datetime, timeout_s: float = 5.0) -> list[Check]:
    """The agent's identity, certificate, pinned CA and leader, in that order.

    ``now`` is an aware datetime for certificate validity; ``timeout_s`` bounds each request
    to the leader.  Stops after the identity when ``agent.yaml`` cannot be used.
    """
    try:
        identity = load_agent_identity(home)
    except ConfigError as exc:
        return [Check("agent identity", "fail", str(exc), reregister_hint())]
    enrolled = f"{identity.enrolled_at:%Y-%m-%d %H:%M} UTC"
    checks = [
        Check(
            "agent identity",
            "ok",
            f"node {identity.label} ({identity.node_id}) of {identity.leader_url}, "
            f"enrolled {enrolled}",
        ),
        agent_certificate_check(identity, now),
    ]
    pin = pin_check(identity)
    checks.append(pin)
    checks.append(leader_check(identity, timeout_s=timeout_s, verify=pin.verdict == "ok"))
    return checks


def agent_certificate_check(identity: AgentIdentity, now: datetime) -> Check:
    """``agent.crt``: readable, issued by a pinned CA root, valid now and not past its
    renewal (agent certificates are short lived: the agent renews them over its link at
    two thirds of their lifetime, :mod:`berth.agent.renewal`)."""
    hint = reregister_hint(identity.label)
    try:
        cert = load_certificate(identity.cert_path)
    except (OSError, ValueError) as exc:
        return Check("agent cert", "fail", f"{identity.cert_path} cannot be read: {exc}", hint)
    if not _issued_by_a_root(cert, identity):
        detail = f"{identity.cert_path} is not issued by the pinned CA {identity.ca_path}"
        return Check("agent cert", "fail", detail, hint)
    verdict, when = validity(cert, now)
    if verdict == "warn":  # weeks left is the server certificates' rule, not an agent's
        verdict, when = "ok", f"valid until {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    due = renewal_due_at(
        cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()
    )
    if verdict == "ok" and now.timestamp() > due + 60:
        verdict, when = "warn", f"{when}; its renewal is overdue (is the agent linked?)"
    return Check(
        "agent cert", verdict, f"{identity.cert_path}: {when}", hint if verdict != "ok" else ""
    )


def _issued_by_a_root(cert: x509.Certificate, identity: AgentIdentity) -> bool:
    try:
        roots = x509.load_pem_x509_certificates(identity.ca_path.read_bytes())
    except (OSError, ValueError):
        return False
    for root in roots:
        try:
            cert.verify_directly_issued_by(root)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False


def pin_check(identity: AgentIdentity) -> Check:
    """``ca.pem`` on this host holds only roots pinned in ``agent.yaml``."""
    try:
        pinned_bundle(identity.ca_path.read_bytes(), identity.pins)
    except OSError as exc:
        return Check(
            "agent ca",
            "fail",
            f"{identity.ca_path} cannot be read: {exc.strerror}",
            reregister_hint(identity.label),
        )
    except AuthError as exc:
        return Check(
            "agent ca", "fail", f"{identity.ca_path}: {exc}", reregister_hint(identity.label)
        )
    pins = ", ".join(identity.pins)
    return Check("agent ca", "ok", f"{identity.ca_path} matches the pin {pins}")


def leader_check(identity: AgentIdentity, *, timeout_s: float = 5.0, verify: bool = True) -> Check:
    """Whether the leader answers at its cluster URL and serves the pinned CA.

    With ``verify`` (the pinned ``ca.pem`` is intact), the leader is then reached over the
    agent's own TLS context, so a server certificate that does not name the dialed host, or
    a leader that refuses this agent's certificate, fails here rather than in the dial loop.
    """
    url = f"{identity.leader_url.rstrip('/')}/admin/ca.pem"
    started = time.monotonic()
    try:
        # verify=False: this request only reads the CA, to compare it with the pin.
        response = httpx.get(url, verify=False, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return Check(
            "leader", "fail", f"cannot reach the leader at {url}: {_reason(exc)}", _reach_hint(url)
        )
    elapsed_ms = (time.monotonic() - started) * 1000
    if response.status_code != 200:
        return Check(
            "leader",
            "fail",
            f"{url} answered HTTP {response.status_code}: is this the leader's cluster port?",
            _reach_hint(url),
        )
    try:
        served = fingerprint_of_pem(response.content)
    except ConfigError:
        return Check("leader", "fail", f"{url} did not answer a certificate", _reach_hint(url))
    if served not in identity.pins:
        return Check(
            "leader",
            "fail",
            f"the leader at {identity.leader_url} serves CA {served}, but this agent pinned "
            f"{', '.join(identity.pins)}: the leader's CA was replaced (or another server "
            "answers there)",
            reregister_hint(identity.label),
        )
    if verify:
        failure = _verified_failure(identity, url, timeout_s)
        if failure is not None:
            return failure
    return Check(
        "leader",
        "ok",
        f"{identity.leader_url} answers in {elapsed_ms:.0f} ms and serves the pinned CA",
    )


def _verified_failure(identity: AgentIdentity, url: str, timeout_s: float) -> Check | None:
    """The leader reached as the dial loop reaches it; a failing check, or ``None``."""
    try:
        context = client_ssl_context(identity)
    except ConfigError as exc:
        return Check("leader", "fail", str(exc), reregister_hint(identity.label))
    try:
        response = httpx.get(url, verify=context, timeout=timeout_s)
    except httpx.HTTPError as exc:
        reason = _reason(exc)
        host = urlsplit(identity.leader_url).hostname or "HOST"
        if "mismatch" in reason:
            return Check(
                "leader",
                "fail",
                f"the leader's certificate does not name {host}, the host this agent dials: "
                f"{reason}",
                f"on the leader: berth config set-cluster host={host}, then restart its daemon",
            )
        return Check(
            "leader",
            "fail",
            f"TLS with the agent's certificate fails at {url}: {reason}",
            reregister_hint(identity.label),
        )
    if response.status_code != 200:
        return Check(
            "leader",
            "fail",
            f"{url} answered HTTP {response.status_code} over the agent's TLS",
            _reach_hint(url),
        )
    return None


def _reason(exc: BaseException) -> str:
    """The innermost useful reason of an httpx error (the TLS or socket error behind it)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return str(cause.verify_message or cause)
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    return str(exc) or exc.__class__.__name__


def _reach_hint(url: str) -> str:
    parts = urlsplit(url)
    return (
        f"on the leader, berth daemon status; from here, check that {parts.hostname} port "
        f"{parts.port or 443} is reachable (firewall, cluster_bind)"
    )
