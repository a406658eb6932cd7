"""Sealed prompts: known answers, and every tampering ends in an error (a ``fail``).

The vectors below were built with the stand-in desk's sealing side
(``tests/support/desk_standin.py``, written from the protocol's four steps) from fixed keys and
nonces, and are hard-coded, so
either side drifting from them fails here. Steps 1 and 2 of the first vector were also
checked with the OpenSSL command line, independently of Python:

    openssl pkeyutl -derive -inkey host.pem -peerkey epk.pem       # shared secret
    openssl kdf -keylen 32 -kdfopt digest:SHA256 -kdfopt hexkey:SHARED \\
        -kdfopt hexsalt:EPK_HOSTPUB -kdfopt info:owt-sealed-prompt-wrap-v1 HKDF

giving :data:`SHARED_HEX` and :data:`WRAP_KEY_HEX`.
"""

from __future__ import annotations

import base64
import hashlib

import msgspec
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from berth.desk.errors import SealedPromptError
from berth.desk.sealing import (
    HostKeyPair,
    b64url_decode,
    b64url_encode,
    node_id_for,
    open_sealed_prompt,
)
from berth.desk.wire import SealedPrompt, decode
from support.desk_standin import SealInputs, seal_prompt

HOST_PRIVATE = bytes(range(1, 33))
HOST_PUBLIC_HEX = "07a37cbc142093c8b755dc1b10e86cb426374ad16aa853ed0bdfc0b2b86d1c7c"
NODE_SECRET = "sk-node-0123456789abcdefABCDEF_-ghijklmn"
NODE_ID = "node_0bfea464"
INPUTS = SealInputs(
    ephemeral_private=bytes(range(101, 133)),
    content_key=bytes(range(201, 233)),
    nonce=bytes(range(12)),
    wrap_nonce=bytes(range(50, 62)),
)
SHARED_HEX = "c9ea6a3f79a000b60b076d4afc990b272f3f0b5aaa3f0b8713c209273e363863"
WRAP_KEY_HEX = "9c1a553252692ea5b6cfdb722097cc3800f7098518e13b2b2267bcf23e87b987"

VECTORS = [
    (
        "job_kat_0001",
        "Name the capital of France.",
        {
            "envelope": {
                "epk": "VxR2nRFr92Q2rnS8eT0sMK0ZA8WaxSc4BcfiaYtBDDY",
                "nonce": "AAECAwQFBgcICQoL",
                "ct": "qHfH2UV31GB-nuo0VzrgmzObJRKZ8Cd24QUK",
                "tag": "8t6MX4WP5_cNzH3ZkSWJ0A",
            },
            "wrappedKey": "DZNt-W4k41pcIVsHZyZ5JsfMJAPjeiTcAlUPsfGwaPg",
            "wrapNonce": "MjM0NTY3ODk6Ozw9",
            "wrapTag": "gsBrJhq1jPVpd1ArgyLlSA",
        },
    ),
    (
        "check_kat_0002",
        "Grüße, 世界: ok",
        {
            "envelope": {
                "epk": "VxR2nRFr92Q2rnS8eT0sMK0ZA8WaxSc4BcfiaYtBDDY",
                "nonce": "AAECAwQFBgcICQoL",
                "ct": "oWRpAKac2Sl-GTPS2dsNzTObKA",
                "tag": "gV3B7bJDeaN3ZAVRJcbdJA",
            },
            "wrappedKey": "DZNt-W4k41pcIVsHZyZ5JsfMJAPjeiTcAlUPsfGwaPg",
            "wrapNonce": "MjM0NTY3ODk6Ozw9",
            "wrapTag": "QwyqGpHLfAaOd7due8Z9jg",
        },
    ),
]

KEYS = HostKeyPair.from_private(HOST_PRIVATE)


def as_sealed(enc: dict[str, object]) -> SealedPrompt:
    return decode(msgspec.json.encode(enc), SealedPrompt, call="jobs/claim")


def test_the_host_key_and_node_id_are_as_specified() -> None:
    assert KEYS.public_raw.hex() == HOST_PUBLIC_HEX
    assert node_id_for(NODE_SECRET) == NODE_ID
    assert "node_" + hashlib.sha256(NODE_SECRET.encode()).hexdigest()[:8] == NODE_ID


@pytest.mark.parametrize(("job_id", "prompt", "expected"), VECTORS)
def test_the_sealing_side_builds_the_known_vectors(
    job_id: str, prompt: str, expected: dict[str, object]
) -> None:
    sealed = seal_prompt(
        prompt, job_id=job_id, node_secret=NODE_SECRET, host_public=KEYS.public_raw, inputs=INPUTS
    )
    assert sealed == expected


@pytest.mark.parametrize(("job_id", "prompt", "expected"), VECTORS)
def test_known_vectors_open_to_their_prompts(
    job_id: str, prompt: str, expected: dict[str, object]
) -> None:
    opened = open_sealed_prompt(
        as_sealed(expected), job_id=job_id, node_secret=NODE_SECRET, keys=KEYS
    )
    assert opened == prompt


def test_the_wrap_key_is_hkdf_of_the_openssl_shared_secret() -> None:
    """Step 3 with the wrap key OpenSSL derived gives back the fixed content key."""
    _, _, enc = VECTORS[0]
    wrapped = b64url_decode(enc["wrappedKey"]) + b64url_decode(enc["wrapTag"])  # type: ignore[arg-type]
    content_key = AESGCM(bytes.fromhex(WRAP_KEY_HEX)).decrypt(
        b64url_decode(enc["wrapNonce"]),  # type: ignore[arg-type]
        wrapped,
        f"job_kat_0001:{NODE_ID}".encode(),
    )
    assert content_key == INPUTS.content_key


def test_padded_base64url_opens_too() -> None:
    job_id, prompt, enc = VECTORS[0]
    padded = msgspec.json.decode(msgspec.json.encode(enc))
    padded["envelope"]["ct"] += "=" * (-len(padded["envelope"]["ct"]) % 4)
    padded["wrapTag"] += "=="
    assert (
        open_sealed_prompt(as_sealed(padded), job_id=job_id, node_secret=NODE_SECRET, keys=KEYS)
        == prompt
    )


def _tampered(change: str) -> tuple[str, str, dict[str, object]]:
    job_id, _prompt, enc = VECTORS[0]
    copy = msgspec.json.decode(msgspec.json.encode(enc))
    other = HostKeyPair.from_private(bytes(range(2, 34)))
    if change == "envelope_aad":
        copy = seal_prompt(
            "x",
            job_id=job_id,
            node_secret=NODE_SECRET,
            host_public=KEYS.public_raw,
            envelope_aad=b"job_other",
        )
    elif change == "wrap_aad":
        copy = seal_prompt(
            "x",
            job_id=job_id,
            node_secret=NODE_SECRET,
            host_public=KEYS.public_raw,
            wrap_aad=b"job_kat_0001:node_ffffffff",
        )
    elif change == "another_job_id":
        job_id = "job_kat_9999"
    elif change == "another_node_secret":
        return job_id, "sk-node-" + "Z" * 32, copy
    elif change == "another_hosts_key":
        copy = seal_prompt(
            "x", job_id=job_id, node_secret=NODE_SECRET, host_public=other.public_raw
        )
    elif change in ("tag", "wrapTag", "ct", "wrappedKey", "nonce"):
        holder = copy if change in ("wrapTag", "wrappedKey") else copy["envelope"]
        raw = bytearray(b64url_decode(holder[change]))
        raw[0] ^= 0x80
        holder[change] = b64url_encode(bytes(raw))
    elif change == "short_tag":
        copy["envelope"]["tag"] = copy["envelope"]["tag"][:-4]
    elif change == "short_epk":
        copy["envelope"]["epk"] = b64url_encode(b"\x01" * 31)
    elif change == "low_order_epk":
        copy["envelope"]["epk"] = b64url_encode(b"\x00" * 32)
    elif change == "not_base64url":
        copy["envelope"]["ct"] = "not base64url!"
    elif change == "empty_nonce":
        copy["wrapNonce"] = ""
    else:  # pragma: no cover
        raise AssertionError(change)
    return job_id, NODE_SECRET, copy


@pytest.mark.parametrize(
    "change",
    [
        "envelope_aad",
        "wrap_aad",
        "another_job_id",
        "another_node_secret",
        "another_hosts_key",
        "tag",
        "wrapTag",
        "ct",
        "wrappedKey",
        "nonce",
        "short_tag",
        "short_epk",
        "low_order_epk",
        "not_base64url",
        "empty_nonce",
    ],
)
def test_a_tampered_envelope_does_not_open(change: str) -> None:
    job_id, secret, enc = _tampered(change)
    with pytest.raises(SealedPromptError) as caught:
        open_sealed_prompt(as_sealed(enc), job_id=job_id, node_secret=secret, keys=KEYS)
    assert caught.value.job_id == job_id
    assert "Name the capital" not in str(caught.value)


def test_a_content_key_of_the_wrong_size_is_refused() -> None:
    """A desk that wraps a 16-byte key (AES-128) breaks the protocol's AES-256."""
    inputs = SealInputs(INPUTS.ephemeral_private, bytes(16), INPUTS.nonce, INPUTS.wrap_nonce)
    enc = seal_prompt(
        "x", job_id="job_1", node_secret=NODE_SECRET, host_public=KEYS.public_raw, inputs=inputs
    )
    with pytest.raises(SealedPromptError, match="content key is 16 bytes"):
        open_sealed_prompt(as_sealed(enc), job_id="job_1", node_secret=NODE_SECRET, keys=KEYS)


def test_a_prompt_that_is_not_utf8_is_refused() -> None:
    # Seal raw bytes by hand (the stand-in seals text): a lone continuation byte.
    enc = seal_prompt(
        "x", job_id="job_1", node_secret=NODE_SECRET, host_public=KEYS.public_raw, inputs=INPUTS
    )
    sealed = AESGCM(INPUTS.content_key).encrypt(INPUTS.nonce, b"\x80abc", b"job_1")
    enc["envelope"]["ct"] = b64url_encode(sealed[:-16])
    enc["envelope"]["tag"] = b64url_encode(sealed[-16:])
    with pytest.raises(SealedPromptError, match="not UTF-8"):
        open_sealed_prompt(as_sealed(enc), job_id="job_1", node_secret=NODE_SECRET, keys=KEYS)


def test_key_pairs_round_trip_and_encode_unpadded() -> None:
    keys = HostKeyPair.generate()
    assert HostKeyPair.from_private(keys.private_raw) == keys
    assert "=" not in keys.public_b64 and len(keys.public_b64) == 43
    assert base64.urlsafe_b64decode(keys.public_b64 + "=") == keys.public_raw
