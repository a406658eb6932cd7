"""Helpers for the direct data path's tests (``test_direct_*.py``): a berth CA with a
leader's, an agent's and a stranger's certificates, an agent's ingress in front of a
stand-in engine, and a TCP relay that can be black-holed, all real TLS on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from berth.agent.ingress import AgentIngress
from berth.agent.service import AgentService
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.direct_tls import (
    ensure_leader_certificate,
    ingress_server_name,
    issue_ingress_certificate,
    leader_client_context,
)
from berth.cluster.protocol.ops import IngressArgs
from berth.engine_http.origin import Origin
from berth.engine_http.pool import UpstreamPool
from berth.runtime.engines import find_free_port
from support.link_pair import DEPLOYMENT, ENGINE_KEY, FakeCore
from support.standin_engine import StandinEngine

NODE_ID = "n-0d1ec7a1"
__all__ = ["DEPLOYMENT", "NODE_ID", "Ingress", "Pki", "Relay", "make_pki", "running_ingress"]


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass
class Pki:
    """A berth CA and what it issued: the leader's client certificate, an agent's client
    certificate (its key doubles as the ingress key) and that agent's ingress certificate."""

    root: Path
    ca: CertificateAuthority
    leader_cert: Path
    leader_key: Path
    agent_cert: Path
    agent_key: Path
    agent_cert_der: bytes
    node_id: str = NODE_ID

    @property
    def ca_dir(self) -> Path:
        return self.leader_cert.parent

    def another_agent(self, root: Path, node_id: str) -> Pki:
        """The same CA and leader, and a second agent (``node_id``, files in ``root``)."""
        cert, key, der = _agent_identity(self.ca, root, node_id)
        return Pki(root, self.ca, self.leader_cert, self.leader_key, cert, key, der, node_id)

    def ingress_args(self) -> IngressArgs:
        certificate = issue_ingress_certificate(self.ca, self.agent_cert_der, self.node_id)
        return IngressArgs(
            certificate=certificate.decode(), leader_certificate=self.leader_cert.read_text()
        )

    def leader_context(self) -> ssl.SSLContext:
        return leader_client_context(self.ca.cert_pem, self.leader_cert, self.leader_key)

    def client_context(self, cert: Path | None, key: Path | None) -> ssl.SSLContext:
        """A client context trusting the berth CA, presenting ``cert`` (``None``: none)."""
        context = ssl.create_default_context(cadata=self.ca.cert_pem.decode())
        if cert is not None and key is not None:
            context.load_cert_chain(str(cert), str(key))
        return context

    def pool(self, context: ssl.SSLContext | None = None) -> UpstreamPool:
        return UpstreamPool(
            connect_timeout_s=5.0,
            read_timeout_s=10.0,
            ssl_context=context or self.leader_context(),
            server_hostname=ingress_server_name(self.node_id),
        )


def make_pki(root: Path) -> Pki:
    ca = CertificateAuthority.load_or_create(root / "ca")
    leader_cert, leader_key = ensure_leader_certificate(ca, root / "ca")
    agent_cert, agent_key, der = _agent_identity(ca, root, NODE_ID)
    return Pki(root, ca, leader_cert, leader_key, agent_cert, agent_key, der)


def _agent_identity(ca: CertificateAuthority, root: Path, node_id: str) -> tuple[Path, Path, bytes]:
    """An agent's certificate for ``node_id`` and its key in ``root``; its DER form."""
    agent_key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ignored")]))
        .sign(agent_key, hashes.SHA256())
    )
    cert_pem = ca.sign_csr(csr.public_bytes(serialization.Encoding.PEM), node_id, days=30)
    root.mkdir(parents=True, exist_ok=True)
    (root / "agent.key").write_bytes(_key_pem(agent_key))
    (root / "agent.crt").write_bytes(cert_pem)
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return root / "agent.crt", root / "agent.key", der


def stranger_leader_certificate(root: Path) -> tuple[Path, Path]:
    """A certificate that names the leader (its URI SAN and all) from another berth CA."""
    other = CertificateAuthority.load_or_create(root / "other-ca")
    return ensure_leader_certificate(other, root / "other-ca")


@dataclass
class Ingress:
    """An agent's service and ingress in front of ``engine``; ``origin`` is where the
    leader dials it."""

    pki: Pki
    engine: StandinEngine
    service: AgentService
    ingress: AgentIngress
    origin: Origin


@contextlib.asynccontextmanager
async def running_ingress(
    pki: Pki,
    *,
    advertise_host: str = "127.0.0.1",
    bind_host: str = "127.0.0.1",
    configure: bool = True,
    advertise: bool = True,
    **limits: int,
) -> AsyncIterator[Ingress]:
    """The agent side: a stand-in engine (which wants :data:`ENGINE_KEY`, as the agent's
    relay sends it), an ``AgentService`` over :class:`FakeCore` and its ingress, bound on
    ``bind_host`` at a free port and advertised as ``advertise_host`` at that port, serving
    (``configure``) with certificates from ``pki``. Without ``advertise`` the service is an
    agent started without ``--advertise``: its Hello names no address and no ``op.ingress``."""
    async with StandinEngine(api_key=ENGINE_KEY) as engine:
        service = AgentService(FakeCore(engine.port), read_timeout_s=10.0)  # type: ignore[arg-type]
        port = find_free_port(bind_host)
        ingress = AgentIngress(
            node_id=pki.node_id,
            advertise=f"{advertise_host}:{port}",
            bind_host=bind_host,
            key_path=pki.agent_key,
            cert_path=pki.root / "ingress.crt",
            ca_certificate=pki.ca.certificate,
            relay=service.relay.relay_exchange,
            **limits,  # type: ignore[arg-type]
        )
        ingress.bind()
        if advertise:
            service.use_ingress(ingress)
        try:
            if configure:
                await ingress.configure(pki.ingress_args())
            yield Ingress(pki, engine, service, ingress, Origin(advertise_host, port))
        finally:
            await ingress.close()
            await service.close()


@dataclass
class Relay:
    """A TCP relay from ``listen`` to ``target`` that can stop passing bytes: ``blocked``
    holds every byte in both directions (a black hole: no reset, no close), like a
    firewall's DROP rule. ``accepted`` counts the connections it took (each one is one
    connection the ingress accepts) and ``ended`` has, for each in turn, an event set once
    the leader's side of it has closed; :meth:`cut` closes those open now, as a peer that
    breaks them off."""

    target: tuple[str, int]
    blocked: bool = False
    server: asyncio.Server | None = None
    accepted: int = 0
    ended: list[asyncio.Event] = field(default_factory=list)
    _pipes: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._serve, host, port)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    def cut(self) -> int:
        """Close every connection open now, both ways; how many were open."""
        writers, self._writers = self._writers, set()
        for writer in writers:
            writer.close()
        return len(writers) // 2

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        ended = asyncio.Event()
        self.ended.append(ended)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)
            if source is reader:  # the leader's side: its end is the connection's
                task.add_done_callback(lambda _task: ended.set())

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                while self.blocked:
                    await asyncio.sleep(0.01)
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.close()
            self._writers.discard(sink)
