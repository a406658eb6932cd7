"""The admin API's node routes: enrollment tokens, the node registry, removal.

- ``POST /admin/nodes/enroll`` ``{"label"}`` → ``{"uri", "expires_at", "label"}``;
- ``GET /admin/nodes``: every node not removed, ``local`` first;
- ``GET /admin/nodes/{id-or-label}``: one node with its CPUs, memory, GPUs, capabilities;
- ``DELETE /admin/nodes/{id-or-label}``: mark it removed and drop its live link
  (``local`` → 409).

Each node says whether it is cordoned or drained (``maintenance``; the routes that change
it are in :mod:`berth.admin.drains`).

Node ``local`` reports live figures from the in-process agent core; other nodes what their
agent last said (Hello, heartbeats).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import msgspec
from fastapi import APIRouter

from berth import __version__
from berth.admin.drains import maintenance_view
from berth.admin.roles import needs
from berth.api import (
    AdoptedEndpoint,
    EnrollIn,
    EnrollmentIssued,
    Gpu,
    NodeDetail,
    NodeDetailWithAdopted,
    NodeMaintenance,
    NodeSummary,
)
from berth.api.nodes import AgentPolicyView, DataPathName
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.cluster.leader.direct_path import DataPath, DataPaths
from berth.cluster.leader.hub import NodeHub
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.pki.enrollment import EnrollmentService
from berth.cluster.protocol.payloads import AdoptedState, policy_state
from berth.deployments.drain import DrainRunner
from berth.deployments.lifecycle import LifecycleManager
from berth.store import Store
from berth.vocab.agent_policy import AgentPolicy
from berth.vocab.records import NodeCertificate, NodeHardware, NodeRecord
from berth.vocab.roles import Role


async def _live(links: LinkRegistry, record: NodeRecord) -> NodeRecord:
    """``local`` with the in-process core's figures; other nodes as stored."""
    link = links.get(LOCAL_NODE_ID)
    if record.id != LOCAL_NODE_ID or link is None:
        return record
    inventory = await link.inventory()
    hardware = NodeHardware(
        hostname=inventory.hostname,
        cpu_count=inventory.cpu_count,
        memory_total_mb=inventory.memory_total_mb,
        gpus=inventory.gpus,
    )
    return replace(
        record, inventory=hardware, agent_version=__version__, last_heartbeat_at=time.time()
    )


#: What the admin API says of node ``local``'s data path.
LOCAL_PATH = DataPath("direct", "the leader's own engines, on its host", "", 0.0)


def node_summary_view(
    record: NodeRecord,
    *,
    connected: bool,
    path: DataPath | None = None,
    certificate: NodeCertificate | None = None,
    renewal_error: str | None = None,
    maintenance: NodeMaintenance | None = None,
) -> NodeSummary:
    """One row of ``GET /admin/nodes``; ``path`` is the node's data path now (``None``:
    not connected), ``certificate`` its current client certificate, ``renewal_error`` why
    its last renewal was refused, ``maintenance`` its cordon and drain (``None``: none)."""
    inventory = record.inventory
    path_name: DataPathName | None = None
    if path is LOCAL_PATH:
        path_name = "local"
    elif path is not None:
        path_name = path.path
    return NodeSummary(
        id=record.id,
        label=record.label,
        status=record.status,
        connected=connected,
        hostname=inventory.hostname if inventory else None,
        gpu_count=len(inventory.gpus) if inventory else 0,
        vram_total_mb=inventory.vram_total_mb if inventory else 0,
        agent_version=record.agent_version,
        last_heartbeat_at=record.last_heartbeat_at,
        data_path=path_name,
        data_path_reason=path.reason if path is not None else None,
        cert_not_after=certificate.not_after if certificate is not None else None,
        cert_renewal_error=renewal_error,
        maintenance=maintenance,
    )


def node_detail_view(
    record: NodeRecord,
    *,
    connected: bool,
    path: DataPath | None = None,
    maintenance: NodeMaintenance | None = None,
) -> NodeDetail:
    """``GET /admin/nodes/{id}``: the summary plus hardware, capabilities and versions."""
    inventory = record.inventory
    gpus = [
        Gpu(
            index=gpu.index,
            name=gpu.name,
            uuid=gpu.uuid,
            memory_total_mb=gpu.memory_total_mb,
            memory_used_mb=gpu.memory_used_mb,
            utilization_pct=gpu.utilization_pct,
        )
        for gpu in (inventory.gpus if inventory else ())
    ]
    summary = node_summary_view(record, connected=connected, path=path, maintenance=maintenance)
    return summary.extended(
        NodeDetail,
        advertised_address=(path.advertise or None) if path is not None else None,
        data_path_since=path.since if path is not None and path is not LOCAL_PATH else None,
        cpu_count=inventory.cpu_count if inventory else None,
        memory_total_mb=inventory.memory_total_mb if inventory else None,
        gpus=gpus,
        capabilities=list(record.capabilities),
        protocol_version=record.protocol_version,
        cert_fingerprint=record.cert_fingerprint,
        created_at=record.created_at,
    )


def policy_view(policy: AgentPolicy) -> AgentPolicyView:
    """A node's reported agent policy as the API shows it: its wire form and its summary."""
    return AgentPolicyView(
        **msgspec.structs.asdict(policy_state(policy)),
        summary=policy.summary(),
    )


def adopted_view(state: AdoptedState) -> AdoptedEndpoint:
    """An adopted server as its node last reported it."""
    return AdoptedEndpoint(
        name=state.name,
        served_model_name=state.served_model_name,
        engine_model=state.engine_model,
        host=state.host,
        port=state.port,
        gpus=list(state.gpus),
        vram_mb=state.vram_mb,
        alive=state.alive,
    )


def build_node_router(
    store: Store,
    hub: NodeHub,
    links: LinkRegistry,
    data_paths: DataPaths,
    enrollment: EnrollmentService,
    lifecycle: LifecycleManager,
    drains: DrainRunner | None,
    *,
    leader_only: bool,
) -> APIRouter:
    """The node routes over the store's registry; ``hub`` holds the agents' links (and
    drops a removed node's), ``links`` node ``local``'s, ``data_paths`` each agent's way in,
    ``enrollment`` issues tokens and ``lifecycle`` knows the adopted endpoints (and hears of
    a removal); ``drains`` has each drain's last plan on this leader (``None``: it runs none).
    With ``leader_only`` node ``local`` is not listed."""
    router = APIRouter()

    def connected(record: NodeRecord) -> bool:
        if record.id == LOCAL_NODE_ID:
            return not leader_only
        return hub.is_connected(record.id)

    async def maintenance() -> dict[str, NodeMaintenance]:
        cordons = await asyncio.to_thread(store.node_drains)
        plans = drains.plans if drains is not None else {}
        return {d.node_id: maintenance_view(d, plans.get(d.node_id)) for d in cordons}

    def path(record: NodeRecord) -> DataPath | None:
        if record.id == LOCAL_NODE_ID:
            return None if leader_only else LOCAL_PATH
        if not hub.is_connected(record.id):
            return None
        return data_paths.data_path(record.id)

    @router.post("/admin/nodes/enroll", status_code=201, dependencies=[needs(Role.ADMIN)])
    async def enroll(body: EnrollIn) -> EnrollmentIssued:
        issued = await asyncio.to_thread(enrollment.issue_token, body.label)
        return EnrollmentIssued(
            uri=str(issued.uri), expires_at=issued.expires_at, label=issued.label
        )

    @router.get("/admin/nodes", dependencies=[needs(Role.VIEWER)])
    async def list_nodes() -> list[NodeSummary]:
        records = await asyncio.to_thread(store.list_nodes)
        certificates = await asyncio.to_thread(store.current_node_certificates)
        refusals = hub.renewal_refusals
        cordoned = await maintenance()
        if leader_only:  # no engines on the leader's host: node local is not one
            records = [r for r in records if r.id != LOCAL_NODE_ID]
        return [
            node_summary_view(
                await _live(links, r),
                connected=connected(r),
                path=path(r),
                certificate=certificates.get(r.id),
                renewal_error=refusals.get(r.id),
                maintenance=cordoned.get(r.id),
            )
            for r in records
        ]

    @router.get("/admin/nodes/{ident}", dependencies=[needs(Role.VIEWER)])
    async def show_node(ident: str) -> NodeDetailWithAdopted:
        record = await asyncio.to_thread(store.lookup_node, ident)
        detail = node_detail_view(
            await _live(links, record),
            connected=connected(record),
            path=path(record),
            maintenance=(await maintenance()).get(record.id),
        )
        adopted = lifecycle.adopted().get(record.id, [])
        link = links.get(record.id) if connected(record) else None
        policy = link.agent_policy if link is not None else None
        return detail.extended(
            NodeDetailWithAdopted,
            adopted=[adopted_view(state) for state in adopted],
            policy=policy_view(policy) if policy is not None else None,
        )

    @router.delete("/admin/nodes/{ident}", dependencies=[needs(Role.ADMIN)])
    async def remove_node(ident: str) -> NodeDetail:
        record = await asyncio.to_thread(store.lookup_node, ident)
        removed = await asyncio.to_thread(store.remove_node, record.id)
        await hub.disconnect_node(record.id)
        await lifecycle.node_removed(record.id)
        return node_detail_view(removed, connected=False)

    return router
