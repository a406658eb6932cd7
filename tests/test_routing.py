"""Routing decisions, pure: the scorer, affinity, retry classification; the dispatch loop
over fake attempts; and ``max_attempts`` through the proxy and the settings."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from berth.config import Settings
from berth.errors import ConfigError
from berth.gateway.dispatch import first_answer
from berth.observability.metrics import ProxyMetrics
from berth.paths import BerthHome
from berth.routing.affinity import AffinityMap, affinity_key
from berth.routing.errors import EngineTimeoutError, EngineUnreachableError
from berth.routing.resolver import Upstream
from berth.routing.retry import DEFAULT_MAX_ATTEMPTS, AttemptFailure, classify
from berth.routing.router import Router
from berth.routing.scorer import Candidate, NodeSignals, rank
from berth.routing.signals import SignalBoard
from support.proxy_fixtures import running_proxy
from support.standin_engine import StandinEngine, error_reply


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


async def _dispatch(
    plan: list[Upstream],
    outcomes: dict[str, object],
    attempts: int = 3,
    tried: list[str] | None = None,
):  # type: ignore[no-untyped-def]
    """``first_answer`` over ``plan`` where each deployment's attempt raises or answers as
    ``outcomes`` says; the result, the deployments tried in order (also in ``tried``, kept
    when the dispatch raises) and the signal board."""
    tried = [] if tried is None else tried
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
    tried: list[str] = []
    with pytest.raises(EngineTimeoutError) as raised:
        await _dispatch([a1, a2, b, c], down, attempts=2, tried=tried)  # type: ignore[arg-type]
    # One try per node (a2 is on a1's node), two in all (c is never tried) ...
    assert tried == ["d-a1", "d-b"]
    # ... and the error that stands is the last attempt's.
    assert raised.value.upstream == b


@pytest.mark.parametrize(
    ("max_attempts", "expected"),
    [
        (1, ["d-a1"]),  # 1: no retry
        (2, ["d-a1", "d-b"]),
        (3, ["d-a1", "d-b", "d-c"]),
        (10, ["d-a1", "d-b", "d-c"]),  # more attempts than nodes: each node once
    ],
)
async def test_max_attempts_caps_the_tries_and_each_node_is_tried_once(
    max_attempts: int, expected: list[str]
) -> None:
    a1, a2, b, a3, c = _u("a", "d-a1"), _u("a", "d-a2"), _u("b"), _u("a", "d-a3"), _u("c")
    refused = {u.deployment_id: EngineUnreachableError(u, "refused") for u in (a1, a2, b, a3, c)}
    tried: list[str] = []
    with pytest.raises(EngineUnreachableError) as raised:
        await _dispatch([a1, a2, b, a3, c], refused, attempts=max_attempts, tried=tried)  # type: ignore[arg-type]
    assert tried == expected
    assert raised.value.upstream.deployment_id == expected[-1]


@pytest.mark.parametrize("max_attempts", [1, 2])
async def test_the_last_allowed_attempt_s_503_is_the_answer(max_attempts: int) -> None:
    a, b, c = _u("a"), _u("b"), _u("c")
    tried: list[str] = []
    outcomes = {"d-a": 503, "d-b": 503, "d-c": 200}
    (chosen, answer), _, board = await _dispatch(
        [a, b, c], outcomes, attempts=max_attempts, tried=tried
    )
    assert tried == ["d-a", "d-b"][:max_attempts]
    assert answer.status == 503 and chosen.deployment_id == tried[-1]
    assert not answer.closed  # the answer that stands is relayed, not closed
    assert board.node_in_flight(chosen.node_id) == 1  # the caller finishes it


async def test_the_last_attempts_answer_stands() -> None:
    a, b = _u("a"), _u("b")
    (chosen, answer), tried, _ = await _dispatch([a, b], {"d-a": 503, "d-b": 502})
    assert chosen == b and answer.status == 502 and tried == ["d-a", "d-b"]


# -- max_attempts through the proxy and the settings ----------------------------------------------


class ThreeNodes:
    """Model ``m`` on three engines, each on a node of its own."""

    def __init__(self, engines: list[StandinEngine]) -> None:
        self.upstreams = [
            Upstream(e.base_url, f"d-{i}", f"n-{i}", "m") for i, e in enumerate(engines)
        ]

    def candidates(self, model: str) -> list[Upstream]:
        return list(self.upstreams)

    def models(self) -> list[str]:
        return ["m"]


@pytest.mark.parametrize(("options", "tries"), [({}, 3), ({"max_attempts": 2}, 2)])
async def test_the_proxy_tries_at_most_max_attempts_nodes(
    options: dict[str, int], tries: int, metrics: ProxyMetrics
) -> None:
    busy = error_reply(503, "loading model", type="unavailable_error")
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(StandinEngine(busy)) for _ in range(3)]
        url = await stack.enter_async_context(
            running_proxy(ThreeNodes(engines), metrics, **options)  # type: ignore[arg-type]
        )
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=url))
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert answer.status_code == 503  # the last attempt's answer stands
    assert sorted(len(e.requests) for e in engines) == [0] * (3 - tries) + [1] * tries


def test_max_attempts_is_a_setting_from_1_to_10(home: BerthHome) -> None:
    assert Settings.load(home, env={}).max_attempts == DEFAULT_MAX_ATTEMPTS == 3
    assert Settings.load(home, env={"BERTH_MAX_ATTEMPTS": "1"}).max_attempts == 1
    home.config_file.write_text("[server]\nmax_attempts = 10\n")
    assert Settings.load(home, env={}).max_attempts == 10
    for refused in ("0", "11"):
        with pytest.raises(ConfigError, match="BERTH_MAX_ATTEMPTS"):
            Settings.load(home, env={"BERTH_MAX_ATTEMPTS": refused})


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
