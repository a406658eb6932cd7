"""Failure detection in seconds, in process (issue 12): each mechanism on its own.

- a failed health probe takes a deployment out of routing at once, without a state change,
  and the next good probe puts it back; the failed state follows after the configured count;
- giving a deployment or a node up wakes the requests waiting on it for a first byte: they
  go to another candidate, and their exchange with the given-up engine is closed;
- a link on which nothing arrives for its timeout is dead at both ends, with its pending
  requests and streams ended; pings keep an idle link alive;
- the agent's dial gives up on a leader that accepts TCP and never answers.

``test_failover_netns.py`` measures the same across network namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from typer.testing import CliRunner

from berth.agent.dialer import AgentDialer, AgentStatus
from berth.agent.identity import AgentIdentity
from berth.cli.main import app
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.link.connection import LinkConnection
from berth.cluster.link.liveness import Liveness
from berth.cluster.link.tunnel_stream import TunnelStream
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.protocol.errors import CloseCode, LinkError
from berth.cluster.protocol.frames import Heartbeat, Hello, Request, StreamOpen
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.ops import NoArgs, Op
from berth.cluster.protocol.payloads import Inventory
from berth.cluster.protocol.session import Role
from berth.config import Settings
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.engine_http.request import EngineRequest
from berth.errors import ConfigError, EngineError, NotFoundError
from berth.gateway.dispatch import first_answer
from berth.gateway.proxy import OpenAIProxy
from berth.observability.metrics import ProxyMetrics
from berth.paths import BerthHome
from berth.routing.errors import EngineUnreachableError
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.routing.signals import SignalBoard
from berth.routing.waiting import GiveUp, WaitingAttempts
from berth.store import Store
from berth.vocab.policies import RestartPolicy
from berth.vocab.states import DeploymentState
from support.fakes import FakeLink, memory_socket_pair
from support.link_pair import DEPLOYMENT, Linked
from support.proxy_fixtures import sample, serve_asgi
from support.standin_engine import Reply, Stall, StandinEngine, chat_completion, json_reply
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

MODEL = "tiny"

pytestmark = pytest.mark.store_models((MODEL, "tiny.gguf"))


async def until(condition: Callable[[], object], what: str) -> None:
    """Wait for ``condition()`` (a guard against a hang, not a timing assertion)."""
    await wait_for_async(condition, EVENT_TIMEOUT_S, what)


# -- the suspect flag and the failed state -------------------------------------------------------


class CountingLink(FakeLink):
    """A FakeLink that counts probes and can fail them with an error of its own (a node that
    cannot say: its runtime or its link failed)."""

    def __init__(self) -> None:
        super().__init__()
        self.probes: dict[str, int] = {}
        self.probe_error: set[str] = set()

    async def probe(self, deployment_id: str, timeout_s: float = 5.0) -> Any:
        self.probes[deployment_id] = self.probes.get(deployment_id, 0) + 1
        if deployment_id in self.probe_error:
            raise EngineError("node local: the probe got no answer")
        return await super().probe(deployment_id, timeout_s)


@contextlib.asynccontextmanager
async def watched(
    store: Store, link: FakeLink, waiting: WaitingAttempts | None = None, *, probes_to_fail: int
) -> AsyncIterator[LifecycleManager]:
    manager = LifecycleManager(
        store,
        LinkRegistry([link]),
        health_timeout_s=5,
        stop_grace_s=1,
        watch_interval_s=0.02,
        probe_timeout_s=0.01,
        probes_to_fail=probes_to_fail,
        waiting=waiting,
    )
    await manager.start()
    try:
        yield manager
    finally:
        await manager.shutdown()


async def _two_ready(
    manager: LifecycleManager, restart_policy: RestartPolicy = "on-failure"
) -> tuple[str, str]:
    options = DeployOptions(MODEL, "llamacpp", "local", restart_policy=restart_policy)
    first = await manager.deploy(options)
    second = await manager.deploy(options)
    for record in (first, second):
        assert (await manager.wait_settled(record.id, 5)).state is DeploymentState.READY
    return first.id, second.id


def _routed(manager: LifecycleManager) -> set[str]:
    return {u.deployment_id for u in manager.candidates(MODEL)}


async def test_one_failed_probe_takes_a_deployment_out_of_routing_until_a_probe_answers(
    store: Store,
) -> None:
    link = CountingLink()
    async with watched(store, link, probes_to_fail=1000) as manager:
        hung, sound = await _two_ready(manager)
        assert _routed(manager) == {hung, sound}

        link.hung.add(hung)
        await until(lambda: _routed(manager) == {sound}, "the hung deployment left routing")
        # A flag in the ready table, not a state change per probe.
        assert store.get_deployment(hung).state is DeploymentState.READY

        link.hung.discard(hung)
        await until(lambda: _routed(manager) == {hung, sound}, "it came back on a good probe")

        # With every deployment suspect there is nowhere better: they are still routed to.
        link.hung.update({hung, sound})
        counted = dict(link.probes)

        def rounds() -> int:
            return min(link.probes.get(d, 0) - counted.get(d, 0) for d in (hung, sound))

        await until(lambda: rounds() > 2, "several rounds of failed probes")
        assert _routed(manager) == {hung, sound}


async def test_a_probe_the_node_cannot_answer_makes_it_suspect_without_failing_it(
    store: Store,
) -> None:
    link = CountingLink()
    async with watched(store, link, probes_to_fail=1) as manager:
        unknown, sound = await _two_ready(manager)
        link.probe_error.add(unknown)
        counted = link.probes.get(unknown, 0)
        await until(lambda: link.probes.get(unknown, 0) > counted + 3, "several unanswered probes")
        assert _routed(manager) == {sound}
        assert store.get_deployment(unknown).state is DeploymentState.READY  # not held against it
        link.probe_error.discard(unknown)
        await until(lambda: _routed(manager) == {unknown, sound}, "it came back")


async def test_waiting_requests_move_on_a_failed_probe_and_end_on_the_failed_state(
    store: Store,
) -> None:
    link = CountingLink()
    waiting = WaitingAttempts()
    async with watched(store, link, waiting, probes_to_fail=3) as manager:
        hung, _sound = await _two_ready(manager, restart_policy="never")
        upstream = next(u for u in manager.candidates(MODEL) if u.deployment_id == hung)
        # Two requests waiting on it for a first byte: one with another candidate to go to,
        # one without.
        movable = asyncio.create_task(asyncio.sleep(3600))
        stuck = asyncio.create_task(asyncio.sleep(3600))
        moving = waiting.add(upstream, movable, elsewhere=True)
        staying = waiting.add(upstream, stuck, elsewhere=False)

        link.hung.add(hung)
        await until(lambda: moving.given_up is not None, "the first failed probe woke one")
        assert moving.given_up is GiveUp.SUSPECT
        assert staying.given_up is None  # nowhere else to go: it keeps waiting

        await until(lambda: staying.given_up is not None, "the failed state woke the other")
        assert staying.given_up is GiveUp.FAILED
        for task in (movable, stuck):
            with pytest.raises(asyncio.CancelledError):
                await task
        await until(lambda: store.get_deployment(hung).state is DeploymentState.FAILED,
                    "the failed state, once its engine was stopped")  # fmt: skip
        failed = store.get_deployment(hung)
        assert "3 probes in a row" in (failed.failure_reason or "")


def test_a_probe_timeout_not_below_the_interval_is_refused(home: BerthHome) -> None:
    with pytest.raises(ConfigError, match=r"probe_timeout_s .* must be below probe_interval_s"):
        Settings.load(home, env={"BERTH_PROBE_TIMEOUT_S": "5", "BERTH_PROBE_INTERVAL_S": "5"})
    settings = Settings.load(home, env={})
    assert (settings.probe_interval_s, settings.probe_timeout_s, settings.probes_to_fail) == (
        5.0,
        2.0,
        3,
    )
    assert settings.link_timeout_s < 15


# -- giving up wakes the waiting requests --------------------------------------------------------

NODE_A = Upstream("http://a", "d-a", "n-a", MODEL)
NODE_B = Upstream("http://b", "d-b", "n-b", MODEL)


class Engines:
    """An ``attempt`` for :func:`first_answer`: each upstream's answer waits on a gate;
    records which attempts began and which were closed (cancelled) before answering."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Future[Any]] = {}
        self.begun: list[str] = []
        self.closed: list[str] = []

    def gate(self, upstream: Upstream) -> asyncio.Future[Any]:
        return self.gates.setdefault(
            upstream.deployment_id, asyncio.get_running_loop().create_future()
        )

    async def attempt(self, upstream: Upstream) -> Any:
        self.begun.append(upstream.deployment_id)
        try:
            return await self.gate(upstream)
        except asyncio.CancelledError:
            self.closed.append(upstream.deployment_id)
            raise


def _answer(name: str) -> Any:
    return SimpleNamespace(status=200, name=name, close=lambda: None)


async def _dispatch(
    plan: list[Upstream], engines: Engines, waiting: WaitingAttempts, signals: SignalBoard
) -> tuple[Upstream, Any]:
    return await first_answer(
        plan,
        engines.attempt,
        max_attempts=3,
        signals=signals,
        clock=lambda: 0.0,
        request_id="r-1",
        waiting=waiting,
    )


async def test_a_suspect_engine_s_waiting_request_goes_to_the_next_candidate() -> None:
    engines, waiting, signals = Engines(), WaitingAttempts(), SignalBoard()
    engines.gate(NODE_A).set_result(_answer("a"))
    request = asyncio.create_task(_dispatch([NODE_B, NODE_A], engines, waiting, signals))
    await until(lambda: engines.begun == ["d-b"], "the request waits on node b")
    assert waiting.give_up_deployment("d-b", GiveUp.SUSPECT, "failed a health probe") == 1
    chosen, answer = await request
    assert (chosen, answer.name) == (NODE_A, "a")
    assert engines.closed == ["d-b"]  # its exchange with the given-up engine was closed
    assert signals.in_flight("d-b") == 0 and signals.recently_failed("d-b")
    assert len(waiting) == 0


async def test_with_nowhere_else_to_go_a_request_keeps_waiting_on_a_suspect_engine() -> None:
    engines, waiting, signals = Engines(), WaitingAttempts(), SignalBoard()
    request = asyncio.create_task(_dispatch([NODE_B], engines, waiting, signals))
    await until(lambda: engines.begun == ["d-b"], "the request waits on node b")
    assert waiting.give_up_deployment("d-b", GiveUp.SUSPECT, "failed a health probe") == 0
    engines.gate(NODE_B).set_result(_answer("b, late but fine"))
    chosen, answer = await request
    assert (chosen, answer.name, engines.closed) == (NODE_B, "b, late but fine", [])


async def test_with_nowhere_else_to_go_a_failed_engine_s_request_ends_at_once() -> None:
    engines, waiting, signals = Engines(), WaitingAttempts(), SignalBoard()
    request = asyncio.create_task(_dispatch([NODE_B], engines, waiting, signals))
    await until(lambda: engines.begun == ["d-b"], "the request waits on node b")
    assert waiting.give_up_deployment("d-b", GiveUp.FAILED, "failed") == 1
    with pytest.raises(EngineUnreachableError, match="given up before answering"):
        await request
    assert engines.closed == ["d-b"] and signals.in_flight("d-b") == 0


async def test_a_lost_node_s_waiting_requests_go_elsewhere() -> None:
    link = FakeLink("n-b")
    links = LinkRegistry([link])
    router = Router(SimpleNamespace(), links=links)  # the resolver is not asked here
    engines, signals = Engines(), SignalBoard()
    engines.gate(NODE_A).set_result(_answer("a"))
    request = asyncio.create_task(_dispatch([NODE_B, NODE_A], engines, router.waiting, signals))
    await until(lambda: engines.begun == ["d-b"], "the request waits on node b")
    links.detach(link)  # what the hub does when the node's link is dead
    chosen, _answer_a = await request
    assert chosen == NODE_A and engines.closed == ["d-b"]


async def test_a_client_that_leaves_is_not_taken_for_a_give_up() -> None:
    engines, waiting, signals = Engines(), WaitingAttempts(), SignalBoard()
    request = asyncio.create_task(_dispatch([NODE_B, NODE_A], engines, waiting, signals))
    await until(lambda: engines.begun == ["d-b"], "the request waits on node b")
    request.cancel()  # what the proxy's disconnect watcher does
    with pytest.raises(asyncio.CancelledError):
        await request
    assert engines.begun == ["d-b"] and len(waiting) == 0


class TwoEngines:
    """A resolver with one deployment on each of two nodes."""

    def __init__(self, stalled: StandinEngine, healthy: StandinEngine) -> None:
        self.upstreams = [
            Upstream(stalled.base_url, "d-stalled", "n-stalled", MODEL),
            Upstream(healthy.base_url, "d-healthy", "n-healthy", MODEL),
        ]

    def candidates(self, model: str) -> list[Upstream]:
        if model != MODEL:
            raise NotFoundError("model", model)
        return list(self.upstreams)

    def models(self) -> list[str]:
        return [MODEL]


async def test_through_the_proxy_a_given_up_engine_s_exchange_is_closed_and_counted_once() -> None:
    async with (
        StandinEngine(Reply((Stall(60),))) as stalled,
        StandinEngine(json_reply(chat_completion("from the healthy one"))) as healthy,
    ):
        resolver = TwoEngines(stalled, healthy)
        router = Router(resolver)
        # The stalled engine ranks first, as a quiet node whose p95 is known would.
        router.signals.observe("d-stalled", 0.001)
        router.signals.observe("d-healthy", 5.0)
        metrics = ProxyMetrics()
        proxy = OpenAIProxy(resolver, metrics, router=router)
        await proxy.startup()
        try:
            async with serve_asgi(proxy) as url, httpx.AsyncClient(base_url=url) as client:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                asking = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                received = await stalled.wait_for_request(5.0)
                router.waiting.give_up_deployment("d-stalled", GiveUp.SUSPECT, "failed a probe")
                answer = await asking
                assert answer.status_code == 200
                assert "from the healthy one" in answer.text
                # The engine nobody waits for any more saw its client go away.
                await asyncio.wait_for(received.disconnected.wait(), 5)
        finally:
            await proxy.shutdown()
    served = "berth_proxy_requests_total"
    labels = {"model": MODEL, "status_class": "2xx"}
    assert sample(metrics, served, deployment="d-healthy", node="n-healthy", **labels) == 1
    for status_class in ("2xx", "4xx", "5xx"):
        assert sample(metrics, served, model=MODEL, deployment="d-stalled", node="n-stalled",
                      status_class=status_class) == 0  # fmt: skip


# -- the link's liveness -------------------------------------------------------------------------


GREETING = Hello(
    protocol_min=1, protocol_max=1, agent_version="test", inventory=Inventory(hostname="h")
)


async def _shake_hands(agent: LinkConnection, leader: LinkConnection) -> None:
    await asyncio.gather(
        agent.handshake(GREETING, timeout_s=5.0),
        leader.handshake(WelcomeTerms(node_id="n-1", leader_version="test"), timeout_s=5.0),
    )


class Quiet:
    """A link handler that serves nothing: an agent whose requests never get answered."""

    def on_heartbeat(self, conn: LinkConnection, heartbeat: Heartbeat) -> None:
        pass

    async def on_request(self, conn: LinkConnection, request: Request) -> None:
        await asyncio.sleep(3600)

    async def on_stream(self, conn: LinkConnection, stream: TunnelStream) -> None:
        await asyncio.sleep(3600)


async def test_pings_keep_an_idle_link_up_and_a_silent_one_is_dead_at_both_ends() -> None:
    agent_ws, leader_ws = memory_socket_pair()
    liveness = Liveness(timeout_s=0.3)
    lost: list[str] = []
    agent = LinkConnection(Role.AGENT, agent_ws, Quiet(), peer="leader", liveness=liveness)
    leader = LinkConnection(Role.LEADER, leader_ws, Quiet(), peer="n-1", liveness=liveness,
                            on_closed=lambda: lost.append("n-1"))  # fmt: skip
    await _shake_hands(agent, leader)
    runs = [asyncio.create_task(agent.run()), asyncio.create_task(leader.run())]
    # Idle for several timeouts: the pings (and their pongs) keep it alive.
    await until(lambda: agent_ws.pings_sent >= 6 and leader_ws.pings_sent >= 6,
                "pings from both ends")  # fmt: skip
    assert not agent.closed and not leader.closed

    # Something in flight when the peer goes silent: a control request, and a stream.
    asked = asyncio.create_task(leader.call(Op("engines", NoArgs, NoArgs), NoArgs(), 3600))
    stream = leader.open_stream(StreamOpen(kind="http", deployment_id=DEPLOYMENT, method="POST",
                                           target="/v1/x", end=True))  # fmt: skip
    agent_ws.silent = leader_ws.silent = True  # black-holed, both ways
    await asyncio.wait_for(asyncio.gather(*runs), 10)  # both ends end by themselves
    for conn in (agent, leader):
        assert conn.close_code == CloseCode.HEARTBEAT_TIMEOUT
        assert "nothing received" in conn.close_reason
    assert lost == ["n-1"]  # the hub's on_closed ran: the node is dropped from routing
    with pytest.raises(LinkError, match="lost"):
        await asked
    with pytest.raises(Exception, match="lost"):
        await stream.wait_head(None)


# -- the agent: withdrawn requests, the dial timeout ---------------------------------------------


async def test_an_exchange_the_leader_withdraws_before_its_head_is_closed_and_not_counted(
    linked: Linked,
) -> None:
    linked.engine.script(Reply((Stall(60),)))
    asking = asyncio.create_task(
        linked.link.open_http(
            DEPLOYMENT, EngineRequest("/v1/chat/completions", b"", [], b"{}"), 60.0
        )
    )
    received = await linked.engine.wait_for_request(5.0)
    asking.cancel()  # the leader gives the attempt up before any byte came back
    with pytest.raises(asyncio.CancelledError):
        await asking
    await asyncio.wait_for(received.disconnected.wait(), 5)  # the engine heard
    meter = linked.service.meter
    await until(lambda: meter.stats(DEPLOYMENT).in_flight == 0, "the relay ended")
    stats = meter.stats(DEPLOYMENT)
    assert (stats.requests_total, stats.errors_total) == (0, 0)  # counted by no one here


def _identity(tmp_path: Path, leader_url: str) -> AgentIdentity:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n-1")]))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "agent.crt", tmp_path / "agent.key"
    cert_path.write_bytes(ca.sign_csr(csr.public_bytes(serialization.Encoding.PEM), "n-1", 1))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return AgentIdentity(
        leader_url=leader_url,
        node_id="n-1",
        label="gpu-1",
        ca_fingerprint=ca.fingerprint_sha256,
        enrolled_at=datetime.now(UTC),
        cert_path=cert_path,
        key_path=key_path,
        ca_path=ca.cert_path,
    )


class NoRuntimes:
    """What the dialer asks of the agent's service before it dials."""

    async def check_runtimes(self) -> None:
        pass

    async def read_gpus(self) -> list[Any]:
        return []


async def test_a_dial_into_a_leader_that_never_answers_gives_up_within_its_timeout(
    tmp_path: Path, home: BerthHome
) -> None:
    # A socket that listens (the kernel completes TCP) but never says a word of TLS.
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        url = f"https://127.0.0.1:{silent.getsockname()[1]}"
        status = AgentStatus(url, "n-1", "gpu-1", path=home.agent_status_file)
        dialer = AgentDialer(
            _identity(tmp_path, url),
            NoRuntimes(),  # type: ignore[arg-type]
            status,
            backoff=lambda _attempt: 3600.0,
            dial_timeout_s=0.3,
        )
        running = asyncio.create_task(dialer.run())
        await until(lambda: "no answer within 0.3 s" in status.last_error, "the dial gave up")
        assert status.state == "backoff" and not status.connected
        assert '"connected": false' in home.agent_status_file.read_text()
        # What the operator sees meanwhile (the agent, this process, still runs).
        shown = CliRunner().invoke(app, ["--home", str(home.root), "agent", "status"])
        assert shown.exit_code == 0, shown.output
        first, *rest = shown.stdout.splitlines()
        assert first.startswith("agent   disconnected (backoff)"), shown.stdout
        assert any("no answer within 0.3 s" in line for line in rest), shown.stdout
        await dialer.stop()
        assert await asyncio.wait_for(running, 5) == 0
    finally:
        silent.close()
