"""The scaling decisions as pure functions: durations as people type them, the settings'
checks, an engine's slots, and what the controller does about a service at one moment."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from berth.admission import gate_slots
from berth.errors import ConfigError
from berth.humanize import duration, parse_duration
from berth.scaling.capacity import replica_capacity
from berth.scaling.decisions import (
    Hold,
    Replica,
    ServiceLoad,
    Start,
    Stop,
    busy_since,
    decide,
    saturated,
)
from berth.store.services import check_scaling
from berth.vocab.records import ScalingSettings, ServiceProfileRecord
from berth.vocab.states import DeploymentState

READY = DeploymentState.READY
LOADING = DeploymentState.LOADING
PENDING = DeploymentState.PENDING
STOPPING = DeploymentState.STOPPING

# -- durations ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("10m", 600.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1h30m", 5400.0),
        ("500ms", 0.5),
        ("90", 90.0),
        ("2.5", 2.5),
        (" 10M ", 600.0),
        ("0s", 0.0),
    ],
)
def test_durations_parse(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "  ", "10 min", "-5s", "abc", "10x", "inf", "1h 30m", "m"])
def test_a_duration_that_does_not_parse_is_refused_naming_the_form(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a duration: use a number and a unit, e\.g\. 30s"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (45, "45s"), (600, "10m"), (5400, "1h30m"), (2.5, "2.5s")]
)
def test_durations_print_in_the_form_they_parse_back_from(seconds: float, text: str) -> None:
    assert duration(seconds) == text
    assert parse_duration(text) == seconds


# -- the settings' checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (ScalingSettings(min_replicas=-1), "replica counts must not be negative (min -1, max 1)"),
        (ScalingSettings(max_replicas=-2), "replica counts must not be negative (min 0, max -2)"),
        (ScalingSettings(min_replicas=3, max_replicas=2), "min_replicas (3) is above max_replicas"),
        (ScalingSettings(idle_timeout_s=-1.0), "the idle timeout must be a positive number"),
        (ScalingSettings(idle_timeout_s=math.nan), "the idle timeout must be a positive number"),
        (ScalingSettings(capacity=0), "capacity must be at least 1 request per replica"),
        (ScalingSettings(priority=2**31), "priority must fit in 32 bits"),
    ],
)
def test_invalid_scaling_settings_are_refused_with_the_reason(
    settings: ScalingSettings, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_scaling(settings)


def test_valid_settings_pass_unchanged() -> None:
    settings = ScalingSettings(0, 0, 600.0, True, -3, 2)  # max 0: berth starts none
    assert check_scaling(settings) is settings


# -- an engine's slots ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "args", "slots"),
    [
        ("llamacpp", (), 4),  # llama-server's --parallel -1 ("auto") is 4 slots
        ("llamacpp", ("-np", "8"), 8),
        ("llamacpp", ("--parallel=2",), 2),
        ("llamacpp", ("--parallel", "-1"), 4),
        ("llamacpp", ("-np", "2", "--parallel", "6"), 6),  # the last one wins
        ("llamacpp", ("--parallel", "lots"), 4),  # not a number: the default
        ("llamacpp", ("--ctx-size", "512"), 4),
        ("vllm", (), 256),
        ("vllm", ("--max-num-seqs", "64"), 64),
        ("sglang", (), 8),
        ("sglang", ("--max-running-requests", "32"), 32),
    ],
)
def test_a_replicas_capacity_is_its_engines_slots_from_its_arguments(
    engine: str, args: tuple[str, ...], slots: int
) -> None:
    assert replica_capacity(service(engine, args)) == slots


def test_a_services_capacity_setting_wins_over_its_engines_slots() -> None:
    assert replica_capacity(service("vllm", ("--max-num-seqs", "64"), capacity=3)) == 3


def test_an_engine_that_does_not_say_takes_the_default_slots_setting_as_the_gate_does() -> None:
    # Scaling counts a replica full at the number the fair admission gate holds it to.
    assert replica_capacity(service("sglang", ()), default_slots=3) == 3
    assert replica_capacity(service("llamacpp", ()), default_slots=3) == 4
    assert gate_slots("sglang", (), default_slots=3).slots == 3


def service(
    engine: str, args: tuple[str, ...], capacity: int | None = None
) -> ServiceProfileRecord:
    return ServiceProfileRecord(
        "svc", "m", engine, "process", (), None, args, None, None, datetime(2026, 1, 1, tzinfo=UTC),
        ScalingSettings(capacity=capacity),
    )  # fmt: skip


# -- decisions -------------------------------------------------------------------------------------

NOW = 10_000.0


def ready(
    name: str,
    *,
    in_flight: int = 0,
    since: float = 0.0,
    last: float | None = None,
    routable: bool = True,
) -> Replica:
    return Replica(name, "gpu-a", READY, in_flight, since, last, routable)


def load(
    *replicas: Replica,
    queued: int = 0,
    busy: float | None = None,
    capacity: int = 4,
    **settings: object,
) -> ServiceLoad:
    return ServiceLoad("chat", ScalingSettings(**settings), capacity, replicas, queued, busy)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        pytest.param(
            load(min_replicas=2, max_replicas=3, idle_timeout_s=60.0),
            Start("min_replicas", "0 replica(s) running, below min_replicas 2"),
            id="below-min",
        ),
        pytest.param(
            load(queued=3),
            Start("on_demand", "on demand: 3 request(s) wait and none is ready"),
            id="on-demand",
        ),
        pytest.param(
            load(
                Replica("d-1", "gpu-a", DeploymentState.RESTARTING),
                queued=3,
                min_replicas=1,
            ),
            Hold("3 request(s) wait for d-1 to restart (max_replicas 1)"),
            id="restarting-counts-as-a-replica",
        ),
        pytest.param(
            load(queued=3, max_replicas=0),
            Hold("3 request(s) wait, but max_replicas is 0: none started"),
            id="on-demand-max-0",
        ),
        pytest.param(
            load(ready("d-1", routable=False), queued=1),
            Hold(
                "1 request(s) wait; every replica is on an unreachable node and max_replicas is 1"
            ),
            id="on-demand-replica-unreachable",
        ),
        pytest.param(
            load(Replica("d-1", "gpu-a", LOADING), queued=5),
            Hold("d-1 starting (0 ready; min 0, max 1)"),
            id="one-start-at-a-time",
        ),
        pytest.param(
            load(
                ready("d-1", in_flight=4),
                ready("d-2", in_flight=3),
                queued=1,
                busy=NOW - 20,
                max_replicas=3,
            ),
            Start(
                "scale_out",
                "every replica had its capacity (4) in flight or queued for 20s: "
                "7 in flight, 1 queued over 2 replica(s)",
            ),
            id="scale-out",
        ),
        pytest.param(
            load(ready("d-1", in_flight=4), busy=NOW - 5, max_replicas=3),
            Hold(
                "every replica had its capacity (4) in flight or queued for 5s: 4 in flight, "
                "0 queued over 1 replica(s); another starts after 15s"
            ),
            id="busy-not-long-enough",
        ),
        pytest.param(
            load(ready("d-1", in_flight=9), busy=NOW - 60, max_replicas=1),
            Hold(
                "every replica had its capacity (4) in flight or queued for 1m: 9 in flight, "
                "0 queued over 1 replica(s); at max_replicas 1"
            ),
            id="busy-at-max",
        ),
        pytest.param(
            load(ready("d-1", since=NOW - 700), idle_timeout_s=600.0),
            Stop(
                "idle",
                ("d-1",),
                "no request for 11m40s (idle timeout 10m); 0 left (min_replicas 0)",
            ),
            id="idle-since-ready",
        ),
        pytest.param(
            load(ready("d-1", since=NOW - 700, last=NOW - 100), idle_timeout_s=600.0),
            Hold("1 ready, 0 starting (min 0, max 1; idle timeout 10m)"),
            id="a-recent-request-keeps-it",
        ),
        pytest.param(
            load(ready("d-1", since=NOW - 700), idle_timeout_s=600.0, min_replicas=1),
            Hold("1 ready, 0 starting (min 1, max 1; idle timeout 10m)"),
            id="idle-at-min",
        ),
        pytest.param(
            load(ready("d-1", since=NOW - 700, in_flight=1), idle_timeout_s=600.0),
            Hold("1 ready, 0 starting (min 0, max 1; idle timeout 10m)"),
            id="idle-but-in-flight",
        ),
        pytest.param(
            load(ready("d-1", since=NOW - 7 * 86400)),
            Hold("1 ready, 0 starting (min 0, max 1; never stopped for idleness)"),
            id="no-idle-timeout",
        ),
        pytest.param(
            load(
                ready("d-old", since=NOW - 900),
                ready("d-new", since=NOW - 800),
                ready("d-busy", since=NOW - 1000, in_flight=1),
                idle_timeout_s=600.0,
                min_replicas=1,
                max_replicas=3,
            ),
            Stop(
                "idle",
                ("d-old", "d-new"),
                "no request for 15m (idle timeout 10m); 1 left (min_replicas 1)",
            ),
            id="idle-ones-go-least-recently-used-first-down-to-min",
        ),
        pytest.param(
            load(
                ready("d-1", since=NOW - 7 * 86400),
                ready("d-2", last=NOW - 1, in_flight=2),
                Replica("d-3", "gpu-b", LOADING),
                max_replicas=1,
            ),
            Stop("above_max", ("d-3", "d-1"), "3 replica(s), above max_replicas 1"),
            id="above-max-starting-then-least-recently-used",
        ),
        pytest.param(
            load(ready("d-1", in_flight=2), max_replicas=0),
            Hold(
                "1 replica(s), above max_replicas 0: waiting for requests to finish on d-1 "
                "(2 in flight)"
            ),
            id="above-max-but-busy",
        ),
        pytest.param(
            load(Replica("d-1", "gpu-a", STOPPING), queued=2),
            Start("on_demand", "on demand: 2 request(s) wait and none is ready"),
            id="a-stopping-replica-does-not-count",
        ),
    ],
)
def test_decide(service: ServiceLoad, expected: Start | Stop | Hold) -> None:
    assert decide(service, NOW, scale_out_after_s=15.0) == expected


@pytest.mark.parametrize(
    ("replicas", "queued", "expected"),
    [
        ((), 10, False),  # nothing ready: an on-demand start, not a scale-out
        ((ready("a", in_flight=4),), 0, True),
        ((ready("a", in_flight=3),), 0, False),
        ((ready("a", in_flight=3),), 1, True),  # the one free slot is taken by the queue
        ((ready("a", in_flight=4), ready("b", in_flight=0)), 3, False),
        ((ready("a", in_flight=6), ready("b", in_flight=2)), 2, True),
        ((ready("a", in_flight=4), ready("b", routable=False)), 0, True),
    ],
)
def test_saturated_means_every_free_slot_is_taken_by_the_queue(
    replicas: tuple[Replica, ...], queued: int, expected: bool
) -> None:
    assert saturated(load(*replicas, queued=queued)) is expected


def test_busy_since_runs_while_saturated_and_resets_when_not() -> None:
    busy = load(ready("a", in_flight=4))
    assert busy_since(busy, NOW) == NOW
    assert busy_since(load(ready("a", in_flight=4), busy=NOW - 30), NOW) == NOW - 30
    assert busy_since(load(ready("a", in_flight=1), busy=NOW - 30), NOW) is None
