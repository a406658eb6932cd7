"""What the cluster signs of a deployment, and how an agent checks it before a start.

The **spec** of a deployment is everything an agent acts on when it starts the engine: the
deployment's id, model name and path, engine, runtime and image, GPUs, context length,
extra arguments (a chat template among them), served name and the LoRA settings (slots,
rank, target modules, adapter files).  The port, log file and engine key are the agent's to
choose and are not part of it.

**Canonical form** (:func:`canonical_spec`): those fields, plus ``"format": 1``, as JSON with
the keys sorted, no whitespace (``","`` and ``":"``), ASCII only (``\\u`` escapes), UTF-8
bytes.  Sorted-key compact JSON was chosen over msgspec's field order because its bytes
depend on nothing but the values: a field added to the wire structs, or a reordering of
theirs, leaves the bytes of the fields that were signed unchanged, and any language can
rebuild them with its standard JSON encoder.  No floats are signed (every field is a
string, an integer, a list of them, or ``null``), so number formatting cannot differ.

**Signing** (:func:`sign_spec`): Ed25519 (RFC 8032) over the canonical bytes, with the
cluster's signing key (:mod:`berth.cluster.pki.signing_key`).  The leader signs once, when the
admin API or CLI accepted the deployment; restarts carry the stored signature.

**Checking** (:func:`check_signed`), on the host that runs the engine: the signature must
be by a key the host trusts (pinned at enrollment, replaced at renewal) and verify over the
signed bytes, and those bytes must equal the canonical form of what the host is asked to
start.  Anything else raises :class:`SpecRefusedError` naming the deployment and the cause
(the first field that differs, for a mismatch).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from berth.cluster.protocol.errors import SpecRefusedError
from berth.errors import ConfigError
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import parse_engine_name, parse_runtime_name
from berth.vocab.signed_spec import SignedSpec

#: The version of the canonical form, inside the signed bytes.
SPEC_FORMAT: Final = 1
_PEM_BEGIN: Final = b"-----BEGIN PUBLIC KEY-----"


def spec_fields(request: DeploymentRequest) -> dict[str, object]:
    """The signed fields of ``request`` (see the module doc), as JSON values."""
    return {
        "format": SPEC_FORMAT,
        "deployment_id": request.deployment_id,
        "model_name": request.model_name,
        "model_path": str(request.model_path),
        "engine": request.engine,
        "runtime": request.runtime,
        "image": request.image,
        "gpus": list(request.gpus),
        "ctx": request.ctx,
        "extra_args": list(request.extra_args),
        "served_model_name": request.served_model_name,
        "adapter_slots": request.adapter_slots,
        "max_lora_rank": request.max_lora_rank,
        "lora_target_modules": list(request.lora_target_modules),
        "lora_files": [str(path) for path in request.lora_files],
    }


def canonical_spec(request: DeploymentRequest) -> bytes:
    """The canonical bytes of ``request``'s spec (sorted-key compact ASCII JSON)."""
    return _canonical(spec_fields(request))


def _canonical(fields: Mapping[str, object]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def key_id(public_key: Ed25519PublicKey) -> str:
    """``ed25519:`` and the first 16 hex digits of the SHA-256 of the raw 32-byte key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


def sign_spec(private_key: Ed25519PrivateKey, request: DeploymentRequest) -> SignedSpec:
    """``request``'s spec in canonical form, signed with ``private_key``."""
    spec = canonical_spec(request)
    return SignedSpec(
        spec=spec, signature=private_key.sign(spec), key_id=key_id(private_key.public_key())
    )


def sign_again(private_key: Ed25519PrivateKey, signed: SignedSpec) -> SignedSpec:
    """The same signed bytes, signed with ``private_key`` (a key rotation carries the
    signatures the old key made over to the new one, once they verified)."""
    return SignedSpec(
        spec=signed.spec,
        signature=private_key.sign(signed.spec),
        key_id=key_id(private_key.public_key()),
    )


@dataclass(frozen=True)
class SpecKeys:
    """The public keys a host trusts for specs, current first (two during a rotation)."""

    keys: tuple[Ed25519PublicKey, ...]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(key_id(key) for key in self.keys)

    def get(self, wanted: str) -> Ed25519PublicKey | None:
        """The trusted key whose id is ``wanted``, or ``None``."""
        return next((key for key in self.keys if key_id(key) == wanted), None)

    def to_pem(self) -> bytes:
        """Every key as a SubjectPublicKeyInfo PEM block, current first."""
        return b"".join(
            key.public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            for key in self.keys
        )

    @classmethod
    def from_pem(cls, pem: bytes) -> SpecKeys:
        """The keys of a PEM bundle (:meth:`to_pem`'s form).  Raises :class:`ConfigError`
        when it holds no block, or a block that is not an Ed25519 public key."""
        blocks = [_PEM_BEGIN + part for part in pem.split(_PEM_BEGIN)[1:]]
        if not blocks:
            raise ConfigError("no spec signing key in the PEM bundle")
        keys = []
        for block in blocks:
            try:
                key = serialization.load_pem_public_key(block)
            except ValueError as exc:
                raise ConfigError(f"a spec signing key does not parse: {exc}") from None
            if not isinstance(key, Ed25519PublicKey):
                raise ConfigError("a spec signing key is not an Ed25519 public key")
            keys.append(key)
        return cls(tuple(keys))

    @classmethod
    def of(cls, keys: Iterable[Ed25519PublicKey]) -> SpecKeys:
        return cls(tuple(keys))


def check_signed(request: DeploymentRequest, trusted: SpecKeys) -> None:
    """Refuse (:class:`SpecRefusedError`) a start of ``request`` unless its signed spec is
    signed by a key of ``trusted``, verifies, and equals ``request``'s canonical spec."""
    deployment = request.deployment_id
    signed = request.signed
    if signed is None:
        raise SpecRefusedError(
            f"deployment {deployment}: the start carries no spec signed by the cluster (a "
            "deployment the admin API or CLI did not accept, e.g. a row written straight "
            "into the database); refused",
            deployment_id=deployment,
        )
    if not trusted.keys:
        raise SpecRefusedError(
            f"deployment {deployment}: this host has no spec signing key pinned (enrolled by "
            "a leader before signed specs; the next certificate renewal brings the keys, or "
            "enroll it again); refused",
            deployment_id=deployment,
        )
    key = trusted.get(signed.key_id)
    if key is None:
        known = ", ".join(trusted.ids) or "none"
        raise SpecRefusedError(
            f"deployment {deployment}: its spec is signed by {signed.key_id}, not a key this "
            f"host trusts ({known}); refused",
            deployment_id=deployment,
        )
    try:
        key.verify(signed.signature, signed.spec)
    except InvalidSignature:
        raise SpecRefusedError(
            f"deployment {deployment}: the signature of its spec does not verify under "
            f"{signed.key_id} (the spec or the signature was altered); refused",
            deployment_id=deployment,
        ) from None
    asked = spec_fields(request)
    if _canonical(asked) == signed.spec:
        return
    try:
        said = json.loads(signed.spec)
    except ValueError:
        said = {}
    if not isinstance(said, dict):
        said = {}
    differs = next((name for name in sorted(asked) if said.get(name) != asked[name]), None)
    detail = (
        f"{differs} is {asked[differs]!r} but the signed spec says {said.get(differs)!r}"
        if differs is not None
        else "the signed spec holds fields this host does not know"
    )
    raise SpecRefusedError(
        f"deployment {deployment}: the start does not match its signed spec ({detail}); refused",
        deployment_id=deployment,
    )


def request_of(signed: SignedSpec) -> DeploymentRequest:
    """The start a signed spec describes (port 0 and an empty log path, as on the wire),
    carrying ``signed``: what a restart asks for, so a restart runs what was signed and
    nothing a later write to the store says.  Raises :class:`SpecRefusedError` when the
    bytes are not a spec of :data:`SPEC_FORMAT` (checked before by :func:`check_signed`'s
    signature, so only a leader bug or a damaged row gets here)."""
    try:
        fields = json.loads(signed.spec)
        if fields["format"] != SPEC_FORMAT:
            raise ValueError(f"format {fields['format']!r}")
        return DeploymentRequest(
            deployment_id=str(fields["deployment_id"]),
            model_name=str(fields["model_name"]),
            model_path=Path(fields["model_path"]),
            engine=parse_engine_name(str(fields["engine"])),
            port=0,
            log_path=Path(),
            gpus=tuple(int(gpu) for gpu in fields["gpus"]),
            ctx=fields["ctx"],
            extra_args=tuple(str(arg) for arg in fields["extra_args"]),
            served_model_name=fields["served_model_name"],
            runtime=parse_runtime_name(str(fields["runtime"])),
            image=fields["image"],
            adapter_slots=fields["adapter_slots"],
            max_lora_rank=fields["max_lora_rank"],
            lora_target_modules=tuple(str(m) for m in fields["lora_target_modules"]),
            lora_files=tuple(Path(p) for p in fields["lora_files"]),
            signed=signed,
        )
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        raise SpecRefusedError(
            f"a signed spec does not decode ({exc}); refused", deployment_id="?"
        ) from None
