"""The proxy's Prometheus series, read back from their own registry."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client.parser import text_string_to_metric_families

from berth.observability.metrics import ProxyMetrics, Target, status_class
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState

T = Target("m", "d-1", "local")


def value(metrics: ProxyMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_a_finished_request_counts_once_with_its_timings_and_tokens() -> None:
    metrics = ProxyMetrics()
    metrics.request_started(T)
    assert value(metrics, "berth_proxy_in_flight_requests", **T._asdict()) == 1
    metrics.request_finished(
        T, status=200, duration_s=0.2, ttfb_s=0.01, prompt_tokens=5, completion_tokens=9
    )
    labels = {**T._asdict(), "status_class": "2xx"}
    assert value(metrics, "berth_proxy_in_flight_requests", **T._asdict()) == 0
    assert value(metrics, "berth_proxy_requests_total", **labels) == 1
    assert value(metrics, "berth_proxy_request_duration_seconds_sum", **labels) == 0.2
    assert value(metrics, "berth_proxy_time_to_first_byte_seconds_bucket", **labels, le="0.01") == 1
    assert value(metrics, "berth_proxy_prompt_tokens_total", **T._asdict()) == 5
    assert value(metrics, "berth_proxy_completion_tokens_total", **T._asdict()) == 9
    assert value(metrics, "berth_proxy_errors_total", **labels, reason="x") is None


def test_a_rejected_request_has_no_deployment_and_counts_as_an_error() -> None:
    metrics = ProxyMetrics()
    metrics.request_rejected(model="", status=404, duration_s=0.001, error_reason="model_not_found")
    labels = {"model": "", "deployment": "", "node": "", "status_class": "4xx"}
    assert value(metrics, "berth_proxy_requests_total", **labels) == 1
    assert value(metrics, "berth_proxy_errors_total", **labels, reason="model_not_found") == 1


def test_status_classes() -> None:
    assert [status_class(s) for s in (200, 299, 404, 499, 503)] == [
        "2xx",
        "2xx",
        "4xx",
        "4xx",
        "5xx",
    ]


def test_a_served_name_with_a_carriage_return_never_reaches_the_exposition_raw() -> None:
    # A name stored before the admin API checked served names (issue 38: a raw CR in
    # /metrics); the text format itself escapes only backslash, quote and newline.
    metrics = ProxyMetrics()
    metrics.set_deployment_state(
        "d-1", model="chat\rfake 1", node="local", state=DeploymentState.READY
    )
    metrics.deployment_restarted("d-1", model="chat\rfake 1", node="local", reason="exit")
    body, _ = metrics.render()
    assert b"\r" not in body
    assert b'model="chat\\\\rfake 1"' in body  # \r as text, its backslash escaped


def test_deployment_state_is_one_for_the_current_state_only() -> None:
    metrics = ProxyMetrics()
    metrics.set_deployment_state("d-1", model="m", node="local", state=DeploymentState.LOADING)
    metrics.set_deployment_state("d-1", model="m", node="local", state=DeploymentState.READY)
    states = {
        state.value: value(
            metrics,
            "berth_deployment_state",
            deployment="d-1",
            model="m",
            node="local",
            state=state.value,
        )
        for state in DeploymentState
    }
    assert states.pop("ready") == 1
    assert set(states.values()) == {0}


def test_a_stopped_deployment_keeps_its_series_for_the_linger_then_loses_them() -> None:
    now = [100.0]
    metrics = ProxyMetrics(linger_s=300.0, clock=lambda: now[0])
    other = Target("m", "d-2", "n-1")
    for target in (T, other):
        metrics.set_deployment_state(
            target.deployment, model="m", node=target.node, state=DeploymentState.READY
        )
        metrics.request_started(target)
        metrics.request_finished(target, status=502, duration_s=0.1, error_reason="engine_status")
    for state in (DeploymentState.STOPPING, DeploymentState.STOPPED):
        metrics.set_deployment_state("d-1", model="m", node="local", state=state)
    labels = {**T._asdict(), "status_class": "5xx"}
    now[0] += 299.0  # a scrape within the linger reads the final values
    assert value(metrics, "berth_proxy_requests_total", **labels) == 1
    assert value(metrics, "berth_deployment_state", **T._asdict(), state="stopped") == 1
    now[0] += 1.0
    body = metrics.render()[0].decode()
    assert 'deployment="d-1"' not in body, body
    assert value(metrics, "berth_proxy_requests_total", **other._asdict(), status_class="5xx") == 1
    assert value(metrics, "berth_deployment_state", **other._asdict(), state="ready") == 1


def test_a_stopped_deployment_with_a_request_in_flight_keeps_its_series_until_it_ends() -> None:
    now = [0.0]
    metrics = ProxyMetrics(linger_s=10.0, clock=lambda: now[0])
    metrics.set_deployment_state("d-1", model="m", node="local", state=DeploymentState.READY)
    metrics.request_started(T)
    metrics.set_deployment_state("d-1", model="m", node="local", state=DeploymentState.FAILED)
    now[0] = 60.0
    metrics.render()
    assert value(metrics, "berth_proxy_in_flight_requests", **T._asdict()) == 1
    metrics.request_finished(T, status=200, duration_s=60.0)  # the linger starts again
    now[0] = 69.0
    assert value(metrics, "berth_proxy_requests_total", **T._asdict(), status_class="2xx") == 1
    now[0] = 70.0
    assert b'deployment="d-1"' not in metrics.render()[0]


def test_restored_deployments_have_their_labels_and_states() -> None:
    metrics = ProxyMetrics()
    ready = _record("d-1", "n-1", "chat", DeploymentState.READY)
    stopped = _record("d-2", "n-1", "old", DeploymentState.STOPPED)
    metrics.restore([ready, stopped])
    labels = {"deployment": "d-1", "model": "chat", "node": "n-1"}
    assert value(metrics, "berth_deployment_state", **labels, state="ready") == 1
    assert value(metrics, "berth_deployment_state", **labels, state="loading") == 0
    assert metrics.deployment_model("d-1") == "chat"
    assert metrics.deployment_model("d-2") is None  # a stopped deployment gets no series
    assert b'deployment="d-2"' not in metrics.render()[0]


def _record(deployment: str, node: str, served: str, state: DeploymentState) -> DeploymentRecord:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    return DeploymentRecord(
        id=deployment, model_name="weights", engine="llamacpp", runtime="process",
        node_id=node, state=state, port=None, pid=None, gpus=(), ctx=None, extra_args=(),
        served_model_name=served, failure_reason=None, created_at=at, updated_at=at,
    )  # fmt: skip


def test_render_is_the_prometheus_text_format_with_berth_names_only() -> None:
    metrics = ProxyMetrics()
    metrics.set_deployment_state("d-1", model="m", node="local", state=DeploymentState.READY)
    metrics.request_started(T)
    metrics.request_finished(T, status=200, duration_s=0.1)
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    names = {family.name for family in text_string_to_metric_families(body.decode())}
    assert names and all(name.startswith("berth_") for name in names)
    assert "berth_deployment_state" in names


def test_a_retried_request_moves_to_the_deployment_that_served_it() -> None:
    from berth.observability.window import RequestMeter

    meter = RequestMeter()
    metrics = ProxyMetrics(local_meter=meter, local_node="local")
    remote = Target("m", "d-2", "n-1")
    metrics.request_started(T)
    assert meter.stats("d-1").in_flight == 1
    metrics.request_moved(T, remote)
    assert value(metrics, "berth_proxy_in_flight_requests", **T._asdict()) == 0
    assert value(metrics, "berth_proxy_in_flight_requests", **remote._asdict()) == 1
    assert meter.stats("d-1").in_flight == 0 and meter.stats("d-1").requests_total == 0
    metrics.request_finished(remote, status=200, duration_s=0.1)
    assert value(metrics, "berth_proxy_in_flight_requests", **remote._asdict()) == 0
