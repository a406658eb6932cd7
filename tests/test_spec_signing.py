"""Signed specs, in process: the canonical form, signing and checking
(:mod:`berth.cluster.protocol.spec_signing`), the wire form of a signed start, the signing
key's files and rotation (:mod:`berth.cluster.pki.signing_key`), and node ``local``'s core
refusing what the cluster did not sign."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from berth.agent.core import AgentCore
from berth.cluster.leader.agent_link import LOCAL_NODE_ID, AgentLink
from berth.cluster.pki import signing_key
from berth.cluster.pki.signing_key import SpecSigner
from berth.cluster.protocol.errors import SpecRefusedError
from berth.cluster.protocol.ops import SPEC_CAPABILITY, START, StartArgs
from berth.cluster.protocol.spec_signing import (
    SpecKeys,
    canonical_spec,
    check_signed,
    key_id,
    request_of,
    sign_spec,
)
from berth.deployments.signing import SpecSigning
from berth.errors import ConfigError
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import StaticInventory
from berth.runtime.process import ProcessRuntime
from berth.store import Store
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.signed_spec import SignedSpec

REQUEST = DeploymentRequest(
    deployment_id="d-0000beef",
    model_name="tiny",
    model_path=Path("/models/tiny.gguf"),
    engine="llamacpp",
    port=0,
    log_path=Path(),
    gpus=(1, 0),
    ctx=4096,
    extra_args=("--chat-template-file", "/models/t.jinja"),
    served_model_name="tiny-chat",
)


def test_the_canonical_form_is_sorted_compact_ascii_json_of_every_field_the_agent_acts_on() -> None:
    spec = canonical_spec(replace(REQUEST, model_name="tïny"))
    assert spec == (
        b'{"adapter_slots":null,"ctx":4096,"deployment_id":"d-0000beef",'
        b'"engine":"llamacpp","extra_args":["--chat-template-file","/models/t.jinja"],'
        b'"format":1,"gpus":[1,0],"image":null,"lora_files":[],"lora_target_modules":[],'
        b'"max_lora_rank":null,"model_name":"t\\u00efny","model_path":"/models/tiny.gguf",'
        b'"runtime":"process","served_model_name":"tiny-chat"}'
    )
    # What the agent chooses itself is not part of it.
    chosen = replace(REQUEST, port=8080, log_path=Path("/x.log"), api_key="k")
    assert canonical_spec(chosen) == canonical_spec(REQUEST)


def test_a_signed_spec_verifies_and_decodes_to_the_same_start() -> None:
    key = Ed25519PrivateKey.generate()
    signed = sign_spec(key, REQUEST)
    assert signed.key_id == key_id(key.public_key())
    assert len(signed.signature) == 64
    again = request_of(signed)
    assert again == REQUEST and again.signed == signed
    check_signed(again, SpecKeys.of([key.public_key()]))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


@pytest.mark.parametrize(
    ("tamper", "words"),
    [
        # one byte of the spec ("--chat-template-file" becomes "--chat-template-fild")
        (lambda s: replace(s, spec=s.spec.replace(b"file", b"fild")), "does not verify"),
        (lambda s: replace(s, signature=_flip(s.signature, 10)), "does not verify"),
        (lambda s: replace(s, key_id="ed25519:0000000000000000"), "not a key this host trusts"),
    ],
    ids=["spec-byte", "signature-byte", "unknown-key"],
)
def test_a_tampered_signed_spec_is_refused_naming_why(tamper: object, words: str) -> None:
    key = Ed25519PrivateKey.generate()
    signed = tamper(sign_spec(key, REQUEST))  # type: ignore[operator]
    with pytest.raises(SpecRefusedError, match=words) as caught:
        check_signed(replace(REQUEST, signed=signed), SpecKeys.of([key.public_key()]))
    assert caught.value.deployment_id == "d-0000beef"
    assert "d-0000beef" in str(caught.value)


def test_a_start_that_differs_from_its_signed_spec_is_refused_naming_the_field() -> None:
    key = Ed25519PrivateKey.generate()
    signed = sign_spec(key, REQUEST)
    changed = replace(REQUEST, extra_args=(*REQUEST.extra_args, "--log-file", "/etc/x"))
    with pytest.raises(SpecRefusedError, match=r"extra_args is .*--log-file.* signed spec says"):
        check_signed(replace(changed, signed=signed), SpecKeys.of([key.public_key()]))
    other_path = replace(REQUEST, model_path=Path("/elsewhere.gguf"), signed=signed)
    with pytest.raises(SpecRefusedError, match=r"model_path is '/elsewhere\.gguf'"):
        check_signed(other_path, SpecKeys.of([key.public_key()]))


def test_an_unsigned_start_and_a_host_with_no_pinned_key_are_refused() -> None:
    key = Ed25519PrivateKey.generate()
    with pytest.raises(SpecRefusedError, match="carries no spec signed by the cluster"):
        check_signed(REQUEST, SpecKeys.of([key.public_key()]))
    signed = replace(REQUEST, signed=sign_spec(key, REQUEST))
    with pytest.raises(SpecRefusedError, match="no spec signing key pinned"):
        check_signed(signed, SpecKeys(()))


def test_the_start_op_carries_the_signed_spec_and_an_agent_verifies_what_arrives() -> None:
    key = Ed25519PrivateKey.generate()
    signed = replace(REQUEST, signed=sign_spec(key, REQUEST))
    raw = START.encode_args(StartArgs.from_request(signed, health_timeout_s=5.0))
    wire = json.loads(bytes(raw))
    assert wire["signed_spec"] == signed.signed.spec.decode()  # type: ignore[union-attr]
    assert wire["spec_key_id"] == key_id(key.public_key())
    received = START.decode_args(raw).to_request()
    check_signed(received, SpecKeys.of([key.public_key()]))
    # Unsigned: the fields stay off the wire (an older agent sees the same frame as before).
    plain = json.loads(
        bytes(START.encode_args(StartArgs.from_request(REQUEST, health_timeout_s=5.0)))
    )
    assert not {"signed_spec", "spec_signature", "spec_key_id"} & set(plain)
    # A signature that is not base64 arrives as no signature, refused as such.
    wire["spec_signature"] = "not base64!"
    broken = START.decode_args(json.dumps(wire).encode()).to_request()
    assert broken.signed is None


def test_spec_keys_travel_as_pem_and_refuse_a_key_of_another_kind() -> None:
    keys = SpecKeys.of([Ed25519PrivateKey.generate().public_key() for _ in range(2)])
    assert SpecKeys.from_pem(keys.to_pem()).ids == keys.ids
    ec_pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(ConfigError, match="not an Ed25519 public key"):
        SpecKeys.from_pem(ec_pem)
    with pytest.raises(ConfigError, match="no spec signing key"):
        SpecKeys.from_pem(b"")


def test_the_signing_key_is_made_beside_the_ca_and_rotates_with_both_keys_trusted(
    tmp_path: Path,
) -> None:
    ca_dir = tmp_path / "ca"
    signer = SpecSigner.load_or_create(ca_dir)
    key_file = ca_dir / signing_key.SIGNING_KEY_FILE
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert SpecSigner.load_or_create(ca_dir).key_id == signer.key_id  # loaded, not made again
    before = signer.key_id
    old = signer.sign(REQUEST)

    signing_key.rotate(ca_dir)
    assert signer.key_id != before  # read from the files: the holder follows the rotation
    assert signer.trusted.ids == (signer.key_id, before)
    check_signed(replace(REQUEST, signed=old), signer.trusted)  # the old key still verifies

    signing_key.retire(ca_dir)
    assert signer.trusted.ids == (signer.key_id,)
    with pytest.raises(SpecRefusedError, match="not a key this host trusts"):
        check_signed(replace(REQUEST, signed=old), signer.trusted)


def test_a_damaged_signing_key_file_is_named(tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    ca_dir.mkdir()
    (ca_dir / signing_key.SIGNING_KEY_FILE).write_text("not a key")
    with pytest.raises(ConfigError, match=r"spec-signing\.key"):
        SpecSigner.load_or_create(ca_dir)


async def test_node_locals_core_refuses_a_start_the_cluster_did_not_sign(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    core = AgentCore(
        ProcessRuntime(),
        EngineBinaries(
            llama_server="/nonexistent/llama-server", vllm=None, sglang_python="python3"
        ),
        StaticInventory(),
        logs_dir=tmp_path / "logs",
        spec_keys=lambda: SpecKeys.of([key.public_key()]),
    )
    try:
        with pytest.raises(SpecRefusedError, match="carries no spec signed"):
            await core.start(REQUEST, health_timeout_s=5.0)
        forged = SignedSpec(canonical_spec(REQUEST), bytes(64), key_id(key.public_key()))
        with pytest.raises(SpecRefusedError, match="does not verify"):
            await core.start(replace(REQUEST, signed=forged), health_timeout_s=5.0)
        assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())
    finally:
        core.close()


class _Link:
    """What the leader's node check reads of a link: its node and capabilities."""

    def __init__(self, node_id: str, capabilities: frozenset[str]) -> None:
        self.node_id = node_id
        self.capabilities = capabilities


@pytest.mark.parametrize("required", [False, True])
def test_an_agent_that_does_not_check_specs_is_named_and_refused_when_required(
    required: bool, caplog: pytest.LogCaptureFixture
) -> None:
    signing = SpecSigning(cast(Store, None), SpecSigner.in_memory(), require_agent_check=required)
    old = cast(AgentLink, _Link("n-old", frozenset({"op.start"})))
    new = cast(AgentLink, _Link("n-new", frozenset({"op.start", SPEC_CAPABILITY})))
    local = cast(AgentLink, _Link(LOCAL_NODE_ID, frozenset()))
    signing.check_node(new, "d-1")
    signing.check_node(local, "d-1")  # node local's core always checks
    if required:
        with pytest.raises(SpecRefusedError, match="node n-old's agent does not check signed"):
            signing.check_node(old, "d-1")
    else:
        signing.check_node(old, "d-1")
        assert "node n-old's agent does not check signed specs" in caplog.text
