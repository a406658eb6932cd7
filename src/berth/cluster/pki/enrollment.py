"""Enrollment: how a new host becomes a node, on the leader's side.

1. ``berth nodes enroll LABEL`` issues a single-use token (``secrets.token_urlsafe``, valid
   :data:`TOKEN_VALIDITY_S`) and prints an :class:`EnrollmentURI` carrying the leader's
   cluster URL, the token and the CA fingerprint.
2. ``berth agent register --uri ...`` on the new host pins the CA by that fingerprint, makes
   its own key pair and sends a CSR with the token to ``POST /admin/nodes/register``.
3. :meth:`EnrollmentService.register` spends the token, signs the CSR with the node id the
   leader chose as common name, and records the certificate's fingerprint in the store.

Tokens are stored as ``HMAC-SHA256(pepper, token)`` like API keys (:mod:`berth.keys`).  Every
registration attempt is appended to the audit log, good or bad, with the start of that hash
(:func:`audit_token_hash`), never any of the token itself.  Pure parts (the URI, label
validation, the rate limiter) take plain values and a ``now``; nothing reads a clock itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import parse_qs, urlencode, urlsplit

from cryptography import x509

from berth.cluster.pki.ca import CertificateAuthority, fingerprint_of_pem
from berth.cluster.pki.signing_key import trusted_in
from berth.errors import BerthError, ConfigError, EnrollmentTokenError
from berth.keys import hash_secret
from berth.store import Store
from berth.vocab.records import NodeCertificate, NodeRecord

#: Seconds an enrollment token stays valid.
TOKEN_VALIDITY_S: Final = 600.0
#: Hex characters of a presented token's hash kept in the audit log (64 bits: enough to tell
#: attempts with one token from those with another; nothing of the token itself).
AUDIT_TOKEN_HASH_CHARS: Final = 16
#: Validity of an agent's client certificate, in seconds (the ``agent_cert_lifetime_s``
#: setting's default): a day, renewed over the link at two thirds of it.
AGENT_CERT_LIFETIME_S: Final = 86400.0
#: Registration attempts allowed per source address within :data:`RATE_WINDOW_S`.
RATE_MAX_ATTEMPTS: Final = 10
RATE_WINDOW_S: Final = 60.0

URI_SCHEME: Final = "berth"
_URI_ACTION = "enroll"
_FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{64}$")
#: Node labels: like a DNS label (RFC 1123), lowercase only.
#: An RFC 1123 host label: letters, digits and inner hyphens, 1-63 characters.
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
#: The shape of the ids the leader gives nodes; a label must not look like one.
_NODE_ID = re.compile(r"^n-[0-9a-f]{8}$")


def validate_node_label(label: str) -> str:
    """Return ``label`` if it is an RFC 1123 host label (1-63 characters of ``[a-z0-9-]``,
    starting and ending with a letter or digit), does not look like a node id (``n-`` and 8
    hex digits) and is not ``local``; otherwise raise :class:`ConfigError` saying why."""
    if not _LABEL.match(label):
        raise ConfigError(
            f"invalid node label {label!r}: use 1-63 characters a-z, 0-9 and '-', "
            "starting and ending with a letter or digit"
        )
    if _NODE_ID.match(label):
        raise ConfigError(f"invalid node label {label!r}: it looks like a node id")
    if label == "local":
        raise ConfigError("the label 'local' is the leader's own node; choose another")
    return label


@dataclass(frozen=True)
class EnrollmentURI:
    """``berth://enroll?leader=<https URL>&token=<secret>&ca_fp=sha256:<hex>``, and with
    shared leadership ``&leaders=<URL>,<URL>...`` (every leader's cluster URL)."""

    leader_url: str
    token: str
    ca_fingerprint: str
    leaders: tuple[str, ...] = ()

    def __str__(self) -> str:
        fields = {"leader": self.leader_url, "token": self.token, "ca_fp": self.ca_fingerprint}
        if self.leaders:
            fields["leaders"] = ",".join(self.leaders)
        query = urlencode(
            fields,
            safe=":/,",  # allowed in a query as they are (RFC 3986 section 3.4): readable
        )
        return f"{URI_SCHEME}://{_URI_ACTION}?{query}"

    @classmethod
    def parse(cls, text: str) -> EnrollmentURI:
        """Parse an enrollment URI; :class:`ConfigError` saying what is wrong with it."""
        parts = urlsplit(text.strip())
        if parts.scheme != URI_SCHEME or parts.netloc != _URI_ACTION:
            raise ConfigError(
                f"not an enrollment URI (expected {URI_SCHEME}://{_URI_ACTION}?...): {text!r}"
            )
        query = parse_qs(parts.query, keep_blank_values=True)
        values: dict[str, str] = {}
        for name in ("leader", "token", "ca_fp"):
            found = query.get(name, [])
            if len(found) != 1 or not found[0]:
                raise ConfigError(f"the enrollment URI needs exactly one non-empty {name}=")
            values[name] = found[0]
        leader = urlsplit(values["leader"])
        if leader.scheme != "https" or not leader.hostname:
            raise ConfigError(
                f"the enrollment URI's leader must be an https:// URL, got {values['leader']!r}"
            )
        if not _FINGERPRINT.match(values["ca_fp"]):
            raise ConfigError(
                f"the enrollment URI's ca_fp must be sha256:<64 hex digits>, got "
                f"{values['ca_fp']!r}"
            )
        leaders = tuple(
            u.rstrip("/") for u in ",".join(query.get("leaders", [])).split(",") if u.strip()
        )
        for url in leaders:
            if not url.startswith("https://"):
                raise ConfigError(f"the enrollment URI's leaders must be https:// URLs: {url!r}")
        return cls(values["leader"].rstrip("/"), values["token"], values["ca_fp"], leaders)


def new_enrollment_token() -> str:
    """A fresh token: 32 url-safe random bytes (256 bits)."""
    return secrets.token_urlsafe(32)


def hash_enrollment_token(token: str, pepper: bytes) -> str:
    """What the store keeps of a token: ``HMAC-SHA256(pepper, token)`` in hex."""
    return hash_secret(token, pepper)


class RegistrationRateLimiter:
    """A sliding-window limit of failed registration attempts per source address (pure, no
    clock).

    What counts is what a token guesser makes: attempts that failed, and attempts still in
    progress (so a burst of concurrent guesses is held to the limit too, before any of them
    has failed). A registration that enrolled a node stops counting (:meth:`succeeded`): an
    operator enrolling many hosts from one address (behind one NAT, or one provisioning
    host) is never refused for it. Attempts refused by the limiter do not count, so a client
    that backs off for the advertised time gets through.
    """

    def __init__(
        self, max_attempts: int = RATE_MAX_ATTEMPTS, window_s: float = RATE_WINDOW_S
    ) -> None:
        self._max = max_attempts
        self._window_s = window_s
        self._attempts: dict[str, deque[float]] = {}

    def check(self, address: str, now: float) -> float | None:
        """Count an attempt from ``address`` beginning at ``now`` (seconds, any monotonic
        origin), until :meth:`succeeded` says it enrolled.

        Returns ``None`` when allowed, else the seconds until the oldest counted attempt in
        the window expires (the ``Retry-After``), without counting this one.
        """
        self._forget_idle(now)
        times = self._attempts.setdefault(address, deque())
        while times and times[0] <= now - self._window_s:
            times.popleft()
        if len(times) >= self._max:
            return times[0] + self._window_s - now
        times.append(now)
        return None

    def succeeded(self, address: str, attempted_at: float) -> None:
        """The attempt from ``address`` that :meth:`check` allowed at ``attempted_at``
        enrolled a node: it no longer counts."""
        times = self._attempts.get(address)
        if times is not None:
            with contextlib.suppress(ValueError):  # already out of the window
                times.remove(attempted_at)

    def _forget_idle(self, now: float) -> None:
        idle = [a for a, t in self._attempts.items() if not t or t[-1] <= now - self._window_s]
        for address in idle:
            del self._attempts[address]


class AuditLog:
    """Appends one JSON object per line to ``path`` (created mode 0600)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self._path

    def append(self, event: Mapping[str, object]) -> None:
        """Write ``event`` as one line; one ``write`` on an ``O_APPEND`` descriptor, so lines
        from concurrent writers never interleave."""
        line = (json.dumps(dict(event), sort_keys=True, default=str) + "\n").encode()
        with self._lock:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)


def audit_token_hash(token: str, pepper: bytes) -> str | None:
    """What the audit log keeps of a presented ``token``: the first
    :data:`AUDIT_TOKEN_HASH_CHARS` hex characters of ``HMAC-SHA256(pepper, token)`` (the
    store's hash of an issued token starts with the same ones), ``None`` when none was given.

    A keyed hash and not a prefix of the token: a prefix would shorten a guess at a token
    whose attempt was logged (and a mistyped or misplaced secret would be partly logged).
    """
    if not token:
        return None
    return hash_enrollment_token(token, pepper)[:AUDIT_TOKEN_HASH_CHARS]


@dataclass(frozen=True)
class IssuedToken:
    """A fresh enrollment token, as ``berth nodes enroll`` shows it (the secret only once)."""

    uri: EnrollmentURI
    label: str
    expires_at: float


@dataclass(frozen=True)
class Registration:
    """What a successful registration returns to the agent."""

    node_id: str
    label: str
    certificate_pem: str
    ca_pem: str
    cluster_url: str
    #: the cluster's spec signing keys (public, PEM, current first): the agent pins them
    spec_keys_pem: str = ""


def check_csr(csr_pem: str) -> None:
    """Refuse a CSR that does not parse or whose self-signature is wrong (:class:`ConfigError`),
    before a token is spent on it."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
    except ValueError as exc:
        raise ConfigError(f"invalid certificate signing request: {exc}") from None
    if not csr.is_signature_valid:
        raise ConfigError("the certificate signing request's signature is invalid")


def issued_certificate(
    node_id: str, cert_pem: bytes, ca: CertificateAuthority, now: float
) -> NodeCertificate:
    """The store's record of ``cert_pem``, just issued to ``node_id`` by ``ca``."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return NodeCertificate(
        node_id=node_id,
        fingerprint=fingerprint_of_pem(cert_pem),
        serial=format(cert.serial_number, "x"),
        not_after=cert.not_valid_after_utc.timestamp(),
        issuer_fingerprint=ca.fingerprint_sha256,
        issued_at=now,
    )


class EnrollmentService:
    """The leader's enrollment logic: issue tokens, register agents, audit every attempt.

    ``cluster_url`` is the URL agents dial (advertised in URIs and registration answers);
    ``clock`` returns epoch seconds.  Methods are synchronous (store and crypto work); the
    async edges call them through ``asyncio.to_thread``.
    """

    def __init__(
        self,
        *,
        store: Store,
        ca: CertificateAuthority,
        pepper: bytes,
        cluster_url: str,
        audit: AuditLog,
        clock: Callable[[], float] = time.time,
        cert_lifetime_s: float = AGENT_CERT_LIFETIME_S,
    ) -> None:
        self._store = store
        self._ca = ca
        self._pepper = pepper
        self.cluster_url = cluster_url
        self._audit = audit
        self._clock = clock
        self.cert_lifetime_s = cert_lifetime_s
        #: every shared leader's cluster URL, for the URI (set with ``leader_ha``)
        self.leaders: Callable[[], Sequence[str]] | None = None

    def issue_token(self, label: str) -> IssuedToken:
        """Store a new token for ``label`` and return its URI and expiry (epoch s).

        Raises :class:`ConfigError` for an invalid label (or ``local``).
        """
        validate_node_label(label)
        token = new_enrollment_token()
        expires_at = self._clock() + TOKEN_VALIDITY_S
        self._store.create_enrollment_token(
            label, hash_enrollment_token(token, self._pepper), expires_at
        )
        leaders = tuple(self.leaders()) if self.leaders is not None else ()
        # The root the leader's server certificate chains to (the old one during a rotation).
        uri = EnrollmentURI(self.cluster_url, token, self._ca.server_root_fingerprint, leaders)
        return IssuedToken(uri=uri, label=label, expires_at=expires_at)

    def register(self, token: str, csr_pem: str, source_address: str) -> Registration:
        """Enroll the agent holding ``token``: sign its CSR with a leader-chosen node id.

        Raises :class:`ConfigError` for a malformed CSR (the token is not spent),
        :class:`EnrollmentTokenError` for an unknown, used or expired token, and
        :class:`ConflictError` when the same label is registered concurrently.  The attempt
        is audited whatever the outcome.
        """
        event = self._attempt(token, source_address)
        try:
            check_csr(csr_pem)
            label = self._store.consume_enrollment_token(
                hash_enrollment_token(token, self._pepper), self._clock()
            )
            event["label"] = label
            node_id = self._store.propose_node_id(label)
            event["node_id"] = node_id
            cert_pem = self._ca.sign_csr(
                csr_pem.encode(), common_name=node_id, lifetime_s=self.cert_lifetime_s
            )
            record: NodeRecord = self._store.enroll_node(
                label, fingerprint_of_pem(cert_pem), node_id=node_id
            )
            self._store.record_node_certificate(
                issued_certificate(record.id, cert_pem, self._ca, self._clock()), replace=True
            )
        except BerthError as exc:
            reason = exc.reason if isinstance(exc, EnrollmentTokenError) else str(exc)
            self.audit(event, outcome="refused", reason=reason)
            raise
        self.audit(event, outcome="enrolled", reason=None)
        return Registration(
            node_id=record.id,
            label=record.label,
            certificate_pem=cert_pem.decode(),
            ca_pem=self._ca.trust_bundle_pem.decode(),  # both roots during a rotation
            cluster_url=self.cluster_url,
            spec_keys_pem=trusted_in(self._ca.ca_dir).to_pem().decode("ascii"),
        )

    def audit(self, event: Mapping[str, object], *, outcome: str, reason: str | None) -> None:
        """Append ``event`` with its time, ``outcome`` and ``reason`` to the audit log."""
        self._audit.append({**event, "time": self._clock(), "outcome": outcome, "reason": reason})

    def audit_malformed(self, token: str, source_address: str) -> None:
        """Audit an attempt whose body was not ``{"token": ..., "csr_pem": ...}`` (``token``:
        whatever string it held, or ``""``)."""
        self.audit(
            self._attempt(token, source_address),
            outcome="refused",
            reason="malformed request body",
        )

    def audit_rate_limited(self, token: str, source_address: str, retry_after_s: float) -> None:
        """Audit an attempt the rate limiter refused before it reached :meth:`register`."""
        self.audit(
            self._attempt(token, source_address),
            outcome="rate_limited",
            reason=f"over {RATE_MAX_ATTEMPTS} attempts in {RATE_WINDOW_S:.0f}s; "
            f"retry after {retry_after_s:.0f}s",
        )

    def _attempt(self, token: str, source_address: str) -> dict[str, object]:
        """The audit event of one registration attempt, before its outcome is known."""
        return {
            "event": "node.register",
            "source_address": source_address,
            "token_hash": audit_token_hash(token, self._pepper),
            "label": None,
            "node_id": None,
        }
