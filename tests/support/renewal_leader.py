"""A leader's cluster listener and hub on loopback mutual TLS that issue short-lived agent
certificates and renew them over the link, and in-process agents dialing it for real
(:class:`~berth.agent.dialer.AgentDialer` over a :class:`~support.link_pair.FakeCore`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from berth.agent.dialer import AgentDialer, AgentStatus
from berth.agent.host import RuntimeStatus
from berth.agent.identity import AgentIdentity
from berth.agent.registration import register_agent
from berth.agent.service import AgentService
from berth.cluster.leader.dial_limit import DialRateLimiter
from berth.cluster.leader.hub import NodeHub
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.listener import (
    ClusterListener,
    build_cluster_app,
    cluster_ssl_context,
    cluster_tls_files,
)
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.enrollment import AuditLog, EnrollmentService
from berth.cluster.pki.renewal import LinkCertificates
from berth.http_server.tls_reload import ReloadingTLS
from berth.paths import BerthHome
from berth.store import Store
from support.leader_home import leader_home
from support.link_pair import FakeCore


@dataclass
class RenewingLeader:
    """The leader's parts a test drives: ``tls`` is the cluster listener's reloading pair
    (reload it after a CA rotation, as the daemon does when the files change)."""

    hub: NodeHub
    store: Store
    enrollment: EnrollmentService
    home: BerthHome
    ca: CertificateAuthority
    tls: ReloadingTLS


@contextlib.asynccontextmanager
async def renewing_leader(
    tmp_path: Path, lifetime_s: float, dial_limiter: DialRateLimiter | None = None
) -> AsyncIterator[RenewingLeader]:
    """A cluster listener and hub that issue certificates of ``lifetime_s`` seconds."""
    made = leader_home(tmp_path)
    home, ca, store, sock, url = made.home, made.ca, made.store, made.sock, made.url
    audit = AuditLog(home.audit_log)
    enrollment = EnrollmentService(
        store=store, ca=ca, pepper=b"p" * 32, cluster_url=url, audit=audit,
        cert_lifetime_s=lifetime_s,
    )  # fmt: skip
    certificates = LinkCertificates(store, ca, lifetime_s=lifetime_s, audit=audit)
    hub = NodeHub(
        store,
        LinkRegistry(),
        heartbeat_interval_s=0.5,
        certificates=certificates,
        dial_limiter=dial_limiter,
    )
    app = build_cluster_app(
        enrollment=enrollment, ca_pem=lambda: ca.server_root_pem, agent_handler=hub.handle_agent
    )
    files = cluster_tls_files(ca, "127.0.0.1", home.ca_dir)
    tls = ReloadingTLS.load("cluster", *files, lambda c, k: cluster_ssl_context(ca, c, k))
    listener = ClusterListener(app, sock, tls.context)
    await listener.start()
    try:
        yield RenewingLeader(hub, store, enrollment, home, ca, tls)
    finally:
        await hub.shutdown()
        await listener.stop()
        store.close()


async def enroll(leader: RenewingLeader, tmp_path: Path, label: str) -> AgentIdentity:
    """Enroll ``label`` and register its agent (home ``tmp_path / label``)."""
    uri = leader.enrollment.issue_token(label).uri
    return await asyncio.to_thread(register_agent, uri, BerthHome(tmp_path / label))


class DialingCore(FakeCore):
    """The fake core, with what the dial loop asks before each dial."""

    async def runtime_status(self) -> list[RuntimeStatus]:
        return [RuntimeStatus("process", True, "")]

    async def retry_unresolved(self) -> list[str]:
        return []


def agent_for(identity: AgentIdentity, core: FakeCore, *, renew: bool) -> AgentDialer:
    """A real dial loop for ``identity`` over ``core``, its status in its home."""
    service = AgentService(core, read_timeout_s=30.0)  # type: ignore[arg-type]
    home = BerthHome(identity.cert_path.parent)
    status = AgentStatus(
        identity.leader_url, identity.node_id, identity.label, path=home.agent_status_file
    )
    return AgentDialer(identity, service, status, renew=renew)
