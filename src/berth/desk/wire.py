"""The desk's messages, typed, and the one decoder that validates them.

Every shape here is the ow desk worker protocol's (``shared/specs/ow-desk-protocol.md``,
"Desk"): the field names on the wire are the desk's own (``machineSecret``, ``wrappedKey``,
``expiresAt``), the Python names are snake case. Fields the desk sends beyond these are
ignored. :func:`decode` raises :class:`~berth.desk.errors.DeskProtocolError`, never a bare
``ValueError``.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal, TypeVar

import msgspec

from berth.desk.errors import DeskProtocolError

#: Model ids a desk accepts (the protocol's "Local model server" table).
MODEL_ID_PATTERN: Final = re.compile(r"[a-zA-Z0-9._:/-]{1,80}")
#: A node secret, the bearer token of every call but registration (the protocol's "Desk").
NODE_SECRET_PATTERN: Final = re.compile(r"sk-node-[A-Za-z0-9_-]{32}")
#: Job ids of the desk's own pool tests start with this; callers' jobs with ``job_``.
POOL_TEST_PREFIX: Final = "check_"
#: Prices are whole cents per million tokens, in this range (both ends allowed).
PRICE_MIN_CENTS: Final = 1
PRICE_MAX_CENTS: Final = 5000

PromptMode = Literal["plain", "sealed"]


def is_model_id(name: str) -> bool:
    """Whether ``name`` may be offered to a desk (:data:`MODEL_ID_PATTERN`, whole string)."""
    return MODEL_ID_PATTERN.fullmatch(name) is not None


def is_node_secret(text: str) -> bool:
    """Whether ``text`` has the shape of a node secret (:data:`NODE_SECRET_PATTERN`)."""
    return NODE_SECRET_PATTERN.fullmatch(text) is not None


class RegisterRequest(msgspec.Struct, omit_defaults=True):
    """``POST /api/v1/node`` (no auth): one model offered by this machine.

    ``price`` (cents per million tokens) is left out when unset, and the desk suggests one;
    ``machine_secret`` is the secret of a model already registered here, left out for the
    first, so the desk groups the models as one machine.
    """

    model: str
    enc_pubkey: str
    price: int | None = None
    machine_secret: str | None = msgspec.field(default=None, name="machineSecret")


class RegisterAnswer(msgspec.Struct):
    """The desk's answer to a registration: the node secret and public code, the price and
    who set it (``price_basis`` is ``"host"`` when the host did)."""

    secret: str
    code: str
    price: int | None = None
    price_basis: str | None = None


class Pulse(msgspec.Struct):
    """``POST /api/v1/pulse``: one node's heartbeat.

    ``chip`` and the memory fields (GB) are ``None`` where no GPU serves the model;
    ``tok_per_s`` is ``None`` until the speed test has measured it.
    """

    chip: str | None
    vram_gb: float | None
    vram_used_gb: float | None
    tok_per_s: float | None
    busy: bool
    slots: int
    models: list[str]
    enc_pubkey: str


class SealedEnvelope(msgspec.Struct):
    """The prompt's envelope; every field base64url: the ephemeral X25519 public key, the
    AES-GCM nonce, ciphertext and tag."""

    epk: str
    nonce: str
    ct: str
    tag: str


class SealedPrompt(msgspec.Struct):
    """A sealed job's ``enc``: the envelope and the content key wrapped for this host."""

    envelope: SealedEnvelope
    wrapped_key: str = msgspec.field(name="wrappedKey")
    wrap_nonce: str = msgspec.field(name="wrapNonce")
    wrap_tag: str = msgspec.field(name="wrapTag")


class ClaimedJob(msgspec.Struct):
    """A job as ``POST /api/v1/jobs/claim`` hands it out, before its prompt is read.

    ``enc`` stays raw so that a job whose envelope is malformed still has an id to ``fail``.
    """

    id: str
    model: str
    prompt: str = ""
    prompt_mode: str | None = None
    enc: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # empty: no ``enc``

    @property
    def is_pool_test(self) -> bool:
        """Whether the desk's own pool test sent this job (its id starts ``check_``)."""
        return self.id.startswith(POOL_TEST_PREFIX)

    def mode(self) -> PromptMode:
        """``"sealed"`` or ``"plain"``; raises :class:`DeskProtocolError` for another mode."""
        if self.prompt_mode == "sealed":
            return "sealed"
        if self.prompt_mode in (None, "", "plain"):
            return "plain"
        raise DeskProtocolError("jobs/claim", f"job {self.id}: unknown prompt_mode")

    def sealed_prompt(self) -> SealedPrompt:
        """The decoded ``enc``; :class:`DeskProtocolError` when absent or malformed."""
        if not self.enc:
            raise DeskProtocolError("jobs/claim", f"job {self.id}: sealed without enc")
        return decode(bytes(self.enc), SealedPrompt, call="jobs/claim")


class Finish(msgspec.Struct):
    """``POST /api/v1/jobs/finish``: the answer and the engine's token counts (0 if none)."""

    id: str
    output: str
    prompt_tokens: int
    completion_tokens: int


class Fail(msgspec.Struct):
    """``POST /api/v1/jobs/fail``."""

    id: str


class NodeStatus(msgspec.Struct):
    """``GET /api/v1/node/status``: the node's ``state`` (``READY``, ``CHECKING``...), its
    pool test and when the desk last heard from it, the last two as the desk gives them."""

    state: str
    check: Any = None
    last_seen: Any = msgspec.field(default=None, name="lastSeen")


class LinkCode(msgspec.Struct):
    """``POST /api/v1/node/link``: a one-time code (entered at ``/account/machines``)."""

    code: str
    expires_at: Any = msgspec.field(default=None, name="expiresAt")


class ErrorAnswer(msgspec.Struct):
    """An error body; ``error`` is a message, or an object with one."""

    error: Any = None

    def message(self) -> str:
        if isinstance(self.error, str):
            return self.error
        if isinstance(self.error, dict) and isinstance(self.error.get("message"), str):
            return str(self.error["message"])
        return ""


T = TypeVar("T")

_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decode(data: bytes, kind: type[T], *, call: str) -> T:
    """Decode the JSON ``data`` as ``kind``; :class:`DeskProtocolError` naming ``call`` when
    it is not JSON or lacks a field (the message names the field, never the content)."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(data)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise DeskProtocolError(call, str(exc)) from None
    except msgspec.DecodeError:
        raise DeskProtocolError(call, "not JSON") from None


def encode(message: msgspec.Struct) -> bytes:
    """The JSON body of ``message``, with the desk's field names."""
    return msgspec.json.encode(message)
