"""The routing rules at their edges, pure: the signal board's counts, windows and demotions, the
scorer's buckets, boundaries and reasons, affinity keys and the map, the router's plan and
explanation, and what the proxy's errors carry. Written to kill the mutants that
``mutmut run`` (docs/testing.md) found surviving the tests of ``test_routing.py``."""

from __future__ import annotations

import hashlib
import math

import pytest

from berth.cluster.leader.link_registry import LinkRegistry
from berth.routing.affinity import API_KEY_PREFIX, AffinityMap, affinity_key
from berth.routing.errors import (
    EngineTimeoutError,
    EngineUnreachableError,
    InvalidRequestError,
    NoReadyDeploymentError,
    RequestTooLargeError,
)
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.routing.scorer import Candidate, NodeSignals, p95_bucket, rank
from berth.routing.signals import DEMOTION_STEP_S, SignalBoard
from support.fakes import FakeLink


class Clock:
    """Seconds that only move when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _c(node: str, in_flight: int | None = 0, p95: float | None = None, **kw: object) -> Candidate:
    signals = None
    if in_flight is not None:
        signals = NodeSignals(in_flight, p95, kw.get("free"), bool(kw.get("failed")))  # type: ignore[arg-type]
    return Candidate(f"d-{node}", node, signals, kw.get("need"))  # type: ignore[arg-type]


def _nodes(ranking: object) -> list[str]:
    return [r.candidate.node_id for r in ranking.ranked]  # type: ignore[attr-defined]


# -- the signal board ------------------------------------------------------------------------------


def test_in_flight_is_counted_per_deployment_and_per_node() -> None:
    board = SignalBoard()
    board.started("d-1", "n")
    board.started("d-1", "n")
    board.started("d-2", "n")
    assert (board.in_flight("d-1"), board.in_flight("d-2"), board.node_in_flight("n")) == (2, 1, 3)
    board.finished("d-1", "n")
    assert (board.in_flight("d-1"), board.node_in_flight("n")) == (1, 2)
    board.finished("d-1", "n")
    assert (board.in_flight("d-1"), board.node_in_flight("n")) == (0, 1)
    board.finished("d-2", "n")
    assert (board.in_flight("d-1"), board.in_flight("d-2"), board.node_in_flight("n")) == (0, 0, 0)
    board.finished("d-1", "n")  # one more than started: never below zero, never an error
    board.finished("d-9", "other")
    assert (board.in_flight("d-1"), board.node_in_flight("n")) == (0, 0)
    assert board.in_flight("d-never") == 0 and board.node_in_flight("never") == 0


def test_latency_samples_are_milliseconds_over_a_window() -> None:
    clock = Clock()
    board = SignalBoard(window_s=60.0, clock=clock)
    assert board.p95_ms("d") is None
    board.observe("d", 0.25)
    assert board.p95_ms("d") == 250.0
    clock.now = 60.0  # exactly a window later: still in it
    assert board.p95_ms("d") == 250.0
    clock.now = 60.5
    assert board.p95_ms("d") is None


def test_the_p95_is_the_nearest_rank_95th_percentile() -> None:
    board = SignalBoard(clock=Clock())
    for ms in range(1, 21):
        board.observe("d", ms / 1000)
    assert board.p95_ms("d") == 19.0


def test_only_the_newest_samples_are_kept() -> None:
    board = SignalBoard(max_samples=2, clock=Clock())
    for seconds in (0.5, 0.001, 0.001):
        board.observe("d", seconds)
    assert board.p95_ms("d") == 1.0  # the 500 ms sample fell out


def test_each_failure_in_a_row_demotes_for_longer_and_an_answer_ends_it() -> None:
    clock = Clock()
    board = SignalBoard(clock=clock)
    board.failed("d")
    clock.now = DEMOTION_STEP_S  # one failure: demoted for exactly one step
    assert not board.recently_failed("d")
    board.failed("d")  # the second in a row, at t=5: two steps, until t=15
    clock.now = DEMOTION_STEP_S + 2 * DEMOTION_STEP_S - 0.5
    assert board.recently_failed("d")
    clock.now = DEMOTION_STEP_S + 2 * DEMOTION_STEP_S + 0.5
    assert not board.recently_failed("d")
    board.failed("other")
    assert board.recently_failed("other") and not board.recently_failed("d")
    board.succeeded("other")
    assert not board.recently_failed("other")


def test_a_forgotten_deployment_has_no_samples_and_no_demotion() -> None:
    board = SignalBoard(clock=Clock())
    board.observe("d", 0.1)
    board.failed("d")
    board.observe("kept", 0.1)
    board.forget("d")
    assert board.p95_ms("d") is None and not board.recently_failed("d")
    assert board.p95_ms("kept") == 100.0
    board.forget("never-seen")  # nothing to drop is not an error


# -- the scorer ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p95_ms", "bucket"),
    [(None, -math.inf), (0.0, 0), (10.0, 0), (49.9, 0), (50.0, 1), (74.0, 1), (76.0, 2),
     (100.0, 2), (113.0, 3)],
)  # fmt: skip
def test_p95_buckets(p95_ms: float | None, bucket: float) -> None:
    assert p95_bucket(p95_ms) == bucket


def test_equal_candidates_keep_their_order_without_rotation_and_rotate_with_it() -> None:
    three = [_c("a"), _c("b"), _c("c")]
    assert _nodes(rank(three)) == ["a", "b", "c"]
    assert _nodes(rank(three, rotation=1)) == ["b", "c", "a"]


def test_exactly_enough_free_gpu_memory_is_enough() -> None:
    ranking = rank([_c("a", free=4000, need=4000)])
    assert _nodes(ranking) == ["a"] and ranking.dropped == ()


def test_candidates_without_signals_rank_by_affinity_among_themselves() -> None:
    assert _nodes(rank([_c("a", None), _c("b", None)], "b")) == ["b", "a"]


def test_the_affinity_node_keeps_its_place_up_to_the_slack() -> None:
    # a has exactly AFFINITY_MAX_EXTRA_IN_FLIGHT (4) more than b: still preferred
    ranking = rank([_c("a", 5), _c("b", 1)], "a")
    assert _nodes(ranking) == ["a", "b"]
    assert [r.affinity_hit for r in ranking.ranked] == [True, False]
    assert ranking.ranked[1].reason == "no affinity, 1 in flight, p95 unknown"


def test_reasons_in_words() -> None:
    busy = rank([_c("a", 9), _c("b", 1, 20.0, failed=True)], "a")
    assert [r.reason for r in busy.ranked] == [
        "no affinity (the affinity node is too busy), 9 in flight, p95 unknown",
        "failed recently (ranked after healthy ones), no affinity (the affinity node is too "
        "busy), 1 in flight, p95 20.0 ms",
    ]
    assert [r.affinity_hit for r in busy.ranked] == [False, False]
    (silent,) = rank([_c("a", None)]).ranked
    assert silent.reason == "no signals from its node yet (ranked last)"


# -- affinity --------------------------------------------------------------------------------------


def test_the_api_key_is_hashed_without_its_scheme_and_spaces() -> None:
    expected = API_KEY_PREFIX + hashlib.sha256(b"sk-1").hexdigest()[:32]
    assert affinity_key([(b"authorization", b"Bearer sk-1")]) == expected
    assert affinity_key([(b"authorization", b"bearer  sk-1 ")]) == expected
    assert affinity_key([(b"x-forwarded-authorization", b"Bearer sk-1")]) is None
    assert affinity_key([(b"authorization", b"Basic c2stMQ==")]) is None


def test_a_long_session_id_is_hashed_a_short_one_kept() -> None:
    kept = b"s" * 256
    hashed = b"s" * 257
    assert affinity_key([(b"x-session-id", kept)]) == "session:" + kept.decode()
    digest = hashlib.sha256(hashed).hexdigest()
    assert affinity_key([(b"x-session-id", hashed)]) == "session:sha256:" + digest
    assert affinity_key([(b"x-session-id", "é".encode("latin-1"))]) == "session:é"


def test_an_affinity_map_of_one_and_peeking() -> None:
    with pytest.raises(ValueError, match=r"^AffinityMap capacity must be positive$"):
        AffinityMap(capacity=0)
    single = AffinityMap(capacity=1)
    single.record("s1", "a")
    single.record("s2", "b")
    assert (single.peek("s1"), single.peek("s2"), len(single)) == (None, "b", 1)
    two = AffinityMap(capacity=2)
    two.record("s1", "a")
    two.record("s2", "b")
    assert two.peek("s1") == "a"  # a peek is not a use: s1 stays the oldest
    two.record("s3", "c")
    assert (two.peek("s1"), two.peek("s2"), two.peek(None)) == (None, "b", None)


# -- the router ------------------------------------------------------------------------------------


class Models:
    """``m`` on nodes a and b, ``one`` on node a; other names are unknown."""

    def candidates(self, model: str) -> list[Upstream]:
        nodes = {"m": ["a", "b"], "one": ["a"]}[model]
        return [Upstream(f"http://{n}", f"d-{model}-{n}", n, model) for n in nodes]

    def models(self) -> list[str]:
        return ["m", "one"]


def test_plan_asks_the_resolver_for_the_model_named() -> None:
    router = Router(Models())
    assert [u.deployment_id for u in router.plan("one", None)] == ["d-one-a"]
    assert {u.deployment_id for u in router.plan("m", None)} == {"d-m-a", "d-m-b"}


def test_plan_request_works_out_a_key_only_when_there_is_a_choice() -> None:
    router = Router(Models())
    headers = [(b"x-session-id", b"s1")]
    plan, key = router.plan_request("one", headers)
    assert key is None and [u.node_id for u in plan] == ["a"]
    router.succeeded("session:s1", Upstream("http://b", "d-m-b", "b", "m"))
    for _ in range(3):  # the affinity holds whatever the rotation
        plan, key = router.plan_request("m", headers)
        assert key == "session:s1" and plan[0].node_id == "b"


def test_explain_uses_the_key_the_map_and_no_rotation() -> None:
    router = Router(Models())
    assert _nodes(router.explain("m")) == ["a", "b"]
    router.plan("m", None)  # advances the rotation, which explain does not use
    assert _nodes(router.explain("m")) == ["a", "b"]
    router.succeeded("session:s", Upstream("http://b", "d-m-b", "b", "m"))
    explained = router.explain("m", "session:s")
    assert _nodes(explained) == ["b", "a"] and explained.ranked[0].affinity_hit
    # An API-key affinity only breaks ties: one more in flight on its node and it yields.
    router.succeeded("key:k", Upstream("http://b", "d-m-b", "b", "m"))
    router.signals.started("d-m-b", "b")
    assert _nodes(router.explain("m", "key:k")) == ["a", "b"]


def test_a_node_whose_link_goes_loses_its_affinity() -> None:
    links = LinkRegistry([FakeLink("a"), FakeLink("b")])
    router = Router(Models(), links=links)
    router.succeeded("session:s1", Upstream("http://a", "d-m-a", "a", "m"))
    router.succeeded("session:s2", Upstream("http://b", "d-m-b", "b", "m"))
    replaced = FakeLink("a")
    links.attach(replaced)  # a new link for node a: a change, but not a loss
    assert router.affinity.peek("session:s1") == "a"
    links.detach(replaced)
    assert router.affinity.peek("session:s1") is None
    assert router.affinity.peek("session:s2") == "b"


def test_the_router_reads_each_nodes_signals() -> None:
    clock = Clock()
    board = SignalBoard(clock=clock)
    board.observe("d-m-a", 0.02)
    router = Router(
        Models(),
        signals=board,
        node_reported=lambda node: node == "a",
        free_vram_mb=lambda node: {"a": 1000}.get(node),
    )
    a, b = router.explain("m").ranked
    assert a.reason == "no affinity, 0 in flight, p95 20.0 ms, 1000 MiB GPU memory free"
    assert b.reason == "no signals from its node yet (ranked last)"


# -- what the errors carry -------------------------------------------------------------------------


def test_errors_carry_their_context_and_say_it() -> None:
    upstream = Upstream("http://a", "d-a", "a", "m")
    bad = InvalidRequestError("no model given", code="missing_model", param="model")
    assert (str(bad), bad.error_code, bad.param, bad.http_status) == (
        "no model given", "missing_model", "model", 400,
    )  # fmt: skip
    large = RequestTooLargeError(1024)
    assert large.limit_bytes == 1024
    assert str(large) == "request body is larger than the limit of 1024 bytes"
    loading = NoReadyDeploymentError("m")
    assert (loading.retry_after_s, str(loading)) == (5.0, "model 'm' has no ready deployment")
    unreachable = EngineUnreachableError(upstream, "refused the connection")
    assert unreachable.deployment_id == "d-a" and unreachable.upstream is upstream
    assert str(unreachable) == "the engine of deployment d-a refused the connection"
    timeout = EngineTimeoutError(upstream, 30.0)
    assert timeout.deployment_id == "d-a"
    assert str(timeout) == "the engine of deployment d-a sent nothing for 30.0 s"
