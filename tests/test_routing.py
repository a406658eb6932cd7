"""Routing decisions, pure: the scorer, affinity, retry classification; and the dispatch loop
over fake attempts."""

from __future__ import annotations

import pytest

from berth.daemon.proxy_dispatch import first_answer
from berth.routing.affinity import AffinityMap, affinity_key
from berth.routing.errors import EngineTimeoutError, EngineUnreachableError
from berth.routing.resolver import Upstream
from berth.routing.retry import AttemptFailure, classify
from berth.routing.router import Router
from berth.routing.scorer import Candidate, NodeSignals, rank
from berth.routing.signals import SignalBoard


def _c(node: str, in_flight: int | None = 0, p95: float | None = None, **kw: int) -> Candidate:
    signals = None if in_flight is None else NodeSignals(in_flight, p95, kw.get("free"))
    return Candidate(f"d-{node}", node, signals, kw.get("need"))


def _order(ranking: object) -> list[str]:
    return [r.candidate.node_id for r in ranking.ranked]  # type: ignore[attr-defined]


# -- the scorer ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("candidates", "affinity", "expected"),
    [
        ([_c("a", 3), _c("b", 1)], None, ["b", "a"]),  # fewer in flight first
        ([_c("a", 3), _c("b", 1)], "a", ["a", "b"]),  # affinity beats load...
        ([_c("a", 9), _c("b", 1)], "a", ["b", "a"]),  # ...unless its node is far busier
        ([_c("a", 1, 900.0), _c("b", 1, 100.0)], None, ["b", "a"]),  # then the lower p95
        ([_c("a", 1, 900.0), _c("b", 1, 100.0)], "a", ["a", "b"]),  # affinity beats p95
        ([_c("a", None), _c("b", 5)], None, ["b", "a"]),  # no signals: last
        ([_c("a", None), _c("b", 5)], "a", ["b", "a"]),  # ...even with affinity
        ([_c("a", 1, 90.0), _c("b", 1, None)], None, ["b", "a"]),  # an unknown p95 is tried
        ([_c("a", 1, 9.0), _c("b", 1, 30.0)], "b", ["b", "a"]),  # both under the floor: tie
    ],
)
def test_rank_order(candidates: list[Candidate], affinity: str | None, expected: list[str]) -> None:
    assert _order(rank(candidates, affinity)) == expected


def test_near_equal_latencies_tie_and_ties_rotate() -> None:
    candidates = [_c("a", 0, 60.0), _c("b", 0, 70.0)]
    firsts = {_order(rank(candidates, None, rotation))[0] for rotation in range(4)}
    assert firsts == {"a", "b"}


def test_a_node_without_room_is_dropped_with_its_reason() -> None:
    ranking = rank([_c("a", 0, free=1000, need=4000), _c("b", 2, free=8000, need=4000)])
    assert _order(ranking) == ["b"]
    (dropped,) = ranking.dropped
    assert dropped.candidate.node_id == "a" and "4000 MiB" in dropped.reason


def test_reasons_explain_the_rank() -> None:
    ranking = rank([_c("a", 2, 12.5, free=100), _c("b", None)], "a")
    assert (
        ranking.ranked[0].reason
        == "affinity hit, 2 in flight, p95 12.5 ms, 100 MiB GPU memory free"
    )
    assert "no signals" in ranking.ranked[1].reason


# -- affinity ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"x-session-id", b"s1"), (b"x-conversation-id", b"c1")], "session:s1"),
        ([(b"x-conversation-id", b"c1"), (b"authorization", b"Bearer k")], "conversation:c1"),
        ([(b"authorization", b"Bearer sk-berth-x")], "key:"),
        ([], None),
    ],
)
def test_affinity_key_precedence(headers: list[tuple[bytes, bytes]], expected: str | None) -> None:
    key = affinity_key(headers)
    if expected is None:
        assert key is None
    else:
        assert key is not None and key.startswith(expected)
    if key and key.startswith("key:"):
        assert "sk-berth" not in key  # the map never holds a secret


def test_affinity_map_is_a_bounded_lru_and_forgets_lost_nodes() -> None:
    affinity = AffinityMap(capacity=2)
    affinity.record("s1", "a")
    affinity.record("s2", "b")
    assert affinity.get("s1") == "a"  # s1 is now the most recent
    affinity.record("s3", "a")
    assert affinity.get("s2") is None and len(affinity) == 2
    assert affinity.forget_node("a") == 2
    assert affinity.get("s1") is None and len(affinity) == 0


# -- retry ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "status", "decision"),
    [
        (AttemptFailure.CONNECT, None, "retry"),
        (AttemptFailure.TIMEOUT, None, "retry"),
        (AttemptFailure.NODE_UNREACHABLE, None, "retry"),
        (None, 502, "retry"),
        (None, 503, "retry"),
        (None, 504, "retry"),
        (None, 500, "answer"),
        (None, 400, "answer"),
        (None, 429, "answer"),
        (None, 200, "answer"),
    ],
)
def test_retry_classification(
    failure: AttemptFailure | None, status: int | None, decision: str
) -> None:
    assert classify(failure, status) == decision


# -- the dispatch loop ---------------------------------------------------------------------------


class FakeAnswer:
    def __init__(self, status: int) -> None:
        self.status = status
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _u(node: str, deployment: str | None = None) -> Upstream:
    return Upstream(f"http://{node}", deployment or f"d-{node}", node, "m")


async def _dispatch(plan: list[Upstream], outcomes: dict[str, object], attempts: int = 3):  # type: ignore[no-untyped-def]
    tried: list[str] = []
    board = SignalBoard()

    async def attempt(upstream: Upstream) -> FakeAnswer:
        tried.append(upstream.deployment_id)
        outcome = outcomes[upstream.deployment_id]
        if isinstance(outcome, Exception):
            raise outcome
        return FakeAnswer(outcome)  # type: ignore[arg-type]

    result = await first_answer(
        plan, attempt, max_attempts=attempts, signals=board, clock=lambda: 0.0, request_id="r"
    )
    return result, tried, board


async def test_a_refused_node_is_retried_on_the_next_node() -> None:
    a, b = _u("a"), _u("b")
    refused = EngineUnreachableError(a, "connection refused")
    (chosen, answer), tried, board = await _dispatch([a, b], {"d-a": refused, "d-b": 200})
    assert chosen == b and answer.status == 200 and tried == ["d-a", "d-b"]
    assert board.node_in_flight("a") == 0 and board.node_in_flight("b") == 1


async def test_a_503_answer_moves_on_but_a_4xx_is_the_answer() -> None:
    a, b = _u("a"), _u("b")
    (chosen, _answer), tried, _ = await _dispatch([a, b], {"d-a": 503, "d-b": 200})
    assert chosen == b
    (chosen, answer), tried, _ = await _dispatch([a, b], {"d-a": 400, "d-b": 200})
    assert chosen == a and answer.status == 400 and tried == ["d-a"]


async def test_retries_go_to_other_nodes_and_stop_at_max_attempts() -> None:
    a1, a2, b, c = _u("a", "d-a1"), _u("a", "d-a2"), _u("b"), _u("c")
    down = {d: EngineTimeoutError(u, 1.0) for d, u in
            (("d-a1", a1), ("d-a2", a2), ("d-b", b), ("d-c", c))}  # fmt: skip
    with pytest.raises(EngineTimeoutError):
        await _dispatch([a1, a2, b, c], down, attempts=2)  # type: ignore[arg-type]


async def test_the_last_attempts_answer_stands() -> None:
    a, b = _u("a"), _u("b")
    (chosen, answer), tried, _ = await _dispatch([a, b], {"d-a": 503, "d-b": 502})
    assert chosen == b and answer.status == 502 and tried == ["d-a", "d-b"]


# -- the router ----------------------------------------------------------------------------------


class TwoNodes:
    def candidates(self, model: str) -> list[Upstream]:
        return [_u("a"), _u("b")]

    def models(self) -> list[str]:
        return ["m"]


def test_the_router_prefers_the_affinity_node_then_spreads() -> None:
    router = Router(TwoNodes())
    router.succeeded("session:x", _u("b"))
    assert router.plan("m", "session:x")[0].node_id == "b"
    firsts = {router.plan("m", None)[0].node_id for _ in range(4)}
    assert firsts == {"a", "b"}
    router.node_lost("b")
    assert router.affinity.get("session:x") is None


def test_the_router_ranks_a_busy_node_last() -> None:
    router = Router(TwoNodes())
    router.signals.started("d-a", "a")
    assert [u.node_id for u in router.plan("m", None)] == ["b", "a"]
    explained = router.explain("m")
    assert "1 in flight" in explained.ranked[1].reason


def test_an_api_key_affinity_only_breaks_ties() -> None:
    router = Router(TwoNodes())
    router.succeeded("key:abc", _u("a"))
    router.signals.started("d-a", "a")  # one more in flight on the affinity node
    assert router.plan("m", "key:abc")[0].node_id == "b"
    router.succeeded("session:s", _u("a"))
    assert router.plan("m", "session:s")[0].node_id == "a"  # a session keeps its node


def test_a_deployment_that_failed_is_ranked_after_healthy_ones_for_a_while() -> None:
    now = [0.0]
    board = SignalBoard(clock=lambda: now[0])
    router = Router(TwoNodes(), signals=board)
    board.failed("d-a")
    assert [u.node_id for u in router.plan("m", None)] == ["b", "a"]
    assert "failed recently" in router.explain("m").ranked[1].reason
    now[0] = 6.0  # one failure: demoted for 5 s
    firsts = {router.plan("m", None)[0].node_id for _ in range(4)}
    assert firsts == {"a", "b"}


async def test_failed_attempts_demote_and_quick_errors_are_not_latency_samples() -> None:
    a, b = _u("a"), _u("b")
    refused = EngineUnreachableError(a, "connection refused")
    (_chosen, _answer), _tried, board = await _dispatch([a, b], {"d-a": refused, "d-b": 200})
    assert board.recently_failed("d-a") and not board.recently_failed("d-b")
    (_chosen, _answer), _tried, board = await _dispatch([a, b], {"d-a": 503, "d-b": 200})
    assert board.p95_ms("d-a") is None and board.p95_ms("d-b") is not None
