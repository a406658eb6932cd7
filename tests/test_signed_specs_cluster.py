"""Signed specs with real agents (``berth agent start`` processes over mutual TLS).

- A ``deployments`` row inserted by SQL (SQLite and PostgreSQL) is never started: a real
  leader daemon refuses it when the restart policy would start it, fails it naming why and
  logs it; the agent never hears of it.
- The agent checks the signature itself: a leader (here the test's in-process cluster
  listener and hub, :mod:`support.renewal_leader`, the seam that lets a test send what a
  leader never would) that sends a start with one byte of its signed spec changed, a
  signature of a key the agent does not trust, or a start that differs from what was signed,
  is refused with ``spec_refused`` naming the deployment; a correctly signed start runs.
- A rotated signing key reaches the agent with its next certificate renewal, and what the
  new key signs then runs there.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from berth.cluster.leader.remote_link import RemoteLink
from berth.cluster.link.connection import RemoteOpError
from berth.cluster.pki import signing_key
from berth.cluster.pki.signing_key import SpecSigner, trusted_in
from berth.cluster.protocol.errors import SpecRefusedError
from berth.cluster.protocol.payloads import ErrorCode
from berth.cluster.protocol.spec_signing import SpecKeys, sign_spec
from berth.paths import BerthHome
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.signed_spec import SignedSpec
from support.cluster_harness import TINY_GGUF_BYTES, clean_env, fake_engine_wrapper, started_cluster
from support.renewal_leader import RenewingLeader, enroll, renewing_leader
from support.waiting import EVENT_TIMEOUT_S, wait_for, wait_for_async

pytestmark = pytest.mark.slow


# -- a row written straight into the database -----------------------------------------------


@pytest.mark.store_engines
def test_a_row_inserted_by_sql_is_never_started_and_the_leader_says_why(
    tmp_path: Path, db_url: str
) -> None:
    settings = {"BERTH_DATABASE_URL": db_url, "BERTH_RESTART_BACKOFF_S": "0.2"}
    with started_cluster(tmp_path, settings) as cluster:
        agent = cluster.add_agent("gpu-1")
        # Through the CLI: signed, and the real agent runs it.
        signed_id = cluster.deploy("tiny", tmp_path / "tiny.gguf", agent)
        row = _select(db_url, "SELECT spec_key_id FROM deployments WHERE id = :i", signed_id)
        assert row is not None and str(row).startswith("ed25519:")

        # Behind berth's back: a ready deployment the agent does not run, so the agent's
        # next Hello has the restart policy start it (as it would any engine found gone).
        _insert_ready_row(db_url, "d-0badc0de", agent.node_id)
        cluster.stop_agent(agent)
        cluster.start_agent(agent)

        def failed() -> bool:
            return bool(cluster.deployment("d-0badc0de")["state"] == "failed")

        wait_for(failed, EVENT_TIMEOUT_S, "the inserted deployment to be failed")
        reason = cluster.deployment("d-0badc0de")["failure_reason"]
        assert "no spec signed by the cluster" in reason, reason
        log = BerthHome(cluster.leader_home).daemon_log.read_text()
        assert "refusing to start deployment d-0badc0de" in log
        assert not (agent.home / "logs" / "engine-d-0badc0de.log").exists()
        assert "d-0badc0de" not in (agent.home / "agent-engines.json").read_text()
        assert cluster.deployment(signed_id)["state"] == "ready"  # the signed one runs on


def _insert_ready_row(db_url: str, deployment_id: str, node_id: str) -> None:
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO deployments (id, model_name, engine, runtime, node_id, state, "
                    "gpus, extra_args, served_model_name, created_at, updated_at, "
                    "restart_policy, restart_count) VALUES (:id, 'tiny', 'llamacpp', "
                    "'process', :node, 'ready', '[]', '[\"--log-file\", \"/tmp/x\"]', 'evil', "
                    "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 'always', 0)"
                ),
                {"id": deployment_id, "node": node_id},
            )
    finally:
        engine.dispose()


def _select(db_url: str, statement: str, deployment_id: str) -> object:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(statement), {"i": deployment_id}).scalar()
    finally:
        engine.dispose()


# -- what the agent itself checks -----------------------------------------------------------


async def _started_agent(home: Path, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "berth", "--home", str(home), "agent", "start", "--verbose",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=home,
    )  # fmt: skip


async def _stopped(agent: asyncio.subprocess.Process) -> None:
    if agent.returncode is None:
        os.kill(agent.pid, signal.SIGTERM)
        await asyncio.wait_for(agent.wait(), EVENT_TIMEOUT_S)


async def _link(leader: RenewingLeader, node_id: str) -> RemoteLink:
    await wait_for_async(
        lambda: leader.hub.remote_link(node_id) is not None, EVENT_TIMEOUT_S, "the agent's link"
    )
    link = leader.hub.remote_link(node_id)
    assert link is not None
    return link


async def _refused(link: RemoteLink, request: DeploymentRequest, words: str) -> str:
    with pytest.raises(SpecRefusedError) as caught:
        await link.start_deployment(request, health_timeout_s=30.0)
    answer = caught.value.__cause__  # the agent's answer, typed
    assert isinstance(answer, RemoteOpError) and answer.info.code == ErrorCode.SPEC_REFUSED
    assert caught.value.deployment_id == request.deployment_id
    message = answer.info.message
    assert request.deployment_id in message and words in message, message
    return message


async def _runs(link: RemoteLink, request: DeploymentRequest) -> None:
    endpoint = await link.start_deployment(request, health_timeout_s=30.0)
    assert endpoint.pid > 0
    await link.stop_deployment(request.deployment_id, grace_s=5.0)


@pytest.fixture
async def agent_and_leader(tmp_path: Path) -> AsyncIterator[tuple[RenewingLeader, str, Path]]:
    """An in-process leader issuing 12 s certificates and one real agent process dialing it
    (the fake engine as its ``llama-server``); yields the leader, the node id and the
    agent's home."""
    async with renewing_leader(tmp_path, lifetime_s=12.0) as leader:
        identity = await enroll(leader, tmp_path, "gpu-1")
        home = identity.cert_path.parent
        env = clean_env(
            {
                "BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(tmp_path)),
                "BERTH_ORPHAN_GRACE_S": "0",  # no engine warden left behind
            }
        )
        agent = await _started_agent(home, env)
        try:
            yield leader, identity.node_id, home
        finally:
            await _stopped(agent)


async def test_the_agent_refuses_a_spec_changed_on_the_wire_and_takes_a_rotated_key(
    agent_and_leader: tuple[RenewingLeader, str, Path], tmp_path: Path
) -> None:
    leader, node_id, home = agent_and_leader
    ca_dir = leader.home.ca_dir
    # Enrollment pinned the cluster's key beside the agent's certificate.
    pinned = SpecKeys.from_pem(BerthHome(home).agent_spec_keys.read_bytes())
    assert pinned.ids == trusted_in(ca_dir).ids
    link = await _link(leader, node_id)
    model = tmp_path / "tiny.gguf"
    model.write_bytes(TINY_GGUF_BYTES)
    signer = SpecSigner.load_or_create(ca_dir)

    def request(deployment_id: str) -> DeploymentRequest:
        plain = DeploymentRequest(
            deployment_id=deployment_id, model_name="tiny", model_path=model,
            engine="llamacpp", port=0, log_path=Path(), extra_args=("--threads", "1"),
        )  # fmt: skip
        return replace(plain, signed=signer.sign(plain))

    # One byte of the signed spec changed on its way ("1" becomes "2" in --threads).
    good = request("d-00000001")
    assert good.signed is not None
    flipped = good.signed.spec.replace(b'"1"]', b'"2"]')
    assert len(flipped) == len(good.signed.spec) and flipped != good.signed.spec
    await _refused(
        link, replace(good, signed=replace(good.signed, spec=flipped)), "does not verify"
    )
    # What is asked differs from what was signed (an argument added after signing).
    added = replace(good, extra_args=(*good.extra_args, "--log-file", "/tmp/x"))
    await _refused(link, added, "does not match its signed spec (extra_args")
    # Signed by a key of another cluster; and not signed at all.
    stranger = sign_spec(SpecSigner.in_memory().current, replace(good, signed=None))
    await _refused(link, replace(good, signed=stranger), "not a key this host trusts")
    await _refused(link, replace(good, signed=None), "carries no spec signed by the cluster")
    assert not (home / "logs" / "engine-d-00000001.log").exists()  # nothing was launched
    await _runs(link, request("d-00000001"))

    # A rotation: the renewal (every 8 s here) brings both keys, and the new one signs.
    old_id = signer.key_id
    signing_key.rotate(ca_dir)
    assert signer.key_id != old_id

    def both_pinned() -> bool:
        keys = SpecKeys.from_pem(BerthHome(home).agent_spec_keys.read_bytes())
        return keys.ids == (signer.key_id, old_id)

    await wait_for_async(both_pinned, EVENT_TIMEOUT_S, "the renewal to bring the new key")
    link = await _link(leader, node_id)  # a renewal may have come with a new session
    await _runs(link, request("d-00000002"))
    signing_key.retire(ca_dir)
    await wait_for_async(
        lambda: (
            SpecKeys.from_pem(BerthHome(home).agent_spec_keys.read_bytes()).ids == (signer.key_id,)
        ),
        EVENT_TIMEOUT_S,
        "the renewal to drop the old key",
    )
    old_signed = SignedSpec(b"{}", bytes(64), old_id)
    await _refused(link, replace(request("d-00000003"), signed=old_signed), "not a key")
