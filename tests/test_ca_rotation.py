"""Rotating the cluster CA under two real agents on loopback mutual TLS, one of them offline
during the rotation: both end on new-CA leaves through renewal over their links, with both
roots in their trust stores; ``retire`` is refused naming a node while one holds an old-CA
leaf, then succeeds; after it, agents dial the leader's re-issued server certificate."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from cryptography import x509

from berth.agent.dialer import AgentDialer
from berth.agent.identity import AgentIdentity, load_agent_identity
from berth.agent.renewal import read_certificate
from berth.cluster.pki.ca import CertificateAuthority, fingerprint_of_pem
from berth.cluster.pki.ca_rotation import holders_of_old_leaves, retire, rotate
from berth.errors import ConflictError
from berth.paths import BerthHome
from support.cluster_harness import started_cluster
from support.renewal_leader import DialingCore, RenewingLeader, agent_for, enroll, renewing_leader
from support.waiting import wait_for_async


def issuer_of(identity: AgentIdentity, ca: CertificateAuthority) -> str:
    """``new`` or ``old``: which root issued the agent's certificate on disk."""
    leaf = x509.load_pem_x509_certificate(identity.cert_path.read_bytes())
    return "new" if leaf.issuer == ca.certificate.subject else "old"


async def renewed_to_new_ca(leader: RenewingLeader, identity: AgentIdentity) -> None:
    await wait_for_async(
        lambda: issuer_of(identity, leader.ca) == "new", 60, f"{identity.label} on the new CA"
    )


async def test_rotation_with_one_agent_offline_ends_with_both_on_the_new_ca(
    tmp_path: Path,
) -> None:
    async with renewing_leader(tmp_path, lifetime_s=15.0) as leader:
        online = await enroll(leader, tmp_path, "gpu-on")
        offline = await enroll(leader, tmp_path, "gpu-off")
        old_root = leader.ca.fingerprint_sha256
        dialers: list[AgentDialer] = []
        tasks: list[asyncio.Task[int]] = []

        def start(identity: AgentIdentity) -> None:
            dialer = agent_for(identity, DialingCore(1), renew=True)
            dialers.append(dialer)
            tasks.append(asyncio.create_task(dialer.run()))

        try:
            start(online)
            await wait_for_async(lambda: leader.hub.is_connected(online.node_id), 30, "a link")

            await asyncio.to_thread(rotate, leader.ca)
            await leader.tls.reload(reason="the CA rotated")  # the daemon: on the file change
            assert leader.ca.previous_fingerprint == old_root
            assert leader.ca.fingerprint_sha256 != old_root
            held = {h.label for h in holders_of_old_leaves(leader.store, leader.ca)}
            assert held == {"gpu-on", "gpu-off"}
            with pytest.raises(ConflictError, match="gpu-off"):
                retire(leader.ca, holders_of_old_leaves(leader.store, leader.ca))

            # The online agent renews over its live link; the offline one comes back with
            # its old leaf (still valid) and renews too.
            await renewed_to_new_ca(leader, online)
            start(offline)
            await renewed_to_new_ca(leader, offline)
            for identity in (online, offline):
                pins = load_agent_identity(BerthHome(identity.cert_path.parent)).pins
                assert set(pins) == {old_root, leader.ca.fingerprint_sha256}
                roots = x509.load_pem_x509_certificates(identity.ca_path.read_bytes())
                assert len(roots) == 2
            assert holders_of_old_leaves(leader.store, leader.ca) == []

            await asyncio.to_thread(retire, leader.ca, [])
            await leader.tls.reload(reason="the old root was retired")
            assert leader.ca.previous is None
            served = x509.load_pem_x509_certificates(
                (leader.home.ca_dir / "cluster.pem").read_bytes()
            )
            assert served[0].issuer == leader.ca.certificate.subject
        finally:
            for dialer in dialers:
                await dialer.stop()
            await asyncio.gather(*tasks)

        # A fresh dial verifies the re-issued server certificate with the new root.
        again = agent_for(online, DialingCore(1), renew=False)
        running = asyncio.create_task(again.run())
        try:
            await wait_for_async(
                lambda: again._status.state == "connected", 30, "a dial after retirement"
            )
        finally:
            await again.stop()
            await running
        facts = read_certificate(online.cert_path)
        assert facts is not None
        assert fingerprint_of_pem(leader.ca.server_root_pem) == leader.ca.fingerprint_sha256


async def test_a_node_enrolled_during_a_rotation_trusts_both_roots_and_holds_a_new_leaf(
    tmp_path: Path,
) -> None:
    async with renewing_leader(tmp_path, lifetime_s=3600.0) as leader:
        old_root = leader.ca.fingerprint_sha256
        await asyncio.to_thread(rotate, leader.ca)
        await leader.tls.reload(reason="the CA rotated")
        identity = await enroll(leader, tmp_path, "gpu-new")
        assert identity.ca_fingerprint == old_root  # the URI pins the root serving the leader
        assert set(identity.pins) == {old_root, leader.ca.fingerprint_sha256}
        assert issuer_of(identity, leader.ca) == "new"
        dialer = agent_for(identity, DialingCore(1), renew=False)
        running = asyncio.create_task(dialer.run())
        try:
            await wait_for_async(
                lambda: leader.hub.is_connected(identity.node_id), 30, "its first link"
            )
        finally:
            await dialer.stop()
            await running
        assert holders_of_old_leaves(leader.store, leader.ca) == []


def test_berth_ca_status_rotate_and_retire_through_the_daemon(tmp_path: Path) -> None:
    with started_cluster(tmp_path) as cluster:
        before = json.loads(cluster.berth("ca", "status", "--json").stdout)
        assert before["rotating"] is False and before["previous_fingerprint"] is None
        rotated = cluster.berth("ca", "rotate").stdout
        assert "old root  " + before["fingerprint"] in rotated
        status = json.loads(cluster.berth("ca", "status", "--json").stdout)
        assert status["rotating"] is True and status["fingerprint"] != before["fingerprint"]
        # Nothing enrolled holds an old-CA leaf: retiring goes ahead, and the leader's
        # server certificates come from the new CA from then on.
        assert "rotation  none under way" in cluster.berth("ca", "retire").stdout
        served = x509.load_pem_x509_certificate(
            (cluster.leader_home / "ca" / "cluster.pem").read_bytes()
        )
        new_root = x509.load_pem_x509_certificate(
            (cluster.leader_home / "ca" / "ca.pem").read_bytes()
        )
        assert served.issuer == new_root.subject
        again = cluster.berth("ca", "retire", check=False)
        assert again.returncode != 0 and "no CA rotation is under way" in again.stderr
