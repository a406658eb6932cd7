"""The agent's side of certificate renewal: renew over the live link before the leaf expires.

The agent's client certificate is short lived (a day by default, the leader's
``agent_cert_lifetime_s``).  While a link is up and the leader offers ``op.renew`` in
Welcome, :class:`CertificateRenewer` waits until about two thirds of the certificate's
lifetime has passed (:func:`renewal_due_at`, on the leader's clock as Welcome told it),
then makes a new EC P-256 key, sends a CSR signed by it (``renew``) and, on an answer whose
certificate is for that key, names this node and chains to a root of the bundle sent with
it, writes the new pair (:mod:`berth.agent.cert_pair`) and the trust bundle.  The link and
its streams carry on; the next dial uses the new pair.  A failure is retried with capped,
jittered backoff (at most a twentieth of the lifetime apart) and shown in the status.

:func:`read_certificate` and :func:`certificate_line` serve ``berth agent status``, which
reads ``agent.crt`` itself, so an agent whose certificate expired while it was offline
says so (with :data:`REENROLL_HINT`) even when it is not running.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from berth.agent.cert_pair import save_trust_bundle, write_renewed_pair
from berth.agent.spec_keys import save_spec_keys
from berth.agent.status import AgentStatus
from berth.backoff import jittered_delay_s
from berth.cluster.link.connection import LinkConnection
from berth.cluster.pki.ca import CLOCK_SKEW, fingerprint_of_der, fingerprint_of_pem
from berth.cluster.protocol.errors import LinkError
from berth.cluster.protocol.frames import Welcome
from berth.cluster.protocol.ops import RENEW, RenewArgs, RenewResult
from berth.cluster.protocol.spec_signing import SpecKeys
from berth.errors import BerthError, ConfigError
from berth.humanize import age
from berth.paths import BerthHome

log = logging.getLogger(__name__)

#: The share of a certificate's lifetime after which it is renewed.
RENEW_AT_FRACTION = 2 / 3
#: Seconds the leader has to answer one renewal.
RENEW_TIMEOUT_S = 30.0
#: The longest wait between two failed renewals, in seconds.
RETRY_MAX_S = 300.0
#: What fixes an agent whose certificate expired: enrolling it again.
REENROLL_HINT = (
    "berth agent register --uri '<the URI that `berth nodes enroll {label}` prints on the leader>'"
)


@dataclass(frozen=True)
class CertificateFacts:
    """What the agent knows of its certificate: the serial (hex), validity (epoch s)."""

    serial: str
    not_before: float
    not_after: float
    #: ``sha256:<hex>`` of the DER certificate ("" when not read from one)
    fingerprint: str = ""

    @property
    def issued_at(self) -> float:
        """When it was issued: berth backdates notBefore by ``CLOCK_SKEW``."""
        backdated = self.not_before + CLOCK_SKEW.total_seconds()
        return backdated if backdated < self.not_after else self.not_before

    @property
    def lifetime_s(self) -> float:
        return self.not_after - self.issued_at

    @property
    def renew_at(self) -> float:
        return renewal_due_at(self.not_before, self.not_after)


def renewal_due_at(not_before: float, not_after: float) -> float:
    """When a certificate valid from ``not_before`` (backdated by ``CLOCK_SKEW``) until
    ``not_after`` should be renewed: two thirds into its lifetime (epoch seconds)."""
    facts = CertificateFacts("", not_before, not_after)
    return facts.issued_at + facts.lifetime_s * RENEW_AT_FRACTION


def read_certificate(path: Path) -> CertificateFacts | None:
    """The first certificate in ``path``, or ``None`` when it is missing or unreadable."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None
    return _facts(cert)


def _facts(cert: x509.Certificate) -> CertificateFacts:
    return CertificateFacts(
        serial=format(cert.serial_number, "x"),
        not_before=cert.not_valid_before_utc.timestamp(),
        not_after=cert.not_valid_after_utc.timestamp(),
        fingerprint=fingerprint_of_der(cert.public_bytes(serialization.Encoding.DER)),
    )


def certificate_line(facts: CertificateFacts, now: float) -> str:
    """``expires in 15h (serial 3fa2...)`` or ``EXPIRED 2h ago (serial ...)``."""
    serial = f"serial {facts.serial[:12]}"
    if facts.not_after <= now:
        return f"EXPIRED {age(now - facts.not_after)} ago ({serial})"
    return f"expires in {age(facts.not_after - now)} ({serial})"


def retry_delay(attempt: int, facts: CertificateFacts, rand: Callable[[], float]) -> float:
    """Seconds before renewal retry ``attempt`` (0 first): the redial backoff, capped at
    a twentieth of the lifetime (at least 1 s, at most :data:`RETRY_MAX_S`)."""
    cap_s = min(RETRY_MAX_S, max(1.0, facts.lifetime_s / 20))
    return jittered_delay_s(attempt, first_s=min(1.0, cap_s), cap_s=cap_s, rand=rand)


class RenewalRejected(BerthError):
    """The leader's renewal answer is not usable (the message says why)."""


class CertificateRenewer:
    """Renews ``home``'s certificate over live links (see the module docstring).

    ``status`` shows the certificate and the renewal's state; ``on_renewed`` runs after a
    new pair is on disk.  ``clock`` returns epoch seconds, ``rand`` jitters retries.
    """

    def __init__(
        self,
        home: BerthHome,
        node_id: str,
        status: AgentStatus,
        *,
        on_renewed: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._home = home
        self._node_id = node_id
        self._status = status
        self._on_renewed = on_renewed
        self._clock = clock
        self._rand = rand
        self.renewals = 0

    def show(self) -> CertificateFacts | None:
        """Put the certificate on disk into the status; return what was read."""
        facts = read_certificate(self._home.agent_cert)
        if facts is not None:
            self._status.certificate(facts.serial, facts.not_after)
        return facts

    async def run(self, conn: LinkConnection, welcome: Welcome) -> None:
        """Renew whenever due while ``conn`` is open; returns when it closes (cancel it
        with the link)."""
        if RENEW.capability not in welcome.capabilities:
            self._status.renewal("the leader does not renew certificates (an older leader)")
            return
        offset_s = welcome.server_time - self._clock()  # the leader's clock minus ours
        attempt = 0
        while not conn.closed:
            facts = self.show()
            if facts is None:
                self._status.renewal("cannot read agent.crt; not renewing")
                return
            wait_s = facts.renew_at - (self._clock() + offset_s)
            if attempt == 0:
                due = time.localtime(self._clock() + max(0.0, wait_s))
                self._status.renewal(f"next renewal at {time.strftime('%H:%M:%S', due)}")
            if wait_s > 0:
                await asyncio.sleep(wait_s)
                continue
            try:
                renewed = await self.renew_once(conn)
            except (LinkError, BerthError, OSError) as exc:
                if conn.closed:
                    return
                delay_s = retry_delay(attempt, facts, self._rand)
                attempt += 1
                text = f"renewal failed (attempt {attempt}): {exc}; retrying in {delay_s:.1f} s"
                log.warning("%s", text)
                self._status.renewal(text, error=True)
                await asyncio.sleep(delay_s)
                continue
            attempt = 0
            self.renewals += 1
            self._status.activity(
                f"certificate renewed: serial {renewed.serial[:12]}, "
                f"valid {age(renewed.not_after - self._clock())}"
            )

    async def renew_once(self, conn: LinkConnection) -> CertificateFacts:
        """One renewal: a new key, its CSR over ``conn``, the checked answer written.

        Raises :class:`RemoteOpError` when the leader refuses, :class:`LinkError` when
        the link fails, :class:`RenewalRejected` for an unusable answer, :class:`OSError`
        when the files cannot be written.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self._node_id)]))
            .sign(key, hashes.SHA256())
        )
        args = RenewArgs(csr_pem=csr.public_bytes(serialization.Encoding.PEM).decode())
        result = await conn.call(RENEW, args, timeout_s=RENEW_TIMEOUT_S)
        cert, roots = self._check(result, key)
        try:  # checked before anything is written
            if result.spec_keys_pem.strip():
                SpecKeys.from_pem(result.spec_keys_pem.encode())
        except (ConfigError, UnicodeEncodeError) as exc:
            raise RenewalRejected(f"the leader's spec signing keys do not parse: {exc}") from None
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        bundle = b"".join(root.public_bytes(serialization.Encoding.PEM) for root in roots)
        fingerprints = [fingerprint_of_pem(root.public_bytes(serialization.Encoding.PEM))
                        for root in roots]  # fmt: skip
        await asyncio.to_thread(self._write, key_pem, cert, bundle, fingerprints)
        await asyncio.to_thread(save_spec_keys, self._home, result.spec_keys_pem)
        facts = _facts(cert)
        self._status.certificate(facts.serial, facts.not_after)
        if self._on_renewed is not None:
            self._on_renewed()
        return facts

    def _write(
        self, key_pem: bytes, cert: x509.Certificate, bundle: bytes, fingerprints: list[str]
    ) -> None:
        # The bundle first: the new certificate may be issued by a root only it holds.
        save_trust_bundle(self._home, bundle, fingerprints)
        write_renewed_pair(self._home, key_pem, cert.public_bytes(serialization.Encoding.PEM))

    def _check(
        self, result: RenewResult, key: ec.EllipticCurvePrivateKey
    ) -> tuple[x509.Certificate, list[x509.Certificate]]:
        try:
            cert = x509.load_pem_x509_certificate(result.certificate_pem.encode())
            roots = x509.load_pem_x509_certificates(result.ca_bundle_pem.encode())
        except ValueError as exc:
            raise RenewalRejected(f"the leader's answer does not parse: {exc}") from None
        if cert.public_key() != key.public_key():
            raise RenewalRejected("the renewed certificate is not for the new key")
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not names or names[0].value != self._node_id:
            raise RenewalRejected(f"the renewed certificate does not name {self._node_id}")
        for root in roots:
            try:
                cert.verify_directly_issued_by(root)
            except (ValueError, TypeError, InvalidSignature):
                continue
            return cert, roots
        raise RenewalRejected("the renewed certificate chains to no root of the bundle")
