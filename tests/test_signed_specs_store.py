"""Signed specs in the store, on SQLite and PostgreSQL: migration 18's columns, the leader's
refusal of a row the API did not sign (:mod:`berth.deployments.signing`), signatures
carried over a key rotation, and the signing key shared sealed between leaders
(:func:`berth.cluster.pki.signing_key.share_through_store`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from berth.cluster.pki import signing_key
from berth.cluster.pki.signing_key import SpecSigner, carry_over
from berth.cluster.protocol.errors import SpecRefusedError
from berth.deployments.signing import SpecSigning
from berth.errors import ConfigError
from berth.paths import BerthHome
from berth.store import Store
from berth.vocab.deployment_request import DeploymentRequest

pytestmark = [pytest.mark.store_engines, pytest.mark.store_models(("tiny", "tiny.gguf"))]


def _sql(db_url: str, statement: str, params: dict[str, str]) -> None:
    """Run ``statement`` on the database as a writer behind berth's back would."""
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(statement), params)
    finally:
        engine.dispose()


def _request(deployment_id: str, model_path: str) -> DeploymentRequest:
    return DeploymentRequest(
        deployment_id=deployment_id,
        model_name="tiny",
        model_path=Path(model_path),
        engine="llamacpp",
        port=0,
        log_path=Path(),
        extra_args=("--flash-attn",),
        served_model_name="tiny",
    )


async def test_the_signature_is_stored_with_the_row_and_a_restart_runs_what_was_signed(
    store: Store,
    db_url: str,
) -> None:
    signing = SpecSigning(store, SpecSigner.in_memory())
    record = store.create_deployment("tiny", "llamacpp", "process", "local")
    path = store.get_model("tiny").path
    sent = await signing.sign_accepted(_request(record.id, str(path)))
    stored = store.get_deployment(record.id)
    assert stored.signed_spec == sent.signed
    # A later write to the row's fields changes nothing a restart runs.
    _sql(
        db_url,
        "UPDATE deployments SET extra_args = :a WHERE id = :i",
        {"a": '["--log-file", "/etc/cron.d/x"]', "i": record.id},
    )
    again = signing.for_restart(store.get_deployment(record.id))
    assert again.extra_args == ("--flash-attn",)
    assert again.model_path == path


def test_a_row_the_api_did_not_sign_is_refused_naming_why(store: Store) -> None:
    signing = SpecSigning(store, SpecSigner.in_memory())
    record = store.create_deployment("tiny", "llamacpp", "process", "local")
    with pytest.raises(SpecRefusedError, match="no spec signed by the cluster"):
        signing.for_restart(record)


async def test_a_signature_changed_in_the_database_is_refused(store: Store, db_url: str) -> None:
    signing = SpecSigning(store, SpecSigner.in_memory())
    record = store.create_deployment("tiny", "llamacpp", "process", "local")
    await signing.sign_accepted(_request(record.id, "/models/tiny.gguf"))
    _sql(
        db_url,
        "UPDATE deployments SET signed_spec = replace(signed_spec, :a, :b) WHERE id = :i",
        {"a": "--flash-attn", "b": "--flash-attm", "i": record.id},
    )
    with pytest.raises(SpecRefusedError, match="does not verify"):
        signing.for_restart(store.get_deployment(record.id))
    # Another leader's key (a database moved between clusters) is refused too.
    other = SpecSigning(store, SpecSigner.in_memory())
    record2 = store.create_deployment("tiny", "llamacpp", "process", "local")
    await other.sign_accepted(_request(record2.id, "/models/tiny.gguf"))
    with pytest.raises(SpecRefusedError, match="not a key this host trusts"):
        signing.for_restart(store.get_deployment(record2.id))
    # The signed spec of another deployment, copied into this row, is refused.
    _sql(
        db_url,
        "UPDATE deployments SET signed_spec = (SELECT signed_spec FROM deployments "
        "WHERE id = :src), spec_signature = (SELECT spec_signature FROM deployments "
        "WHERE id = :src), spec_key_id = (SELECT spec_key_id FROM deployments "
        "WHERE id = :src) WHERE id = :dst",
        {"src": record.id, "dst": record2.id},
    )
    with pytest.raises(SpecRefusedError, match=f"signed spec of deployment {record.id}"):
        signing.for_restart(store.get_deployment(record2.id))


async def test_a_rotation_signs_the_stored_specs_again_so_they_outlive_the_old_key(
    store: Store, tmp_path: Path
) -> None:
    ca_dir = tmp_path / "ca"
    signer = SpecSigner.load_or_create(ca_dir)
    signing = SpecSigning(store, signer)
    record = store.create_deployment("tiny", "llamacpp", "process", "local")
    await signing.sign_accepted(_request(record.id, "/models/tiny.gguf"))
    unsigned = store.create_deployment("tiny", "llamacpp", "process", "local")
    old_id = signer.key_id

    signing_key.rotate(ca_dir)
    assert carry_over(store, signer) == 1  # the unsigned row stays unsigned
    signing_key.retire(ca_dir)
    moved = store.get_deployment(record.id)
    assert moved.signed_spec is not None and moved.signed_spec.key_id == signer.key_id != old_id
    assert signing.for_restart(moved).deployment_id == record.id
    assert store.get_deployment(unsigned.id).signed_spec is None


def test_leaders_share_one_signing_key_sealed_in_the_store(store: Store, tmp_path: Path) -> None:
    first, second = BerthHome(tmp_path / "a"), BerthHome(tmp_path / "b")
    signing_key.share_through_store(first, store, "s3cret")
    signing_key.share_through_store(second, store, "s3cret")
    key_file = signing_key.SIGNING_KEY_FILE
    assert (first.ca_dir / key_file).read_bytes() == (second.ca_dir / key_file).read_bytes()
    sealed = store.cluster_bootstrap(signing_key.SEALED_ROW)
    assert sealed is not None and b"PRIVATE KEY" not in sealed.ciphertext
    assert store.cluster_bootstrap() is None  # the CA's row is its own
    with pytest.raises(ConfigError, match="cluster_secret does not open"):
        signing_key.share_through_store(BerthHome(tmp_path / "c"), store, "wrong")
    # A home holding another key is refused, naming the file to move aside.
    third = BerthHome(tmp_path / "d")
    SpecSigner.load_or_create(third.ca_dir)
    with pytest.raises(ConfigError, match=r"move .*spec-signing\.key aside"):
        signing_key.share_through_store(third, store, "s3cret")


def test_a_damaged_stored_signature_reads_as_none(store: Store, db_url: str) -> None:
    record = store.create_deployment("tiny", "llamacpp", "process", "local")
    _sql(
        db_url,
        "UPDATE deployments SET signed_spec = '{}', spec_signature = '!!', "
        "spec_key_id = 'k' WHERE id = :i",
        {"i": record.id},
    )
    assert store.get_deployment(record.id).signed_spec is None
    assert replace(record).signed_spec is None
