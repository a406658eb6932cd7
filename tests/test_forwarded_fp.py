"""The reverse-proxy fingerprint mode on real TLS sockets: the cluster listener and the hub on
loopback (a temporary CA, two enrolled nodes), dialed the way a TLS-terminating proxy in front
of the cluster port would: TLS without a client certificate, the agent's fingerprint in
``x-berth-client-fingerprint``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from berth.agent.identity import AgentIdentity
from berth.agent.registration import register_agent
from berth.cluster.leader.hub import NodeHub
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.listener import (
    ClusterListener,
    build_cluster_app,
    cluster_ssl_context,
    cluster_tls_files,
)
from berth.cluster.pki.ca import CertificateAuthority, fingerprint_of_pem
from berth.cluster.pki.enrollment import AuditLog, EnrollmentService
from berth.cluster.pki.peer_identity import (
    FORWARDED_FINGERPRINT_HEADER,
    ForwardedFingerprintTrust,
    parse_allow_list,
    parse_forwarded_fingerprint,
)
from berth.cluster.protocol.errors import CloseCode
from berth.cluster.protocol.frames import (
    PROTOCOL_MAX,
    PROTOCOL_MIN,
    Hello,
    Welcome,
    decode_frame,
    encode_frame,
)
from berth.cluster.protocol.payloads import Inventory
from berth.errors import ConfigError
from berth.paths import BerthHome
from berth.runtime.engines import find_free_port
from berth.store import Store
from support.leader_home import leader_home

LOOPBACK_ONLY = ForwardedFingerprintTrust(parse_allow_list("127.0.0.1"))
ELSEWHERE_ONLY = ForwardedFingerprintTrust(parse_allow_list("10.0.0.0/8, 192.0.2.7"))


@dataclass
class Leader:
    url: str
    ca: CertificateAuthority
    store: Store
    agents: dict[str, AgentIdentity]

    def fingerprint(self, label: str) -> str:
        return fingerprint_of_pem(self.agents[label].cert_path.read_bytes())

    def tls(self, label: str | None = None) -> ssl.SSLContext:
        """What a client trusts (the berth CA) and, with ``label``, the agent's certificate."""
        context = ssl.create_default_context(cadata=self.ca.cert_pem.decode())
        if label is not None:
            identity = self.agents[label]
            context.load_cert_chain(str(identity.cert_path), str(identity.key_path))
        return context


@contextlib.asynccontextmanager
async def running_leader(
    tmp_path: Path, forwarded: ForwardedFingerprintTrust | None
) -> AsyncIterator[Leader]:
    """A cluster listener with the real hub on loopback and two enrolled nodes."""
    made = leader_home(tmp_path)
    home, ca, store, sock, url = made.home, made.ca, made.store, made.sock, made.url
    enrollment = EnrollmentService(
        store=store, ca=ca, pepper=b"p" * 32, cluster_url=url, audit=AuditLog(home.audit_log)
    )
    hub = NodeHub(store, LinkRegistry(), forwarded=forwarded)
    app = build_cluster_app(
        enrollment=enrollment, ca_pem=ca.cert_pem, agent_handler=hub.handle_agent
    )
    listener = ClusterListener(
        app, sock, cluster_ssl_context(ca, *cluster_tls_files(ca, "127.0.0.1", home.ca_dir))
    )
    await listener.start()
    try:
        agents = {}
        for label in ("gpu-a", "gpu-b"):
            uri = enrollment.issue_token(label).uri
            agents[label] = await asyncio.to_thread(
                register_agent, uri, BerthHome(tmp_path / label)
            )
        yield Leader(url, ca, store, agents)
    finally:
        await hub.shutdown()
        await listener.stop()
        store.close()


@dataclass(frozen=True)
class Outcome:
    """What the leader answered a Hello with: the node it welcomed, or its close code."""

    node_id: str | None
    close_code: int | None
    reason: str = ""


async def dial(leader: Leader, tls: ssl.SSLContext, headers: dict[str, str]) -> Outcome:
    """Open the agent WebSocket, say Hello and read the leader's first answer."""
    hello = Hello(
        protocol_min=PROTOCOL_MIN,
        protocol_max=PROTOCOL_MAX,
        agent_version="0-test",
        inventory=Inventory(hostname="proxy-test"),
    )
    url = leader.url.replace("https://", "wss://") + "/cluster/agent"
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(url, ssl=tls, headers=headers, max_msg_size=0) as ws,
    ):
        await ws.send_bytes(encode_frame(hello))
        message = await ws.receive(timeout=15)
        if message.type is aiohttp.WSMsgType.BINARY:
            frame = decode_frame(message.data)
            assert isinstance(frame, Welcome), frame
            outcome = Outcome(frame.node_id, None)
        else:
            assert message.type is aiohttp.WSMsgType.CLOSE, message
            outcome = Outcome(None, ws.close_code, str(message.extra or ""))
    # aiohttp's advice: give SSL transports a moment to shut down before the loop closes.
    await asyncio.sleep(0.1)
    return outcome


def _forwarded(fingerprint: str) -> dict[str, str]:
    return {FORWARDED_FINGERPRINT_HEADER: fingerprint}


# -- on loopback, real TLS -----------------------------------------------------------------------


async def test_a_forwarded_fingerprint_from_an_allowed_proxy_is_that_node(tmp_path: Path) -> None:
    async with running_leader(tmp_path, LOOPBACK_ONLY) as leader:
        outcome = await dial(leader, leader.tls(), _forwarded(leader.fingerprint("gpu-a")))

        assert outcome.node_id == leader.agents["gpu-a"].node_id
        assert leader.store.get_node(outcome.node_id).agent_version == "0-test"


async def test_without_the_mode_the_header_is_refused_like_no_certificate(tmp_path: Path) -> None:
    async with running_leader(tmp_path, None) as leader:
        outcome = await dial(leader, leader.tls(), _forwarded(leader.fingerprint("gpu-a")))

        assert outcome.node_id is None
        assert outcome.close_code == CloseCode.BAD_CERTIFICATE
        assert "client certificate is required" in outcome.reason


async def test_the_header_from_a_peer_outside_the_allow_list_is_ignored(tmp_path: Path) -> None:
    async with running_leader(tmp_path, ELSEWHERE_ONLY) as leader:
        outcome = await dial(leader, leader.tls(), _forwarded(leader.fingerprint("gpu-a")))

        assert outcome.close_code == CloseCode.BAD_CERTIFICATE
        assert "client certificate is required" in outcome.reason


async def test_a_presented_certificate_wins_over_the_header(tmp_path: Path) -> None:
    async with running_leader(tmp_path, LOOPBACK_ONLY) as leader:
        # gpu-a's certificate, gpu-b's fingerprint in the header: the connection is gpu-a.
        outcome = await dial(leader, leader.tls("gpu-a"), _forwarded(leader.fingerprint("gpu-b")))

        assert outcome.node_id == leader.agents["gpu-a"].node_id


@pytest.mark.parametrize(
    ("header", "complaint"),
    [
        ("sha256:" + "0" * 64, "belongs to no node"),
        ("not-a-fingerprint", "client certificate is required"),
        ("", "client certificate is required"),
    ],
)
async def test_an_unknown_or_malformed_forwarded_fingerprint_is_refused(
    tmp_path: Path, header: str, complaint: str
) -> None:
    async with running_leader(tmp_path, LOOPBACK_ONLY) as leader:
        outcome = await dial(leader, leader.tls(), _forwarded(header))

        assert outcome.close_code == CloseCode.BAD_CERTIFICATE
        assert complaint in outcome.reason


async def test_a_removed_node_stays_out_through_a_proxy(tmp_path: Path) -> None:
    async with running_leader(tmp_path, LOOPBACK_ONLY) as leader:
        leader.store.remove_node(leader.agents["gpu-b"].node_id)

        outcome = await dial(leader, leader.tls(), _forwarded(leader.fingerprint("gpu-b")))

        assert outcome.close_code == CloseCode.NODE_REMOVED


# -- the pure parts ------------------------------------------------------------------------------

HEX = "ab" * 32


@pytest.mark.parametrize(
    "value",
    [
        f"sha256:{HEX}",
        HEX,
        HEX.upper(),
        ":".join([HEX[i : i + 2] for i in range(0, 64, 2)]).upper(),
        f"SHA256={HEX}",
        f"  {HEX}  ",
    ],
)
def test_forwarded_fingerprints_in_every_proxys_spelling(value: str) -> None:
    assert parse_forwarded_fingerprint(value) == f"sha256:{HEX}"


@pytest.mark.parametrize("value", ["", "sha1:" + "ab" * 20, "ab" * 20, HEX + "00", "zz" * 32])
def test_what_is_not_a_sha256_fingerprint(value: str) -> None:
    assert parse_forwarded_fingerprint(value) is None


def test_the_mode_is_off_unless_asked_and_trusts_loopback_by_default() -> None:
    assert ForwardedFingerprintTrust.from_env({}) is None
    assert ForwardedFingerprintTrust.from_env({"BERTH_TRUST_FORWARDED_FP": "0"}) is None
    trust = ForwardedFingerprintTrust.from_env({"BERTH_TRUST_FORWARDED_FP": "1"})
    assert trust is not None
    assert trust.allows("127.0.0.1")
    assert trust.allows("::ffff:127.0.0.1")  # an IPv4 peer on a dual-stack socket
    assert not trust.allows("127.0.0.2")
    assert not trust.allows(None)


def test_the_allow_list_takes_addresses_and_networks() -> None:
    trust = ForwardedFingerprintTrust.from_env(
        {"BERTH_TRUST_FORWARDED_FP": "yes", "BERTH_FORWARDED_ALLOW_IPS": "10.1.0.0/16, ::1"}
    )
    assert trust is not None
    assert trust.allows("10.1.200.3")
    assert trust.allows("::1")
    assert not trust.allows("10.2.0.1")
    assert not trust.allows("127.0.0.1")


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"BERTH_TRUST_FORWARDED_FP": "maybe"}, "BERTH_TRUST_FORWARDED_FP"),
        (
            {"BERTH_TRUST_FORWARDED_FP": "1", "BERTH_FORWARDED_ALLOW_IPS": "proxy.lan"},
            "BERTH_FORWARDED_ALLOW_IPS",
        ),
        (
            {"BERTH_TRUST_FORWARDED_FP": "1", "BERTH_FORWARDED_ALLOW_IPS": " , "},
            "BERTH_FORWARDED_ALLOW_IPS",
        ),
    ],
)
def test_bad_mode_settings_name_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        ForwardedFingerprintTrust.from_env(env)


@pytest.mark.slow
def test_the_daemon_refuses_to_start_with_a_bad_allow_list(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    env |= {"BERTH_TRUST_FORWARDED_FP": "1", "BERTH_FORWARDED_ALLOW_IPS": "not-an-ip"}
    result = subprocess.run(
        [sys.executable, "-m", "berth", "--home", str(tmp_path / "home"), "daemon", "start",
         "--public-port", str(find_free_port()), "--cluster-port", str(find_free_port())],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "BERTH_FORWARDED_ALLOW_IPS" in result.stderr
    assert not (tmp_path / "home" / "daemon.pid").exists()
