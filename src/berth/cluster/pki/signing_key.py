"""The cluster's spec signing key: Ed25519, kept beside the CA, shared sealed like it.

Files, in the CA folder (``$BERTH_HOME/ca``, mode 0700):

- ``spec-signing.key``: the private key (PKCS#8 PEM, mode 0600), made with the CA; a home
  whose CA predates signed specs gets one the first time the leader loads it (an upgrade);
- ``spec-signing-previous.key``: the key before the last ``berth ca rotate``, kept until
  ``berth ca retire`` so that agents which have not renewed yet (and trust only it) still
  verify what the leader sends.

The leader signs with the current key only (:meth:`SpecSigner.sign`); hosts trust the public
keys of both (:attr:`SpecSigner.trusted`), which enrollment and every renewal hand to agents
(``spec_keys_pem``).  A rotation signs every stored spec again with the new key once the old
signature verified (:func:`carry_over`), so a
deployment keeps starting after the old key is retired.

With ``leader_ha`` and a ``cluster_secret`` the key is shared through the store like the CA
(:func:`share_through_store`): sealed under the secret (the same scrypt and AES-256-GCM as
:mod:`berth.cluster.pki.bootstrap`, its own associated data) in the ``cluster_bootstrap`` row
``spec-signing``, never in the clear.  The first leader to publish wins; the others install
it.  A cluster upgraded with its CA already published gains the row from its first upgraded
leader.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from berth.atomic import create_atomic, write_atomic
from berth.cluster.pki import bootstrap
from berth.cluster.protocol.errors import SpecRefusedError
from berth.cluster.protocol.spec_signing import (
    SpecKeys,
    check_signed,
    key_id,
    request_of,
    sign_again,
    sign_spec,
)
from berth.errors import ConfigError
from berth.paths import BerthHome
from berth.store import Store
from berth.store.bootstrap import SealedBootstrap
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.signed_spec import SignedSpec

log = logging.getLogger(__name__)

SIGNING_KEY_FILE: Final = "spec-signing.key"
PREVIOUS_SIGNING_KEY_FILE: Final = "spec-signing-previous.key"
#: The ``cluster_bootstrap`` row holding the sealed key.
SEALED_ROW: Final = "spec-signing"
#: Bound into the GCM tag: the blob is berth's spec signing key, format 1.
ASSOCIATED_DATA: Final = b"berth cluster spec signing key v1: ed25519 pkcs8 pem"


class SpecSigner:
    """The cluster's signing key; build it with :meth:`load_or_create` (or
    :meth:`in_memory`).  One kept in a CA folder is read from its files at each use, so a
    rotation or a retirement (which replace them) applies at once, in every holder."""

    def __init__(
        self,
        ca_dir: Path | None,
        current: Ed25519PrivateKey,
        previous: Ed25519PrivateKey | None = None,
    ) -> None:
        self._ca_dir = ca_dir
        self._current = current
        self._previous = previous

    @classmethod
    def load_or_create(cls, ca_dir: Path) -> SpecSigner:
        """Load the key from ``ca_dir``, making it first when absent (atomic: concurrent
        callers end with one key).  Raises :class:`ConfigError` naming the file when a key
        is unreadable or not Ed25519, and naming ``ca_dir`` when it cannot be written."""
        path = ca_dir / SIGNING_KEY_FILE
        try:
            ca_dir.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                create_atomic(path, private_pem(Ed25519PrivateKey.generate()), mode=0o600)
        except OSError as exc:
            raise ConfigError(
                f"cannot write the spec signing key: {exc.strerror}", path=ca_dir
            ) from None
        previous_path = ca_dir / PREVIOUS_SIGNING_KEY_FILE
        previous = load_private(previous_path) if previous_path.exists() else None
        return cls(ca_dir, load_private(path), previous)

    @classmethod
    def in_memory(cls) -> SpecSigner:
        """A fresh key held in memory only (a leader built without a home: tests)."""
        return cls(None, Ed25519PrivateKey.generate())

    def _keys(self) -> tuple[Ed25519PrivateKey, Ed25519PrivateKey | None]:
        if self._ca_dir is None:
            return self._current, self._previous
        fresh = SpecSigner.load_or_create(self._ca_dir)
        return fresh._current, fresh._previous

    @property
    def current(self) -> Ed25519PrivateKey:
        """The key that signs."""
        return self._keys()[0]

    @property
    def key_id(self) -> str:
        return key_id(self.current.public_key())

    @property
    def trusted(self) -> SpecKeys:
        """The public keys hosts trust: the current one, then the previous during a rotation."""
        current, previous = self._keys()
        keys = [current.public_key()]
        if previous is not None:
            keys.append(previous.public_key())
        return SpecKeys.of(keys)

    def sign(self, request: DeploymentRequest) -> SignedSpec:
        """``request``'s spec signed with the current key.  Only the admin API's and CLI's
        deploy path calls this (:mod:`berth.deployments.signing`)."""
        return sign_spec(self.current, request)


def trusted_in(ca_dir: Path) -> SpecKeys:
    """The public keys of the signing key files in ``ca_dir`` (node ``local``'s trust,
    read at each start so a rotation applies at once)."""
    return SpecSigner.load_or_create(ca_dir).trusted


def rotate(ca_dir: Path) -> None:
    """Keep the current key as the previous one and make a new current key (``berth ca
    rotate``, :func:`berth.cluster.pki.ca_rotation.rotate`); :func:`carry_over` then signs the
    stored specs again."""
    SpecSigner.load_or_create(ca_dir)  # a CA made before signed specs has none yet
    current = (ca_dir / SIGNING_KEY_FILE).read_bytes()
    write_atomic(ca_dir / PREVIOUS_SIGNING_KEY_FILE, current, mode=0o600)
    write_atomic(ca_dir / SIGNING_KEY_FILE, private_pem(Ed25519PrivateKey.generate()), mode=0o600)


def retire(ca_dir: Path) -> None:
    """Forget the previous key (``berth ca retire``): hosts stop trusting it at renewal."""
    (ca_dir / PREVIOUS_SIGNING_KEY_FILE).unlink(missing_ok=True)


def private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_private(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 key in ``path``; :class:`ConfigError` naming it otherwise."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise ConfigError(f"cannot read the spec signing key: {exc.strerror}", path=path) from None
    except ValueError as exc:
        raise ConfigError(f"the spec signing key does not parse: {exc}", path=path) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError("the spec signing key is not an Ed25519 key", path=path)
    return key


# -- sharing through the store (leader_ha with a cluster_secret) -----------------------------


def seal(key_pem: bytes, secret: str, *, now_s: float) -> SealedBootstrap:
    """``key_pem`` encrypted under ``secret`` (fresh salt and nonce), stamped ``now_s``."""
    salt, nonce = os.urandom(bootstrap.SALT_BYTES), os.urandom(bootstrap.NONCE_BYTES)
    aead = AESGCM(bootstrap._key(secret, salt))
    ciphertext = aead.encrypt(nonce, key_pem, ASSOCIATED_DATA)
    return SealedBootstrap(salt=salt, nonce=nonce, ciphertext=ciphertext, created_at=now_s)


def unseal(sealed: SealedBootstrap, secret: str) -> bytes:
    """The key PEM in ``sealed``; :class:`ConfigError` (:data:`bootstrap.WRONG_SECRET`) when
    ``secret`` does not open it."""
    try:
        return AESGCM(bootstrap._key(secret, sealed.salt)).decrypt(
            sealed.nonce, sealed.ciphertext, ASSOCIATED_DATA
        )
    except (InvalidTag, ValueError):
        raise ConfigError(bootstrap.WRONG_SECRET) from None


def share_through_store(home: BerthHome, store: Store, secret: str) -> None:
    """Make ``home``'s signing key the one sealed in ``store``, publishing this home's (made
    first where absent) when the store has none.  A home holding another key is refused
    (:class:`ConfigError`): specs signed by one leader must verify on every agent."""
    path = home.ca_dir / SIGNING_KEY_FILE
    sealed = store.cluster_bootstrap(SEALED_ROW)
    if sealed is None:
        made_here = not path.exists()
        SpecSigner.load_or_create(home.ca_dir)
        mine = path.read_bytes()
        offered = seal(mine, secret, now_s=time.time())
        sealed = store.publish_cluster_bootstrap(offered, name=SEALED_ROW)
        if sealed == offered:
            log.info("published this home's spec signing key for the other leaders")
            return
        if made_here:
            path.unlink()  # lost a race of first starts: nobody signed with it yet
    shared = unseal(sealed, secret)
    if not path.exists():
        try:
            home.ca_dir.mkdir(parents=True, exist_ok=True)
            create_atomic(path, shared, mode=0o600)
        except OSError as exc:
            raise ConfigError(
                f"cannot write the spec signing key: {exc.strerror}", path=path
            ) from None
    theirs = serialization.load_pem_private_key(shared, password=None)
    if not isinstance(theirs, Ed25519PrivateKey):
        raise ConfigError("the database's spec signing key is not an Ed25519 key")
    if key_id(load_private(path).public_key()) != key_id(theirs.public_key()):
        raise ConfigError(
            f"this home's spec signing key is not the cluster's in the database: move {path} "
            "aside (the database's is then used)",
            path=path,
        )


def carry_over(store: Store, signer: SpecSigner) -> int:
    """Sign every stored spec again with ``signer``'s current key where it verifies under a
    key still trusted (after a rotation), so deployments keep starting once the old key is
    retired.  Blocking.  Returns how many were signed again."""
    current, trusted = signer.current, signer.trusted
    moved = 0
    for record in store.list_deployments():
        signed = record.signed_spec
        if signed is None or signed.key_id == key_id(current.public_key()):
            continue
        try:
            check_signed(request_of(signed), trusted)
        except SpecRefusedError as exc:
            log.warning("deployment %s keeps its old signature: %s", record.id, exc)
            continue
        store.set_deployment_signature(record.id, sign_again(current, signed))
        moved += 1
    return moved
