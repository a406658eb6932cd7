"""API keys: generation, display prefixes, names, HMAC-with-pepper hashing.

A key's tier and role are vocabulary: :mod:`berth.vocab.roles`.

A key's secret is shown to the user once and never stored.  The store keeps
``HMAC-SHA256(pepper, secret)`` (RFC 2104 with SHA-256), where the pepper is 32 random bytes
in ``$BERTH_HOME/key_pepper`` (mode 0600): a stolen database alone cannot be used to test
guesses offline.  Secrets carry 192 bits of randomness, so a fast hash is enough; no
password-stretching is needed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path
from typing import Final

from berth.atomic import create_atomic
from berth.errors import ConfigError

#: Every secret starts with this, so leaked keys are recognisable (e.g. by secret scanners).
SECRET_PREFIX: Final = "sk-berth-"
#: Random characters after :data:`SECRET_PREFIX` (url-safe base64, 6 bits each: 192 bits).
SECRET_RANDOM_CHARS: Final = 32
#: Characters of the secret kept for display: the marker plus four random characters.
DISPLAY_PREFIX_CHARS: Final = len(SECRET_PREFIX) + 4
#: Pepper length in bytes: SHA-256's output length L, the minimum RFC 2104 section 3 advises.
PEPPER_BYTES: Final = 32
#: Longest key name, in characters.
MAX_KEY_NAME_CHARS: Final = 200


def validate_key_name(name: str) -> str:
    """Return ``name`` if it is a safe label for a key, else raise :class:`ConfigError`.

    A name is 1 to :data:`MAX_KEY_NAME_CHARS` printable characters (``str.isprintable``: no
    control characters such as newlines, tabs or escapes, no invisible format characters
    such as bidirectional overrides, no line separators; the ASCII space is allowed) and
    neither starts nor ends with a space: it shows as one row in ``berth key ls`` and one
    line in logs, and reads as what it is.  It holds no ``/``: a name is also a path segment
    of the admin API (``/admin/keys/NAME``), and servers decode ``%2F`` before routing.
    """
    if not name:
        raise ConfigError("a key name must not be empty")
    if len(name) > MAX_KEY_NAME_CHARS:
        raise ConfigError(f"a key name is at most {MAX_KEY_NAME_CHARS} characters, got {len(name)}")
    if not name.isprintable():
        bad = next(c for c in name if not c.isprintable())
        raise ConfigError(
            f"invalid key name {name!r}: it holds the unprintable character U+{ord(bad):04X}; "
            "use printable characters only (no newlines, tabs or other control characters)"
        )
    if "/" in name:
        raise ConfigError(
            f"invalid key name {name!r}: it must not contain '/' (a key is named in URLs); "
            "use '-' or '_' instead"
        )
    if name != name.strip(" "):
        raise ConfigError(f"invalid key name {name!r}: it must not start or end with a space")
    return name


def generate_secret() -> str:
    """A new secret: :data:`SECRET_PREFIX` followed by 32 url-safe random characters."""
    # token_urlsafe(24) encodes 24 random bytes as exactly 32 base64url characters.
    return SECRET_PREFIX + secrets.token_urlsafe(24)


def key_prefix(secret: str) -> str:
    """The first characters of ``secret``, safe to show in listings and logs."""
    return secret[:DISPLAY_PREFIX_CHARS]


def load_or_create_pepper(path: Path) -> bytes:
    """Return the pepper in ``path``, creating it (32 random bytes, mode 0600) if absent.

    Creation is atomic: concurrent callers all end up with the same pepper.  Raises
    :class:`ConfigError` when the file exists but does not hold exactly
    :data:`PEPPER_BYTES` bytes, or cannot be read or written.
    """
    try:
        return _read_pepper(path)
    except FileNotFoundError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Created only where none exists: a concurrent creator's pepper wins, and is read.
        create_atomic(path, secrets.token_bytes(PEPPER_BYTES), mode=0o600)
        return _read_pepper(path)
    except OSError as exc:
        raise ConfigError(f"cannot create the key pepper: {exc.strerror}", path=path) from None


def _read_pepper(path: Path) -> bytes:
    try:
        pepper = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(f"cannot read the key pepper: {exc.strerror}", path=path) from None
    if len(pepper) != PEPPER_BYTES:
        raise ConfigError(
            f"the key pepper holds {len(pepper)} bytes, expected {PEPPER_BYTES}; "
            "it was damaged (every API key must be re-issued if it is replaced)",
            path=path,
        )
    return pepper


def hash_secret(secret: str, pepper: bytes) -> str:
    """``HMAC-SHA256(pepper, secret)`` as 64 lowercase hex characters: what the store keeps."""
    return hmac.new(pepper, secret.encode("utf-8"), hashlib.sha256).hexdigest()


def verify_secret(secret: str, pepper: bytes, key_hash: str) -> bool:
    """Whether ``secret`` hashes to ``key_hash``, compared in constant time."""
    return hmac.compare_digest(hash_secret(secret, pepper), key_hash)
