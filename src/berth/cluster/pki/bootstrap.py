"""The cluster's CA and key pepper shared by leaders through the store, sealed.

With ``leader_ha`` every leader needs the same CA (agents pin it, clients trust it) and the
same key pepper (API keys are HMACs under it).  Given a ``cluster_secret``,
:func:`share_through_store` runs at a leader's start, before the CA and the pepper load:

- the store holds no sealed bootstrap yet: this home's CA and pepper (made first if
  absent, as a lone leader would) are sealed and published, insert-if-absent; when another
  leader published first, its data is used as below;
- the store holds one: it is opened, and the CA key, the CA certificate and the pepper are
  written into the home where it has none (atomically; 0600 for the key and the pepper,
  0644 for the certificate, as :mod:`berth.cluster.pki.ca` and :mod:`berth.keys` make them);
  a home that already holds a different CA or pepper is refused (:class:`ConfigError`
  naming both CA fingerprints), since agents pinned to one would not trust the other.

Each leader still issues its own listener certificates (``public.pem``, ``cluster.pem``)
from the shared CA, so an agent's pinned CA holds whichever leader it reaches.

Sealing (:func:`seal`, :func:`unseal`): a 256-bit key is derived from the secret with
scrypt (RFC 7914; ``n`` 2**15, ``r`` 8, ``p`` 1) over a random 16-byte salt stored with the
blob, and the JSON payload is encrypted with AES-256-GCM under a random 96-bit nonce, with
:data:`ASSOCIATED_DATA` naming what the blob is.  A copy of the database alone opens
nothing; a wrong secret fails the GCM tag, reported as :data:`WRONG_SECRET`.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from berth.atomic import create_atomic, write_atomic
from berth.cluster.pki.ca import CA_CERT_FILE, CA_KEY_FILE, CertificateAuthority, fingerprint_of_pem
from berth.errors import ConfigError
from berth.keys import PEPPER_BYTES, load_or_create_pepper
from berth.paths import BerthHome
from berth.store import Store
from berth.store.bootstrap import SealedBootstrap

log = logging.getLogger(__name__)

#: Bound into the GCM tag: the blob is berth's cluster bootstrap data, format 1.
ASSOCIATED_DATA: Final = b"berth cluster bootstrap v1: ca key, ca certificate, key pepper"
SALT_BYTES: Final = 16
NONCE_BYTES: Final = 12
KEY_BYTES: Final = 32
SCRYPT_N: Final = 2**15
SCRYPT_R: Final = 8
SCRYPT_P: Final = 1
#: The one-line refusal when the secret does not open the stored blob.
WRONG_SECRET: Final = (
    "cluster_secret does not open the database's cluster secrets: set the cluster_secret "
    "the first leader on this database was started with"
)


@dataclass(frozen=True)
class BootstrapData:
    """What leaders share: the CA key and certificate (PEM bytes) and the key pepper."""

    ca_key_pem: bytes
    ca_cert_pem: bytes
    pepper: bytes

    @property
    def ca_fingerprint(self) -> str:
        """``sha256:<hex>`` of the CA certificate."""
        return fingerprint_of_pem(self.ca_cert_pem)


def _key(secret: str, salt: bytes) -> bytes:
    kdf = Scrypt(salt=salt, length=KEY_BYTES, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P)
    return kdf.derive(secret.encode())


def seal(data: BootstrapData, secret: str, *, now_s: float) -> SealedBootstrap:
    """``data`` encrypted under ``secret`` (a fresh salt and nonce), stamped ``now_s``."""
    payload = json.dumps(
        {
            "ca_key": data.ca_key_pem.decode("ascii"),
            "ca_cert": data.ca_cert_pem.decode("ascii"),
            "pepper": base64.b64encode(data.pepper).decode("ascii"),
        }
    ).encode()
    salt, nonce = os.urandom(SALT_BYTES), os.urandom(NONCE_BYTES)
    ciphertext = AESGCM(_key(secret, salt)).encrypt(nonce, payload, ASSOCIATED_DATA)
    return SealedBootstrap(salt=salt, nonce=nonce, ciphertext=ciphertext, created_at=now_s)


def unseal(sealed: SealedBootstrap, secret: str) -> BootstrapData:
    """The data in ``sealed``; :class:`ConfigError` (:data:`WRONG_SECRET`) when ``secret``
    does not open it, or when what it opens is not berth's bootstrap data."""
    try:
        payload = AESGCM(_key(secret, sealed.salt)).decrypt(
            sealed.nonce, sealed.ciphertext, ASSOCIATED_DATA
        )
    except (InvalidTag, ValueError):
        raise ConfigError(WRONG_SECRET) from None
    try:
        fields = json.loads(payload)
        data = BootstrapData(
            ca_key_pem=fields["ca_key"].encode("ascii"),
            ca_cert_pem=fields["ca_cert"].encode("ascii"),
            pepper=base64.b64decode(fields["pepper"], validate=True),
        )
        fingerprint = data.ca_fingerprint
    except (ValueError, KeyError, TypeError, AttributeError, ConfigError):
        raise ConfigError("the database's cluster secrets are damaged (unreadable)") from None
    if len(data.pepper) != PEPPER_BYTES:
        raise ConfigError(f"the database's cluster secrets hold a bad pepper (CA {fingerprint})")
    return data


def home_data(home: BerthHome) -> BootstrapData:
    """This home's CA and pepper, each made first where absent (as a lone leader's start
    does).  :class:`ConfigError` as :meth:`CertificateAuthority.load_or_create`."""
    CertificateAuthority.load_or_create(home.ca_dir)
    pepper = load_or_create_pepper(home.pepper_file)
    return BootstrapData(
        ca_key_pem=_read(home.ca_dir / CA_KEY_FILE),
        ca_cert_pem=_read(home.ca_dir / CA_CERT_FILE),
        pepper=pepper,
    )


def share_through_store(
    home: BerthHome, store: Store, secret: str, *, now_s: float | None = None
) -> BootstrapData:
    """Make ``home`` hold the cluster's CA and pepper as the store has them sealed under
    ``secret``, publishing this home's when the store has none (see the module doc).
    Returns the shared data.  Raises :class:`ConfigError`: a wrong secret
    (:data:`WRONG_SECRET`), a home holding another CA or pepper, a file that cannot be
    written; :class:`~berth.errors.StoreError` when the store cannot be reached."""
    sealed = store.cluster_bootstrap()
    made_here = False
    if sealed is None:
        made_here = not (home.ca_dir / CA_KEY_FILE).exists() and not home.pepper_file.exists()
        mine = home_data(home)
        offered = seal(mine, secret, now_s=time.time() if now_s is None else now_s)
        sealed = store.publish_cluster_bootstrap(offered)
        if sealed == offered:
            log.info("published this home's CA %s for the other leaders", mine.ca_fingerprint)
            return mine
    shared = unseal(sealed, secret)
    if made_here:  # lost a race of first starts: the CA and pepper just made give way
        _replace(home, shared)
    _install(home, shared)
    log.info("the cluster CA %s and key pepper come from the database", shared.ca_fingerprint)
    return shared


def _install(home: BerthHome, shared: BootstrapData) -> None:
    """Write ``shared`` into ``home`` where it has none; refuse a different CA or pepper."""
    key_path, cert_path = home.ca_dir / CA_KEY_FILE, home.ca_dir / CA_CERT_FILE
    try:
        home.ca_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(home.ca_dir, 0o700)
        if not cert_path.exists() and not key_path.exists():
            create_atomic(key_path, shared.ca_key_pem, mode=0o600)
            create_atomic(cert_path, shared.ca_cert_pem, mode=0o644)
        if not home.pepper_file.exists():
            create_atomic(home.pepper_file, shared.pepper, mode=0o600)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the shared CA or pepper: {exc.strerror}", path=home.root
        ) from None
    here = CertificateAuthority.load_or_create(home.ca_dir)  # a lone key gets its cert made
    if here.fingerprint_sha256 != shared.ca_fingerprint or _read(key_path) != shared.ca_key_pem:
        raise ConfigError(
            f"this home's CA {here.fingerprint_sha256} is not the cluster's CA "
            f"{shared.ca_fingerprint} in the database: move {home.ca_dir} aside (its CA is then "
            "taken from the database) or start with the cluster_secret of its own cluster"
        )
    if load_or_create_pepper(home.pepper_file) != shared.pepper:
        raise ConfigError(
            f"this home's key_pepper is not the one in the database (cluster CA "
            f"{shared.ca_fingerprint}): move {home.pepper_file} aside (API keys hashed under "
            "it stop working) so the database's is used"
        )


def _replace(home: BerthHome, shared: BootstrapData) -> None:
    """Overwrite the CA and pepper this start made with ``shared`` (nobody used them yet)."""
    try:
        write_atomic(home.ca_dir / CA_KEY_FILE, shared.ca_key_pem, mode=0o600)
        write_atomic(home.ca_dir / CA_CERT_FILE, shared.ca_cert_pem, mode=0o644)
        write_atomic(home.pepper_file, shared.pepper, mode=0o600)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the shared CA or pepper: {exc.strerror}", path=home.root
        ) from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path.name}: {exc.strerror}", path=path) from None
