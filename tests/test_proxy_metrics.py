"""The proxy's Prometheus series, read back from their own registry."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from berth.observability.metrics import ProxyMetrics, Target, status_class
from berth.store.states import DeploymentState

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


def test_a_removed_deployment_leaves_no_state_series() -> None:
    metrics = ProxyMetrics()
    metrics.set_deployment_state("d-1", model="m", node="local", state=DeploymentState.READY)
    metrics.remove_deployment("d-1")
    metrics.remove_deployment("d-1")  # twice is harmless
    body, _ = metrics.render()
    assert b'deployment="d-1"' not in body


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
