"""The spec signing keys an agent trusts: pinned at enrollment, replaced at renewal.

The leader hands its public spec signing keys (:mod:`berth.cluster.pki.signing_key`; current
first, two during a rotation) to an agent in the registration answer and in every renewal
answer (``spec_keys_pem``), both over TLS verified against the pinned CA.  The agent keeps
them in ``spec-keys.pem`` beside its certificate (mode 0644, written atomically) and reads
them at each start (:class:`~berth.agent.core.AgentCore`'s ``spec_keys``): a start whose
spec none of them signed is refused.

A home without the file (enrolled by a leader before signed specs) trusts no key: every
start is refused, naming the cause, until the next certificate renewal brings the keys
(or the node is enrolled again).  A leader that sends no keys (an older one) leaves the file
as it is.
"""

from __future__ import annotations

import logging

from berth.atomic import write_atomic
from berth.cluster.protocol.spec_signing import SpecKeys
from berth.errors import ConfigError
from berth.paths import BerthHome

log = logging.getLogger(__name__)


def save_spec_keys(home: BerthHome, pem: str) -> SpecKeys | None:
    """Pin the keys of ``pem`` (a registration's or renewal's ``spec_keys_pem``) in
    ``home``.  An empty ``pem`` (an older leader) changes nothing and returns ``None``.
    Raises :class:`ConfigError` when ``pem`` holds something other than Ed25519 public keys
    (nothing is written then), :class:`OSError` when the file cannot be written."""
    if not pem.strip():
        return None
    keys = SpecKeys.from_pem(pem.encode("ascii"))
    path = home.agent_spec_keys
    if path.exists() and path.read_bytes() == keys.to_pem():
        return keys
    write_atomic(path, keys.to_pem(), mode=0o644)
    log.info("spec signing keys pinned: %s", ", ".join(keys.ids))
    return keys


def pinned_spec_keys(home: BerthHome) -> SpecKeys:
    """The keys pinned in ``home``; none when the file is absent.  Raises
    :class:`ConfigError` naming the file when it is unreadable or damaged."""
    path = home.agent_spec_keys
    try:
        pem = path.read_bytes()
    except FileNotFoundError:
        return SpecKeys(())
    except OSError as exc:
        raise ConfigError(f"cannot read the pinned spec keys: {exc.strerror}", path=path) from None
    try:
        return SpecKeys.from_pem(pem)
    except ConfigError as exc:
        raise ConfigError(str(exc), path=path) from None
