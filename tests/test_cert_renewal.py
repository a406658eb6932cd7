"""Short-lived agent certificates over a real mutual-TLS link on loopback: renewal over the
live link under a streaming answer, the typed close of a link whose certificate expired,
the refusal of an expired certificate at the handshake (naming the node), what ``berth
agent status`` says then, the rate-limited redial, and the pure parts."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from berth.agent.cert_pair import settle_renewed_pair, write_renewed_pair
from berth.agent.identity import load_agent_identity
from berth.agent.renewal import read_certificate, renewal_due_at
from berth.cluster.leader.dial_limit import DialRateLimiter
from berth.cluster.link.connection import LinkConnection
from berth.cluster.pki.renewal import RenewalRefused, renewal_refusal
from berth.cluster.protocol.errors import CloseCode, rate_limited_reason, retry_after_of
from berth.cluster.protocol.ops import RenewResult
from berth.engine_http.request import EngineRequest
from berth.paths import BerthHome
from berth.store import Store
from support.cluster_harness import clean_env, cli
from support.link_pair import DEPLOYMENT, ENGINE_KEY
from support.renewal_leader import DialingCore, agent_for, enroll, renewing_leader
from support.standin_engine import StandinEngine, sse_event, sse_reply
from support.waiting import wait_for_async

HUB_LOG = "berth.cluster.leader.hub"


async def test_three_renewals_in_a_row_keep_the_link_and_a_stream_through_it(
    tmp_path: Path,
) -> None:
    lifetime_s = 12.0  # renewed every 8 s
    events = [sse_event({"i": i}) for i in range(320)]  # 0.1 s apart: 32 s, three renewals
    async with (
        renewing_leader(tmp_path, lifetime_s) as leader,
        StandinEngine(sse_reply(events, pause_s=0.1), api_key=ENGINE_KEY) as engine,
    ):
        identity = await enroll(leader, tmp_path, "gpu-a")
        first = read_certificate(identity.cert_path)
        assert first is not None
        assert first.not_after - first.issued_at == pytest.approx(lifetime_s, abs=2)
        dialer = agent_for(identity, DialingCore(engine.port), renew=True)
        running = asyncio.create_task(dialer.run())
        try:
            await wait_for_async(
                lambda: leader.hub.is_connected(identity.node_id), 30, "the agent's link"
            )
            link = leader.hub.remote_link(identity.node_id)
            assert link is not None
            request = EngineRequest(
                "/v1/chat/completions", b"", [(b"content-type", b"application/json")],
                b'{"stream": true}',
            )  # fmt: skip
            response = await leader.hub.open_http(identity.node_id, DEPLOYMENT, request, 30.0)
            assert response.status == 200
            body = bytearray()

            async def read_all() -> None:
                while not response.at_eof:
                    body.extend(await response.read_chunk())

            reading = asyncio.create_task(read_all())
            seen = [first]
            assert dialer.renewer is not None
            renewer = dialer.renewer
            for n in (1, 2, 3):

                def renewed(n: int = n) -> bool:
                    return bool(renewer.renewals >= n)

                await wait_for_async(renewed, 60, f"renewal {n}")
                facts = read_certificate(identity.cert_path)
                assert facts is not None
                seen.append(facts)
                assert leader.store.node_certificate(facts.fingerprint) is not None
            await asyncio.wait_for(reading, 60)
            # The same link all along, and every event of the stream came through it.
            assert leader.hub.remote_link(identity.node_id) is link and not link.conn.closed
            assert body.count(b"data: ") == len(events)
            assert len({facts.serial for facts in seen}) == 4
            not_afters = [facts.not_after for facts in seen]
            assert not_afters == sorted(not_afters) and len(set(not_afters)) == 4
            # The leader recorded each one (above), the newest as the node's current
            # certificate (a fourth renewal may have come meanwhile).
            current = leader.store.current_node_certificates()[identity.node_id]
            assert current.not_after >= seen[-1].not_after
            # The key moved with the certificate: the pair on disk loads as one.
            load_agent_identity(BerthHome(identity.cert_path.parent))
        finally:
            await dialer.stop()
            await running


async def test_a_link_whose_certificate_expires_unrenewed_is_closed_with_the_typed_code(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=HUB_LOG)
    async with renewing_leader(tmp_path, lifetime_s=10.0) as leader:
        identity = await enroll(leader, tmp_path, "gpu-b")
        facts = read_certificate(identity.cert_path)
        assert facts is not None
        dialer = agent_for(identity, DialingCore(1), renew=False)  # renewal blocked
        code = await asyncio.wait_for(dialer.run(), 60)
        ended_at = time.time()
        assert code == 1
        assert dialer.final_code == CloseCode.CERTIFICATE_EXPIRED
        # Closed by the expiry watch at most a second late (a loaded machine: a few more).
        assert facts.not_after <= ended_at < facts.not_after + 10
        status = dialer._status
        assert status.state == "expired"
        assert "fix: berth agent register --uri" in status.last_error

        # Expired while offline: the next dial is refused at the handshake, naming the node.
        again = agent_for(identity, DialingCore(1), renew=False)
        assert await asyncio.wait_for(again.run(), 30) == 1
        assert again.final_code == CloseCode.CERTIFICATE_EXPIRED
        refused = [r.getMessage() for r in caplog.records if "refused agent link" in r.getMessage()]
        assert any(f"node {identity.node_id} (gpu-b) expired at" in line for line in refused)

    # And `berth agent status` says so, with the one command that fixes it.
    home = identity.cert_path.parent
    shown = await asyncio.to_thread(cli, home, "agent", "status", env=clean_env({}), check=False)
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert "expired" in shown.stdout
    assert "EXPIRED" in shown.stdout
    assert "fix     berth agent register --uri" in shown.stdout


def test_renewal_is_refused_for_a_removed_node_an_expired_link_or_a_bad_csr(
    tmp_path: Path,
) -> None:
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    store.migrate()
    node = store.enroll_node("gpu-c", "sha256:" + "0" * 64)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node.id)])
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    csr_pem = csr.public_bytes(serialization.Encoding.PEM).decode()
    now = 1000.0
    assert renewal_refusal(node, now + 5, csr_pem, now) is None
    assert "expired" in (renewal_refusal(node, now - 1, csr_pem, now) or "")
    assert renewal_refusal(None, now + 5, csr_pem, now) == "this node is not enrolled"
    removed = store.remove_node(node.id)
    assert "removed" in (renewal_refusal(removed, now + 5, csr_pem, now) or "")
    # A CSR whose signature does not verify proves nothing about the key.
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    der[-5] ^= 0xFF
    tampered = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    refusal = renewal_refusal(node, now + 5, tampered.decode(), now) or ""
    assert "signature" in refusal or "invalid" in refusal
    store.close()


def test_renewal_is_due_at_two_thirds_of_the_lifetime_after_the_backdating() -> None:
    issued = 10_000.0
    not_before = issued - 300  # berth backdates by five minutes
    assert renewal_due_at(not_before, issued + 90) == pytest.approx(issued + 60)
    assert renewal_due_at(not_before, issued + 86400) == pytest.approx(issued + 57600)


def test_a_pair_replacement_cut_short_is_finished_or_dropped(tmp_path: Path) -> None:
    home = BerthHome(tmp_path)
    home.agent_key.write_bytes(b"old key")
    home.agent_cert.write_bytes(b"old cert")
    write_renewed_pair(home, b"new key", b"new cert")
    assert (home.agent_key.read_bytes(), home.agent_cert.read_bytes()) == (b"new key", b"new cert")
    # Cut off after the key moved: the certificate follows it.
    (tmp_path / "agent.crt.next").write_bytes(b"newer cert")
    home.agent_key.write_bytes(b"newer key")
    settle_renewed_pair(home)
    assert home.agent_cert.read_bytes() == b"newer cert"
    # Cut off before the certificate was written: the old pair stays.
    (tmp_path / "agent.key.next").write_bytes(b"lost key")
    settle_renewed_pair(home)
    assert home.agent_key.read_bytes() == b"newer key"
    assert not (tmp_path / "agent.key.next").exists()


async def test_an_agent_that_dials_too_often_waits_as_long_as_the_leader_says(
    tmp_path: Path,
) -> None:
    limiter = DialRateLimiter(max_dials=1, window_s=120.0)
    async with renewing_leader(tmp_path, lifetime_s=3600.0, dial_limiter=limiter) as leader:
        identity = await enroll(leader, tmp_path, "gpu-d")
        first = agent_for(identity, DialingCore(1), renew=False)
        running = asyncio.create_task(first.run())
        await wait_for_async(lambda: leader.hub.is_connected(identity.node_id), 30, "a link")
        await first.stop()
        await running
        # A second dial within the window is refused with RATE_LIMITED and a retry delay,
        # which the agent honours over its own (much shorter) backoff.
        second = agent_for(identity, DialingCore(1), renew=False)
        second._backoff = lambda attempt: 0.01
        running = asyncio.create_task(second.run())
        status = second._status

        def waiting() -> bool:
            return any("redialling in" in line for line in status.recent)

        await wait_for_async(waiting, 30, "the agent to back off")
        await second.stop()
        await running
    assert "code 4429" in status.last_error and "retry_after_s=" in status.last_error
    (line,) = [line for line in status.recent if "redialling in" in line]
    delay_s = float(line.split("redialling in ")[1].split(" s")[0])
    assert 100 < delay_s <= 120


async def test_a_stop_that_comes_during_the_handshake_ends_the_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stop()`` while the Welcome is on its way (the leader already counts the node as
    connected, the agent holds no link yet) ends ``run()``: it once left the link open for
    good, and the rate-limit test above hung on it in a full run."""
    async with renewing_leader(tmp_path, lifetime_s=3600.0) as leader:
        identity = await enroll(leader, tmp_path, "gpu-s")
        dialer = agent_for(identity, DialingCore(1), renew=False)
        handshake = LinkConnection.handshake

        async def handshake_then_stop(
            conn: LinkConnection, greeting: object, **options: object
        ) -> object:
            answer = await handshake(conn, greeting, **options)  # type: ignore[call-overload]
            if conn.peer == "leader":  # the agent's end (the leader's shares this class)
                await dialer.stop()  # the dialer has no link to close yet
            return answer

        monkeypatch.setattr(LinkConnection, "handshake", handshake_then_stop)
        assert await asyncio.wait_for(dialer.run(), 20) == 0
        await wait_for_async(lambda: not leader.hub.is_connected(identity.node_id), 10, "a close")


def test_the_rate_limit_reason_carries_the_delay_in_whole_seconds() -> None:
    reason = rate_limited_reason(4.2)
    assert reason.startswith("retry_after_s=5 ")
    assert retry_after_of(CloseCode.RATE_LIMITED, reason) == 5.0
    assert retry_after_of(CloseCode.HEARTBEAT_TIMEOUT, reason) is None
    assert retry_after_of(CloseCode.RATE_LIMITED, "slow down") is None
    assert retry_after_of(CloseCode.RATE_LIMITED, "retry_after_s=99999999") is None
    limiter = DialRateLimiter(max_dials=2, window_s=10.0)
    assert limiter.check("a", 0.0) is None and limiter.check("a", 1.0) is None
    assert limiter.check("a", 2.0) == 8.0
    assert limiter.check("b", 2.0) is None  # per node
    assert limiter.check("a", 10.5) is None  # the first dial left the window


async def test_a_refused_renewal_is_retried_with_backoff_and_shown_until_one_succeeds(
    tmp_path: Path,
) -> None:
    async with renewing_leader(tmp_path, lifetime_s=12.0) as leader:
        certificates = leader.hub._certificates
        assert certificates is not None
        issue = certificates.renew
        refusals = 2

        def refuse_twice(node_id: str, not_after: float | None, csr_pem: str) -> RenewResult:
            nonlocal refusals
            if refusals > 0:
                refusals -= 1
                certificates.refusals[node_id] = "the signing service is down"
                raise RenewalRefused("the signing service is down")
            return issue(node_id, not_after, csr_pem)

        certificates.renew = refuse_twice  # type: ignore[method-assign]
        identity = await enroll(leader, tmp_path, "gpu-e")
        dialer = agent_for(identity, DialingCore(1), renew=True)
        status = dialer._status
        seen: list[str] = []
        shown: list[str | None] = []

        def failing() -> bool:
            if status.renewal_failing:
                seen.append(status.renewal_state)
                shown.append(leader.hub.renewal_refusals.get(identity.node_id))
            return len(set(seen)) >= 2

        running = asyncio.create_task(dialer.run())
        try:
            await wait_for_async(failing, 30, "two refused renewals in the status")
            assert dialer.renewer is not None
            renewer = dialer.renewer
            await wait_for_async(lambda: renewer.renewals >= 1, 30, "the renewal that succeeds")
        finally:
            await dialer.stop()
            await running
    assert "renewal failed (attempt 1): " in seen[0] and "signing service is down" in seen[0]
    assert any("renewal failed (attempt 2): " in line for line in seen)
    assert "retrying in " in seen[0]
    assert "the signing service is down" in shown  # what `berth nodes ls` shows meanwhile
    assert not status.renewal_failing
    assert identity.node_id not in leader.hub.renewal_refusals  # cleared by the success
