"""The host key pair and the opening of sealed prompts (the protocol's "Sealed prompts").

A sealed job's prompt is encrypted for this host only. Opening it takes four steps, each
with the ``cryptography`` package:

1. ``shared = X25519(host private key, envelope.epk)``;
2. ``wrap_key = HKDF-SHA256(shared, salt = epk || host public key (raw bytes),
   info = "owt-sealed-prompt-wrap-v1", 32 bytes)``;
3. ``content_key = AES-256-GCM open(wrap_key, nonce = wrapNonce,
   aad = "<job id>:<node id>", wrappedKey, wrapTag)``;
4. ``prompt = AES-256-GCM open(content_key, nonce = envelope.nonce, aad = "<job id>",
   envelope.ct, envelope.tag)``, read as UTF-8.

The node id is ``node_`` and the first 8 hex digits of SHA-256 of the node secret. Every
field is base64url (padding optional). Any failure raises
:class:`~berth.desk.errors.SealedPromptError` naming the step, never the content: the
worker reports the job failed and never retries it with other inputs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from berth.desk.errors import SealedPromptError
from berth.desk.wire import SealedPrompt

#: HKDF ``info`` of the key-wrapping key (the protocol's step 2).
WRAP_INFO: Final = b"owt-sealed-prompt-wrap-v1"
#: X25519 keys and AES-256 keys are 32 bytes; a GCM tag is 16.
KEY_BYTES: Final = 32
TAG_BYTES: Final = 16


def b64url_encode(data: bytes) -> str:
    """``data`` as unpadded base64url (RFC 4648 section 5), as the desk writes it."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Decode base64url with or without padding; ``ValueError`` for anything else."""
    if not isinstance(text, str) or not text.isascii():
        raise ValueError("not base64url")
    stripped = text.rstrip("=")
    if any(ch in stripped for ch in "+/=\n\r "):
        raise ValueError("not base64url")
    try:
        return base64.urlsafe_b64decode(stripped + "=" * (-len(stripped) % 4))
    except binascii.Error:
        raise ValueError("not base64url") from None


def node_id_for(secret: str) -> str:
    """``node_`` + the first 8 hex digits of SHA-256 of the node secret (UTF-8)."""
    return "node_" + hashlib.sha256(secret.encode("utf-8")).hexdigest()[:8]


@dataclass(frozen=True)
class HostKeyPair:
    """This host's X25519 key pair, as raw 32-byte keys."""

    private_raw: bytes
    public_raw: bytes

    @classmethod
    def generate(cls) -> HostKeyPair:
        """A fresh key pair from the operating system's randomness."""
        return cls.from_private(X25519PrivateKey.generate().private_bytes_raw())

    @classmethod
    def from_private(cls, private_raw: bytes) -> HostKeyPair:
        """The pair of the raw private key ``private_raw``; ``ValueError`` unless 32 bytes."""
        private = X25519PrivateKey.from_private_bytes(private_raw)
        public_raw = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return cls(private_raw=bytes(private_raw), public_raw=public_raw)

    @property
    def public_b64(self) -> str:
        """The public key as the desk takes it (``enc_pubkey``): unpadded base64url."""
        return b64url_encode(self.public_raw)


def _field(job_id: str, name: str, text: str, size: int | None = None) -> bytes:
    try:
        raw = b64url_decode(text)
    except ValueError:
        raise SealedPromptError(job_id, f"{name} is not base64url") from None
    if size is not None and len(raw) != size:
        raise SealedPromptError(job_id, f"{name} is {len(raw)} bytes, not {size}")
    return raw


def _aes_gcm_open(
    job_id: str, step: str, key: bytes, nonce: bytes, ciphertext: bytes, tag: bytes, aad: bytes
) -> bytes:
    try:
        return AESGCM(key).decrypt(nonce, ciphertext + tag, aad)
    except InvalidTag:
        raise SealedPromptError(job_id, f"{step}: authentication failed") from None
    except ValueError as exc:  # a nonce length AES-GCM does not take
        raise SealedPromptError(job_id, f"{step}: {exc}") from None


def open_sealed_prompt(
    sealed: SealedPrompt, *, job_id: str, node_secret: str, keys: HostKeyPair
) -> str:
    """The prompt of the sealed job ``job_id``, claimed with ``node_secret``.

    Follows the four steps of the module docstring. Raises :class:`SealedPromptError` when a
    field is not base64url or has the wrong size (32-byte ``epk``, 16-byte tags), the
    ephemeral key is a low-order point, either AES-GCM open fails (wrong key, AAD, nonce or
    tag: a tampered envelope, or one sealed for another node), the content key is not 32
    bytes, or the prompt is not UTF-8.
    """
    envelope = sealed.envelope
    epk = _field(job_id, "epk", envelope.epk, KEY_BYTES)
    try:
        shared = X25519PrivateKey.from_private_bytes(keys.private_raw).exchange(
            X25519PublicKey.from_public_bytes(epk)
        )
    except ValueError:
        raise SealedPromptError(job_id, "X25519 exchange with epk failed") from None
    wrap_key = HKDF(
        algorithm=hashes.SHA256(), length=KEY_BYTES, salt=epk + keys.public_raw, info=WRAP_INFO
    ).derive(shared)
    wrap_aad = f"{job_id}:{node_id_for(node_secret)}".encode()
    content_key = _aes_gcm_open(
        job_id,
        "content key",
        wrap_key,
        _field(job_id, "wrapNonce", sealed.wrap_nonce),
        _field(job_id, "wrappedKey", sealed.wrapped_key),
        _field(job_id, "wrapTag", sealed.wrap_tag, TAG_BYTES),
        wrap_aad,
    )
    if len(content_key) != KEY_BYTES:
        raise SealedPromptError(job_id, f"content key is {len(content_key)} bytes, not 32")
    prompt = _aes_gcm_open(
        job_id,
        "prompt",
        content_key,
        _field(job_id, "nonce", envelope.nonce),
        _field(job_id, "ct", envelope.ct),
        _field(job_id, "tag", envelope.tag, TAG_BYTES),
        job_id.encode(),
    )
    try:
        return prompt.decode("utf-8")
    except UnicodeDecodeError:
        raise SealedPromptError(job_id, "prompt is not UTF-8") from None
