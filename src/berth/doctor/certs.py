"""Checks of the leader's TLS material: the berth CA and the server certificates of the public
and cluster listeners (validity, issuer, key, SANs).

The leader issues its listeners' certificates itself at every start
(:meth:`~berth.cluster.pki.ca.CertificateAuthority.ensure_server_certificate`), re-issuing one
that is expired, within :data:`~berth.cluster.pki.ca.RENEW_BEFORE_DAYS` of expiry, from another
CA or missing a host.  So such a problem only fails while a daemon serves the old file;
otherwise the next start mends it and the check warns.  A certificate the operator supplies
(``public_cert``) is never replaced by berth: its problems fail.
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from berth.cluster.pki.ca import CA_CERT_FILE, CA_KEY_FILE, RENEW_BEFORE_DAYS, fingerprint_of_pem
from berth.doctor.check import Check, Verdict

#: A certificate this close to its end warns (the leader renews its own at this distance).
EXPIRY_WARN_DAYS = RENEW_BEFORE_DAYS
_RESTART = "berth daemon stop && berth daemon start (a start re-issues it)"
_START = "berth daemon start (it re-issues the certificate)"
_RENEW = "renew the certificate (e.g. certbot renew), then restart the daemon"
_NEW_CA = (
    "move the ca/ folder aside, start the daemon (it makes a new CA), then re-register "
    "every agent: berth nodes enroll LABEL on the leader, berth agent register --force "
    "--uri URI on the agent"
)


def load_certificate(path: Path) -> x509.Certificate:
    """The first certificate in the PEM file ``path``.

    Raises :class:`OSError` when the file cannot be read and :class:`ValueError` when it
    holds no PEM certificate.
    """
    return x509.load_pem_x509_certificate(path.read_bytes())


def validity(cert: x509.Certificate, now: datetime) -> tuple[Verdict, str]:
    """Whether ``cert`` is valid at ``now`` (an aware datetime), and for how long.

    ``fail`` before notBefore or after notAfter, ``warn`` with less than
    :data:`EXPIRY_WARN_DAYS` days left, else ``ok``; the text gives the date and days.
    """
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now < start:
        return "fail", f"not valid before {start:%Y-%m-%d %H:%M} UTC (is the clock right?)"
    days_left = (end - now).total_seconds() / 86400
    if days_left <= 0:
        ago = f"{round(-days_left)} days ago" if days_left <= -1 else "today"
        return "fail", f"expired on {end:%Y-%m-%d} ({ago})"
    if days_left < EXPIRY_WARN_DAYS:
        return "warn", f"expires on {end:%Y-%m-%d}, in {round(days_left)} days"
    return "ok", f"valid until {end:%Y-%m-%d} ({round(days_left)} days left)"


def subject_alt_names(cert: x509.Certificate) -> list[str]:
    """The DNS names and IP addresses in ``cert``'s SAN extension (empty when it has none)."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*sans.get_values_for_type(x509.DNSName)] + [
        str(address) for address in sans.get_values_for_type(x509.IPAddress)
    ]


def names_host(cert: x509.Certificate, host: str) -> bool:
    """Whether a TLS client dialing ``host`` accepts ``cert``'s SANs: an IP address must be
    listed as one; a DNS name exactly (case-insensitive) or by a wildcard standing for its
    whole first label (RFC 6125 section 6.4.3: ``*.example.com`` names ``a.example.com``,
    neither ``example.com`` nor ``a.b.example.com``)."""
    text = host.strip().strip("[]").rstrip(".").lower()
    names = subject_alt_names(cert)
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        pass
    else:
        return any(_same_address(name, address) for name in names)
    for name in (name.lower().rstrip(".") for name in names):
        if name == text:
            return True
        if name.startswith("*.") and "." in text and text.split(".", 1)[1] == name[2:]:
            return True
    return False


def ca_check(ca_dir: Path, now: datetime) -> Check:
    """The berth CA in ``ca_dir``: absent (made at the first start), or a key and a matching
    certificate that is valid now and for :data:`EXPIRY_WARN_DAYS` more days."""
    cert_path, key_path = ca_dir / CA_CERT_FILE, ca_dir / CA_KEY_FILE
    if not cert_path.exists() and not key_path.exists():
        return Check("ca", "ok", f"none yet in {ca_dir} (made at the first daemon start)")
    if not key_path.exists():
        return Check("ca", "fail", f"{cert_path} is there but its key {key_path} is not", _NEW_CA)
    if not cert_path.exists():
        return Check("ca", "warn", f"{key_path} has no certificate yet", _START)
    try:
        cert = load_certificate(cert_path)
        key_pair_ok = _key_matches(cert_path, key_path)
    except (OSError, ValueError) as exc:
        return Check("ca", "fail", f"{cert_path} cannot be read: {exc}", _NEW_CA)
    if not key_pair_ok:
        return Check("ca", "fail", f"{cert_path} does not match its key {key_path}", _NEW_CA)
    verdict, when = validity(cert, now)
    fingerprint = fingerprint_of_pem(cert_path.read_bytes())
    detail = f"{cert_path}: {fingerprint}, {when}"
    return Check("ca", verdict, detail, _NEW_CA if verdict != "ok" else "")


@dataclass(frozen=True)
class ServedCertificate:
    """What one listener serves and who must accept it.

    ``name`` is the listener (``public``, ``cluster``).  ``issued_hosts`` are the hosts the
    leader issues the certificate for at start; empty for an operator's certificate, which
    berth never replaces.  ``dialed`` maps each host clients dial to the setting it comes
    from (``{"api.example.com": "public_host"}``): every one must be among the SANs.
    """

    name: str
    cert_path: Path
    key_path: Path
    issued_hosts: tuple[str, ...]
    dialed: dict[str, str]

    @property
    def issued_by_berth(self) -> bool:
        return bool(self.issued_hosts)


def server_certificate_check(
    served: ServedCertificate,
    *,
    ca_cert: x509.Certificate | None,
    daemon_running: bool,
    now: datetime,
) -> Check:
    """One listener's certificate: readable, matching its key, from the berth CA
    (``ca_cert``, when berth issues it), valid for a while yet, and naming every dialed host.

    A certificate berth issues that is absent or wrong only warns unless ``daemon_running``
    (the next start re-issues it); one a dialed host can never be named on (a ``leader_url``
    host that is not the ``cluster_host``) fails.
    """
    name = f"cert {served.name}"
    berth_issues = served.issued_by_berth
    if berth_issues:
        unissued = [h for h in served.dialed if h not in served.issued_hosts]
        if unissued:
            host = unissued[0]
            return Check(
                name,
                "fail",
                f"clients dial {host} ({served.dialed[host]}) but the leader issues the "
                f"{served.name} certificate for {', '.join(served.issued_hosts)}",
                f"berth config set-{served.name} host={host}, then restart the daemon",
            )
        if not served.cert_path.exists():
            if daemon_running:
                return Check(name, "warn", f"{served.cert_path} is missing", _RESTART)
            return Check(name, "ok", f"{served.cert_path}: issued at the next daemon start")
    else:
        for path in (served.cert_path, served.key_path):
            if not path.is_file():
                return Check(
                    name,
                    "fail",
                    f"{path} does not exist",
                    f"berth config set-{served.name}-tls cert=PATH key=PATH with existing files",
                )
    renew = (_RESTART if daemon_running else _START) if berth_issues else _RENEW
    problems, verdict, when = _inspect(served, ca_cert, now)
    if problems:
        if berth_issues:
            return Check(
                name,
                "fail" if daemon_running else "warn",
                f"{served.cert_path}: {'; '.join(problems)}",
                renew,
            )
        return Check(
            name,
            "fail",
            f"{served.cert_path}: {'; '.join(problems)}",
            _operator_hint(served, problems),
        )
    sans = ", ".join(_sans_or_none(served.cert_path))
    detail = f"{served.cert_path}: {when}; SANs {sans}"
    return Check(name, verdict, detail, renew if verdict != "ok" else "")


def _inspect(
    served: ServedCertificate, ca_cert: x509.Certificate | None, now: datetime
) -> tuple[list[str], Verdict, str]:
    """Problems that stop clients accepting the certificate, the validity verdict, and the
    validity text."""
    try:
        cert = load_certificate(served.cert_path)
    except (OSError, ValueError) as exc:
        return [f"cannot be read ({exc})"], "fail", ""
    problems: list[str] = []
    try:
        if not _key_matches(served.cert_path, served.key_path):
            problems.append(f"does not match the key {served.key_path}")
    except (OSError, ValueError) as exc:
        problems.append(f"its key {served.key_path} cannot be read ({exc})")
    if served.issued_by_berth and ca_cert is not None:
        try:
            cert.verify_directly_issued_by(ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            problems.append("not issued by this home's CA")
    verdict, when = validity(cert, now)
    if verdict == "fail":
        problems.append(when)
    hosts = served.issued_hosts or tuple(served.dialed)
    missing = [host for host in hosts if not names_host(cert, host)]
    if missing:
        problems.append(
            f"does not name {', '.join(missing)} (SANs: {', '.join(subject_alt_names(cert))})"
        )
    return problems, verdict, when


def _operator_hint(served: ServedCertificate, problems: Sequence[str]) -> str:
    text = " ".join(problems)
    if "does not name" in text:
        host = next(iter(served.dialed), "HOST")
        return (
            f"get a certificate that names {host}, or set {served.name}_host to a name it "
            f"covers: berth config set-{served.name} host=NAME"
        )
    if "key" in text:
        return f"berth config set-{served.name}-tls cert=PATH key=PATH with a matching pair"
    return _RENEW


def _sans_or_none(path: Path) -> list[str]:
    try:
        return subject_alt_names(load_certificate(path)) or ["(none)"]
    except (OSError, ValueError):
        return ["(unreadable)"]


def _key_matches(cert_path: Path, key_path: Path) -> bool:
    """Whether OpenSSL accepts the pair (the key is the certificate's); raises
    :class:`OSError` when the key cannot be read."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    key_path.stat()  # a missing or unreadable key is an OSError, not a mismatch
    try:
        context.load_cert_chain(str(cert_path), str(key_path))
    except ssl.SSLError:
        return False
    return True


def _same_address(name: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    try:
        return ipaddress.ip_address(name) == address
    except ValueError:
        return False
