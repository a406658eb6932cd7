"""The agent's identity on its host: what ``berth agent register`` writes, the dial loop reads.

Under the agent's ``$BERTH_HOME``:

- ``agent.yaml``: ``leader_url`` (the cluster URL), ``node_id``, ``label``,
  ``ca_fingerprint`` (``sha256:<hex>``, pinned at registration), ``enrolled_at`` (ISO 8601,
  UTC) and, once the leader sent a trust bundle over the link, ``ca_fingerprints`` (every
  root of it); the operator may add ``policy:``, the host's agent policy
  (:mod:`berth.agent.policy`);
- ``agent.key``: the agent's EC P-256 private key, PKCS#8 PEM, mode 0600 from creation;
- ``agent.crt``: its client certificate, signed by the leader's CA (CN = node id), short
  lived and renewed over the link (:mod:`berth.agent.renewal`);
- ``ca.pem``: the leader's CA certificates (one, or two during a CA rotation), each pinned
  by fingerprint; the only trust roots.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from berth.agent.cert_pair import settle_renewed_pair
from berth.atomic import write_atomic
from berth.cluster.pki.ca import fingerprint_of_pem
from berth.errors import AuthError, ConfigError
from berth.paths import BerthHome

_REGISTER_HINT = "run `berth agent register --uri '...'` on this host"


@dataclass(frozen=True)
class AgentIdentity:
    """Who this agent is and how it reaches and trusts its leader."""

    leader_url: str
    node_id: str
    label: str
    ca_fingerprint: str
    enrolled_at: datetime
    cert_path: Path
    key_path: Path
    ca_path: Path
    #: every CA fingerprint ``ca.pem`` may hold (the registration's pin, or the roots of
    #: the last trust bundle the leader sent)
    ca_fingerprints: tuple[str, ...] = ()

    @property
    def pins(self) -> tuple[str, ...]:
        return self.ca_fingerprints or (self.ca_fingerprint,)


def read_agent_document(path: Path) -> dict[str, object]:
    """``agent.yaml`` at ``path`` as a mapping (its identity fields, and ``policy:``).

    Raises :class:`ConfigError` naming the file, saying to run ``berth agent register``
    when it is missing or not a mapping, and naming the line and saying to fix the file
    when it is not valid YAML (registering again would overwrite a hand-written policy).
    """
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"this host is not enrolled; {_REGISTER_HINT}", path=path) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the agent identity: {exc.strerror}", path=path) from None
    except yaml.YAMLError as exc:
        line = (
            exc.problem_mark.line + 1
            if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark
            else None
        )
        # A syntax error is most likely a hand edit (the policy: is written by hand), and
        # registering again would overwrite it: say to fix the file, at its line.
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(
            f"invalid YAML ({problem}); fix the file (registering again would overwrite a "
            "hand-written policy:)",
            path=path,
            line=line,
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping; {_REGISTER_HINT} again", path=path)
    return data


def load_agent_identity(home: BerthHome) -> AgentIdentity:
    """Read ``agent.yaml`` under ``home`` and check its certificate files exist.

    Raises :class:`ConfigError` naming the file, and saying to run ``berth agent
    register``, when it is missing, is not valid YAML, lacks a field, or a file it needs
    is missing.
    """
    path = home.agent_config
    settle_renewed_pair(home)
    data = read_agent_document(path)
    fields: dict[str, str] = {}
    for name in ("leader_url", "node_id", "label", "ca_fingerprint", "enrolled_at"):
        value = data.get(name)
        if isinstance(value, datetime):
            value = value.isoformat()
        if not isinstance(value, str) or not value:
            raise ConfigError(f"missing or invalid {name}; {_REGISTER_HINT} again", path=path)
        fields[name] = value
    try:
        enrolled_at = datetime.fromisoformat(fields["enrolled_at"])
    except ValueError:
        raise ConfigError(f"invalid enrolled_at; {_REGISTER_HINT} again", path=path) from None
    pins = data.get("ca_fingerprints") or []
    if not isinstance(pins, list) or not all(isinstance(p, str) for p in pins):
        raise ConfigError(f"invalid ca_fingerprints; {_REGISTER_HINT} again", path=path)
    for needed in (home.agent_cert, home.agent_key, home.agent_ca):
        if not needed.is_file():
            raise ConfigError(f"{needed} is missing; {_REGISTER_HINT} again", path=path)
    return AgentIdentity(
        leader_url=fields["leader_url"],
        node_id=fields["node_id"],
        label=fields["label"],
        ca_fingerprint=fields["ca_fingerprint"],
        enrolled_at=enrolled_at if enrolled_at.tzinfo else enrolled_at.replace(tzinfo=UTC),
        cert_path=home.agent_cert,
        key_path=home.agent_key,
        ca_path=home.agent_ca,
        ca_fingerprints=tuple(pins),
    )


def save_agent_identity(
    home: BerthHome,
    *,
    leader_url: str,
    node_id: str,
    label: str,
    ca_fingerprint: str,
    key_pem: bytes,
    cert_pem: bytes,
    ca_pem: bytes,
    enrolled_at: datetime,
    ca_fingerprints: list[str] | None = None,
) -> AgentIdentity:
    """Write the identity files (each replaced atomically; the key created mode 0600) and
    ``agent.yaml`` last, so a half-written registration is never taken for a whole one."""
    home.root.mkdir(parents=True, exist_ok=True)
    os.chmod(home.root, 0o700)
    write_atomic(home.agent_key, key_pem, mode=0o600)
    write_atomic(home.agent_cert, cert_pem, mode=0o644)
    write_atomic(home.agent_ca, ca_pem, mode=0o644)
    document: dict[str, object] = {
        "leader_url": leader_url,
        "node_id": node_id,
        "label": label,
        "ca_fingerprint": ca_fingerprint,
        "enrolled_at": enrolled_at.astimezone(UTC).isoformat(),
    }
    if ca_fingerprints and ca_fingerprints != [ca_fingerprint]:
        document["ca_fingerprints"] = list(ca_fingerprints)
    write_atomic(home.agent_config, yaml.safe_dump(document, sort_keys=False), mode=0o600)
    return load_agent_identity(home)


def pinned_certificate(pem: bytes, fingerprint: str) -> bytes:
    """``pem`` re-encoded, if it holds exactly one certificate and its fingerprint is
    ``fingerprint``; :class:`AuthError` otherwise.

    Exactly one: a bundle whose first certificate matches could smuggle in a second CA that
    every later TLS connection would trust.
    """
    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise AuthError(f"the leader's CA is not a PEM certificate: {exc}") from None
    if len(certificates) != 1:
        raise AuthError(
            f"the leader sent {len(certificates)} CA certificates, not one; refusing to enroll"
        )
    canonical = certificates[0].public_bytes(serialization.Encoding.PEM)
    found = fingerprint_of_pem(canonical)
    if found != fingerprint:
        raise AuthError(
            f"the leader's CA fingerprint {found} does not match the pinned "
            f"{fingerprint}; refusing to trust it"
        )
    return canonical


def pinned_bundle(pem: bytes, fingerprints: tuple[str, ...]) -> bytes:
    """Every certificate of ``pem`` re-encoded, if there is at least one and each one's
    fingerprint is among ``fingerprints``; :class:`AuthError` otherwise.

    Every root is read (a CA rotation puts two in the file), and none that was not pinned
    is let in.
    """
    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise AuthError(f"the cluster CA file holds no PEM certificate: {exc}") from None
    out = b""
    for certificate in certificates:
        canonical = certificate.public_bytes(serialization.Encoding.PEM)
        found = fingerprint_of_pem(canonical)
        if found not in fingerprints:
            raise AuthError(
                f"the cluster CA file holds {found}, which does not match the pinned "
                f"{', '.join(fingerprints)}; refusing to trust it"
            )
        out += canonical
    return out


def client_ssl_context(identity: AgentIdentity) -> ssl.SSLContext:
    """The agent's TLS 1.2+ client context: its certificate and key, the pinned CA roots
    (every one in ``ca.pem``) as the *only* trust roots (never the system's), host names
    checked."""
    # The CA file is checked against the pinned fingerprints every time.
    try:
        ca_pem = pinned_bundle(identity.ca_path.read_bytes(), identity.pins)
    except OSError as exc:
        raise ConfigError(f"cannot read the cluster CA: {exc}", path=identity.ca_path) from None
    except AuthError as exc:
        raise ConfigError(str(exc), path=identity.ca_path) from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cadata=ca_pem.decode())
    try:
        context.load_cert_chain(str(identity.cert_path), str(identity.key_path))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"the agent's certificate {identity.cert_path} and key {identity.key_path} cannot "
            f"be used ({exc.__class__.__name__}: {exc}); run 'berth agent register' again"
        ) from None
    return context
