"""The event-loop lag monitor: the histogram, the warning that names a blocking callback (on
asyncio's loop and on uvloop), and ``berth_event_loop_lag_seconds`` in the leader's
``/metrics`` for the leader itself and, carried in heartbeats over a real mTLS link, for an
agent labelled by its node id."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from berth.agent.core import AgentCore
from berth.agent.dialer import AgentDialer, AgentStatus
from berth.agent.identity import AgentIdentity
from berth.agent.registration import register_agent
from berth.agent.service import AgentService
from berth.cluster.leader.hub import NodeHub
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.leader.listener import (
    ClusterListener,
    build_cluster_app,
    cluster_ssl_context,
    cluster_tls_files,
)
from berth.cluster.pki.enrollment import AuditLog, EnrollmentService
from berth.cluster.protocol.errors import ProtocolError
from berth.cluster.protocol.frames import Heartbeat, decode_frame, encode_frame
from berth.cluster.protocol.payloads import LoopLag
from berth.eventloop import freeze_startup_objects
from berth.observability.cluster import LINGER_S, ClusterMetrics
from berth.observability.loop_lag import LAG_BUCKETS_S, LagHistogram, LoopLagMonitor
from berth.observability.metrics import ProxyMetrics
from berth.paths import BerthHome
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import StaticInventory
from berth.runtime.process import ProcessRuntime
from support.leader_home import leader_home
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}
MONITOR_LOG = "berth.observability.loop_lag"
#: How long the test callbacks block: well past the 50 ms threshold on a busy machine.
BLOCK_S = 0.25


def block_the_loop() -> None:
    time.sleep(BLOCK_S)  # the line a warning must name


BLOCKING_LINE = block_the_loop.__code__.co_firstlineno + 1


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    await wait_for_async(condition, EVENT_TIMEOUT_S, what)


def warnings_naming(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == MONITOR_LOG and r.levelno == logging.WARNING and text in r.getMessage()
    ]


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_blocking_callback_gets_one_warning_naming_it(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=MONITOR_LOG)
    monitor = LoopLagMonitor()

    async def main() -> None:
        monitor.start()
        try:
            await wait_for(lambda: monitor.histogram().count > 0, "a first tick")
            asyncio.get_running_loop().call_soon(block_the_loop)
            await wait_for(lambda: monitor.stalls >= 1, "the stall to be measured")
            await asyncio.sleep(0.1)  # a few ticks more: nothing else to report about it
        finally:
            monitor.stop()

    LOOPS[loop](main())

    named = warnings_naming(caplog, "by block_the_loop (")
    assert len(named) == 1, named
    assert f"tests/test_loop_lag.py:{BLOCKING_LINE})" in named[0]
    assert named[0].startswith("event loop blocked for ")


def test_a_blocking_coroutine_is_named_with_its_task(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=MONITOR_LOG)
    monitor = LoopLagMonitor()

    async def probe_like_work() -> None:
        await asyncio.sleep(0)
        block_the_loop()

    async def main() -> None:
        monitor.start()
        try:
            await wait_for(lambda: monitor.histogram().count > 0, "a first tick")
            await asyncio.create_task(probe_like_work(), name="the-blocker")
            await wait_for(lambda: monitor.stalls >= 1, "the stall to be measured")
        finally:
            monitor.stop()

    uvloop.run(main())

    (named,) = warnings_naming(caplog, "probe_like_work (")
    assert "in task 'the-blocker'" in named
    assert "at block_the_loop (" in named
    assert named.endswith(f"test_loop_lag.py:{BLOCKING_LINE})")
    # the short stack runs from the callback to the innermost frame
    assert named.index("\n  test_a_blocking_coroutine") < named.index("\n  block_the_loop")


def test_a_stall_with_a_full_garbage_collection_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=MONITOR_LOG)
    monitor = LoopLagMonitor()

    def collect_and_block() -> None:
        gc.collect()  # what a full collection of a big heap does by itself, at any line
        block_the_loop()

    async def main() -> None:
        monitor.start()
        try:
            await wait_for(lambda: monitor.histogram().count > 0, "a first tick")
            asyncio.get_running_loop().call_soon(collect_and_block)
            await wait_for(lambda: monitor.stalls >= 1, "the stall to be measured")
        finally:
            monitor.stop()

    uvloop.run(main())

    (named,) = warnings_naming(caplog, "collect_and_block (")
    assert "during a full garbage collection (generation 2)" in named


def test_freezing_the_start_up_heap_leaves_it_out_of_full_collections() -> None:
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_stall_is_counted_in_a_bucket_above_the_threshold() -> None:
    monitor = LoopLagMonitor()

    async def main() -> None:
        monitor.start()
        try:
            await wait_for(lambda: monitor.histogram().count > 0, "a first tick")
            asyncio.get_running_loop().call_soon(block_the_loop)
            await wait_for(lambda: monitor.stalls >= 1, "the stall to be measured")
        finally:
            monitor.stop()

    uvloop.run(main())

    histogram = monitor.histogram()
    assert histogram.bounds_s == LAG_BUCKETS_S
    assert len(histogram.counts) == len(LAG_BUCKETS_S) + 1
    above = [c for bound, c in zip((*LAG_BUCKETS_S, None), histogram.counts, strict=True)
             if bound is None or bound > 0.05]  # fmt: skip
    assert sum(above) >= 1
    assert histogram.sum_s >= BLOCK_S / 2
    cumulative = histogram.cumulative()
    assert cumulative[-1] == ("+Inf", float(histogram.count))
    assert [v for _, v in cumulative] == sorted(v for _, v in cumulative)


def test_a_stall_that_goes_on_is_reported_while_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=MONITOR_LOG)
    monitor = LoopLagMonitor(hang_warning_s=0.1)

    async def main() -> None:
        monitor.start()
        try:
            await wait_for(lambda: monitor.histogram().count > 0, "a first tick")
            asyncio.get_running_loop().call_soon(time.sleep, 4 * BLOCK_S)
            await wait_for(lambda: monitor.stalls >= 1, "the stall to be measured")
        finally:
            monitor.stop()

    uvloop.run(main())

    ongoing = warnings_naming(caplog, "and still is")
    assert len(ongoing) == 1, ongoing
    assert "has been blocked for" in ongoing[0]
    assert len(warnings_naming(caplog, "event loop blocked for")) == 1  # and once it ended


def test_repeated_stalls_of_one_callback_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=MONITOR_LOG)
    monitor = LoopLagMonitor(warn_interval_s=3600)

    async def main() -> None:
        monitor.start()
        try:
            await wait_for(lambda: monitor.histogram().count > 0, "a first tick")
            asyncio.get_running_loop().call_soon(block_the_loop)
            await wait_for(lambda: monitor.stalls >= 1, "the first stall")
            asyncio.get_running_loop().call_soon(block_the_loop)
            await wait_for(lambda: monitor.stalls >= 2, "the second stall")
        finally:
            monitor.stop()

    uvloop.run(main())

    assert monitor.stalls >= 2
    assert len(warnings_naming(caplog, "by block_the_loop (")) == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"interval_s": 0}, {"threshold_s": -1}, {"buckets_s": ()}, {"buckets_s": (0.1, 0.01)}],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LoopLagMonitor(**kwargs)


# -- /metrics ------------------------------------------------------------------------------------


def lag_families(text: str) -> dict[str, dict[str, float]]:
    """node -> {sample name suffix or le: value} of berth_event_loop_lag_seconds in ``text``."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "berth_event_loop_lag_seconds":
            continue
        assert family.type == "histogram"
        for sample in family.samples:
            node = out.setdefault(sample.labels["node"], {})
            if sample.name.endswith("_bucket"):
                node[sample.labels["le"]] = sample.value
            else:
                node[sample.name.rsplit("_", 1)[1]] = sample.value
    return out


async def test_the_leaders_own_lag_is_in_metrics_as_node_local() -> None:
    monitor = LoopLagMonitor()
    metrics = ProxyMetrics()
    ClusterMetrics(local_loop_lag=monitor.histogram).register(metrics.registry)
    monitor.start()
    try:
        await wait_for(lambda: monitor.histogram().count >= 3, "three ticks")
    finally:
        monitor.stop()

    body, _content_type = metrics.render()
    local = lag_families(body.decode())["local"]
    assert local["count"] >= 3
    assert local["+Inf"] == local["count"]
    assert {"0.001", "0.05", "1.0"} <= set(local)


def test_agent_lag_counts_from_the_first_report_and_survives_an_agent_restart() -> None:
    metrics = ClusterMetrics(clock=lambda: 1000.0)
    bounds = [0.001, 0.01]

    def beat(counts: list[int], sum_s: float) -> Heartbeat:
        return Heartbeat(sent_at=0.0, loop_lag=LoopLag(bounds_s=bounds, counts=counts, sum_s=sum_s))

    def node() -> LagHistogram:
        return dict(metrics.loop_lag())["n-1"]

    metrics.record_heartbeat("n-1", beat([100, 5, 1], 2.0))  # the agent's past: a baseline
    assert node().counts == (0, 0, 0)
    metrics.record_heartbeat("n-1", beat([150, 6, 1], 2.5))
    assert node().counts == (50, 1, 0) and node().sum_s == pytest.approx(0.5)
    metrics.record_heartbeat("n-1", beat([10, 0, 0], 0.1))  # the agent restarted
    assert node().counts == (60, 1, 0) and node().sum_s == pytest.approx(0.6)
    metrics.remove_node("n-1")  # its series stay a while, for a last scrape, then go
    assert [node for node, _ in metrics.loop_lag()] == ["n-1"]
    assert metrics.loop_lag(now=1000.0 + LINGER_S) == []


def test_a_malformed_lag_histogram_is_a_protocol_error() -> None:
    good = encode_frame(
        Heartbeat(sent_at=1.0, loop_lag=LoopLag(bounds_s=[0.01, 0.1], counts=[1, 2, 3]))
    )
    assert decode_frame(good) is not None
    for bad in (b'"counts":[1,2]', b'"counts":[1,-2,3]'):
        message = good.replace(b'"counts":[1,2,3]', bad)
        message = message[:6] + (len(message) - 10).to_bytes(4, "big") + message[10:]
        with pytest.raises(ProtocolError, match="loop_lag"):
            decode_frame(message)


# -- an agent's lag, over a real link ------------------------------------------------------------


@contextlib.asynccontextmanager
async def leader_with_agent(tmp_path: Path) -> AsyncIterator[tuple[ClusterMetrics, AgentIdentity]]:
    """A cluster listener and hub on loopback TLS (heartbeats every 0.1 s), the leader's
    metrics registry, and one enrolled agent's identity."""
    made = leader_home(tmp_path)
    home, ca, store, sock, url = made.home, made.ca, made.store, made.sock, made.url
    enrollment = EnrollmentService(
        store=store, ca=ca, pepper=b"p" * 32, cluster_url=url, audit=AuditLog(home.audit_log)
    )
    cluster_metrics = ClusterMetrics()
    hub = NodeHub(store, LinkRegistry(), heartbeat_interval_s=0.1, cluster_metrics=cluster_metrics)
    app = build_cluster_app(
        enrollment=enrollment, ca_pem=ca.cert_pem, agent_handler=hub.handle_agent
    )
    listener = ClusterListener(
        app, sock, cluster_ssl_context(ca, *cluster_tls_files(ca, "127.0.0.1", home.ca_dir))
    )
    await listener.start()
    try:
        uri = enrollment.issue_token("gpu-a").uri
        identity = await asyncio.to_thread(register_agent, uri, BerthHome(tmp_path / "agent"))
        yield cluster_metrics, identity
    finally:
        await hub.shutdown()
        await listener.stop()
        store.close()


async def test_an_agents_lag_reaches_the_leaders_metrics_labelled_by_node(tmp_path: Path) -> None:
    async with leader_with_agent(tmp_path) as (cluster_metrics, identity):
        metrics = ProxyMetrics()
        cluster_metrics.register(metrics.registry)
        monitor = LoopLagMonitor()
        core = AgentCore(
            ProcessRuntime(),
            EngineBinaries(llama_server=None, vllm=None, sglang_python="python3"),
            StaticInventory(),
            logs_dir=tmp_path / "logs",
        )
        service = AgentService(core, loop_lag=monitor.histogram)
        status = AgentStatus(identity.leader_url, identity.node_id, identity.label)
        dialer = AgentDialer(identity, service, status)
        monitor.start()
        running = asyncio.create_task(dialer.run())
        try:

            def agent_counts() -> float:
                body, _ = metrics.render()
                return lag_families(body.decode()).get(identity.node_id, {}).get("count", 0.0)

            # The first heartbeat is the baseline; later ones add what the agent measured.
            await wait_for(lambda: agent_counts() > 0, "the agent's lag in /metrics")
        finally:
            await dialer.stop()
            await running
            await service.close()
            monitor.stop()

    body, _ = metrics.render()
    agent = lag_families(body.decode())[identity.node_id]
    assert agent["+Inf"] == agent["count"] > 0
    assert set(agent) >= {str(float(b)) for b in LAG_BUCKETS_S}
