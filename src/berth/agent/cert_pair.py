"""Replacing the agent's certificate and key together, so a crash never leaves a mismatch.

Each file is replaced atomically (:mod:`berth.atomic`), but a pair of files cannot be, so a
renewal writes both in three durable steps:

1. the new key to ``agent.key.next`` and the new certificate to ``agent.crt.next``;
2. ``agent.key.next`` renamed over ``agent.key``;
3. ``agent.crt.next`` renamed over ``agent.crt``.

:func:`settle_renewed_pair` (run before the identity is read) finishes what a crash cut
short: with both ``.next`` files there it does steps 2 and 3, with only the certificate's
(the key already moved) step 3; a lone ``agent.key.next`` (cut off within step 1) is
dropped, and the old pair stays.  The new trust bundle (``ca.pem``) and its pins in
``agent.yaml`` are written by :func:`save_trust_bundle`: the pins first widened to the old
and new roots, then ``ca.pem``, then the pins narrowed to the new, so the file and its pins
agree at every step.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from berth.atomic import write_atomic
from berth.paths import BerthHome


def _next(path: Path) -> Path:
    return path.with_name(path.name + ".next")


def write_renewed_pair(home: BerthHome, key_pem: bytes, cert_pem: bytes) -> None:
    """Make ``key_pem``/``cert_pem`` the agent's pair (the steps in the module docstring).

    Raises :class:`OSError` when a file cannot be written; the old pair is then still in
    place, or the new one is, once :func:`settle_renewed_pair` ran.
    """
    write_atomic(_next(home.agent_key), key_pem, mode=0o600)
    write_atomic(_next(home.agent_cert), cert_pem, mode=0o644)
    settle_renewed_pair(home)


def settle_renewed_pair(home: BerthHome) -> None:
    """Finish a pair replacement a crash interrupted (see the module docstring)."""
    key_next, cert_next = _next(home.agent_key), _next(home.agent_cert)
    if not cert_next.exists():
        key_next.unlink(missing_ok=True)
        return
    if key_next.exists():
        os.replace(key_next, home.agent_key)
    os.replace(cert_next, home.agent_cert)
    _sync_directory(home.root)


def save_trust_bundle(home: BerthHome, bundle_pem: bytes, fingerprints: list[str]) -> None:
    """Make ``bundle_pem`` (already checked: every root of it) the agent's ``ca.pem`` and
    ``fingerprints`` its pins in ``agent.yaml``.  Raises :class:`OSError`."""
    document = yaml.safe_load(home.agent_config.read_text())
    before = document.get("ca_fingerprints") or [document.get("ca_fingerprint")]
    if list(before) == fingerprints and home.agent_ca.read_bytes() == bundle_pem:
        return
    document["ca_fingerprints"] = sorted({*before, *fingerprints})
    write_atomic(home.agent_config, yaml.safe_dump(document, sort_keys=False), mode=0o600)
    write_atomic(home.agent_ca, bundle_pem, mode=0o644)
    document["ca_fingerprints"] = fingerprints
    write_atomic(home.agent_config, yaml.safe_dump(document, sort_keys=False), mode=0o600)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the renames happened
    finally:
        os.close(fd)
