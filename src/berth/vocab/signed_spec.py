"""A deployment spec signed by the cluster: :class:`SignedSpec`.

The leader signs the spec of a deployment the admin API or CLI accepted with the cluster's
signing key (Ed25519, :mod:`berth.cluster.pki.signing_key`); the signature travels with every
start of it, and the agent that runs it checks both (:mod:`berth.cluster.protocol.spec_signing`
says what is signed and how it is checked).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SignedSpec:
    """``spec``: the canonical bytes that were signed (compact sorted-key JSON, UTF-8);
    ``signature``: the 64-byte Ed25519 signature over them; ``key_id``: which key signed
    (``ed25519:`` and the first 16 hex digits of the SHA-256 of the raw public key)."""

    spec: bytes
    signature: bytes
    key_id: str
