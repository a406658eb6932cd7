"""The prefix policy: prompt blocks, the bounded record, the choice under a load bound, and
the router that joins them (affinity first, retries to the next choice, a deployment or node
that leaves takes only its own prefixes with it)."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Mapping

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from berth.admin.routing import build_routing_router
from berth.api import RoutingExplanation
from berth.cli.routing_cmd import decision_text
from berth.config import Settings
from berth.errors import ConfigError
from berth.observability.metrics import ProxyMetrics
from berth.paths import BerthHome
from berth.routing.prefix import PrefixCandidate, choose, load_bound
from berth.routing.prefix_blocks import BLOCK_BYTES, EMPTY, PromptBlocks, prompt_blocks
from berth.routing.prefix_index import ENTRY_BYTES, PrefixIndex
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.routing.signals import SignalBoard
from support.proxy_fixtures import running_proxy, sample
from support.standin_engine import StandinEngine


def _chat(*contents: str, roles: tuple[str, ...] = ()) -> dict[str, object]:
    roles = roles or tuple("system" if i == 0 else "user" for i in range(len(contents)))
    return {"messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]}


SYSTEM = "You are a careful assistant. " * 40  # about 1,100 characters: 5 blocks


# -- prompt blocks -----------------------------------------------------------------------


def test_a_longer_conversation_shares_the_shorter_ones_blocks() -> None:
    first = prompt_blocks(_chat(SYSTEM, "hello"))
    second = prompt_blocks(
        _chat(
            SYSTEM,
            "hello",
            "hi! how can I help?",
            "more",
            roles=("system", "user", "assistant", "user"),
        )
    )
    assert len(first) == 5 + 1
    assert second.hashes[: len(first)] == first.hashes
    assert len(second) == len(first) + 2


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        (_chat(SYSTEM, "x"), _chat(SYSTEM, "y"), 5),  # the same system prompt
        (_chat("a" * 300, "x"), _chat("a" * 299 + "b", "x"), 1),  # differ in block 2
        (_chat("same", roles=("system",)), _chat("same", roles=("user",)), 0),  # the role counts
        (_chat("ab", "c"), _chat("a", "bc"), 0),  # a message ends a block
    ],
)
def test_blocks_match_exactly_as_far_as_the_prompts_agree(
    a: Mapping[str, object], b: Mapping[str, object], shared: int
) -> None:
    ha, hb = prompt_blocks(a).hashes, prompt_blocks(b).hashes
    same = next((i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y), len(ha))
    assert same == shared


@pytest.mark.parametrize(
    ("payload", "blocks"),
    [
        ({"prompt": "p" * (BLOCK_BYTES * 3 + 1)}, 4),  # completions: fixed-size chunks
        ({"prompt": ["p" * 10]}, 1),
        ({"prompt": list(range(130))}, 3),  # token ids, 64 a block
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, 1),
        ({"messages": [], "tools": [{"type": "function"}]}, 1),  # tools come first
        ({"input": "embed me"}, 0),  # a shape it does not read: no blocks
        ({"prompt": 42}, 0),
    ],
)
def test_the_shapes_it_reads(payload: Mapping[str, object], blocks: int) -> None:
    assert len(prompt_blocks(payload)) == blocks


def test_matches_are_reported_in_rough_tokens_too() -> None:
    blocks = prompt_blocks({"prompt": "p" * 600})  # 3 blocks: 256 + 256 + 88 characters
    assert blocks.approx_tokens(1) == 64 and blocks.approx_tokens(3) == 150
    assert EMPTY.approx_tokens(3) == 0


# -- the record --------------------------------------------------------------------------


def test_the_record_finds_the_longest_run_from_the_first_block() -> None:
    index = PrefixIndex()
    short = prompt_blocks(_chat(SYSTEM, "a"))
    longer = prompt_blocks(_chat(SYSTEM, "a", "b", roles=("system", "user", "assistant")))
    index.record("d1", short)
    index.record("d2", PromptBlocks(short.hashes[:2]))
    assert index.matches(longer, ["d1", "d2", "d3"]) == {"d1": 6, "d2": 2, "d3": 0}


def test_the_record_is_bounded_and_forgets_a_prompt_from_its_end() -> None:
    index = PrefixIndex(max_entries=8)
    old = prompt_blocks(_chat(SYSTEM, "old"))  # 6 blocks
    index.record("d1", old)
    index.record("d1", prompt_blocks(_chat("other", "new")))  # 2 more: full
    index.record("d1", prompt_blocks(_chat("third", "x")))  # 2 more: 2 of the old go
    assert len(index) == 8
    # What is left of the old prompt is its first blocks: still a (shorter) match.
    assert index.matches(old, ["d1"]) == {"d1": 4}


def test_the_byte_bound_caps_the_entries() -> None:
    index = PrefixIndex(max_entries=10**9, max_mb=1)
    assert index.capacity == 1024 * 1024 // ENTRY_BYTES
    assert index.bytes_estimate == 0


def test_dropping_a_deployment_forgets_only_its_entries() -> None:
    index = PrefixIndex()
    blocks = prompt_blocks(_chat(SYSTEM, "a"))
    index.record("d1", blocks)
    index.record("d2", blocks)
    assert index.drop("d1") == 6
    assert index.matches(blocks, ["d1", "d2"]) == {"d1": 0, "d2": 6}
    assert index.deployments() == ["d2"] and len(index) == 6


# -- the choice --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loads", "factor", "bound"),
    [([0, 0, 0], 1.25, 1), ([2, 2, 2], 1.25, 3), ([4, 0, 0], 1.25, 3), ([10, 10], 1.0, 11)],
)
def test_the_load_bound(loads: list[int], factor: float, bound: int) -> None:
    assert load_bound(loads, factor) == bound


def _pc(name: str, in_flight: int, matched: int = 0, demoted: bool = False) -> PrefixCandidate:
    return PrefixCandidate(name, in_flight, matched, demoted)


@pytest.mark.parametrize(
    ("candidates", "order", "outcome", "matched"),
    [
        # the longest match, within the bound
        ([_pc("a", 1), _pc("b", 1, 3), _pc("c", 1, 5)], ["c", "b", "a"], "matched", 5),
        # the longest match is over the bound: the next best match takes it
        ([_pc("a", 0), _pc("b", 1, 3), _pc("c", 5, 5)], ["b", "a", "c"], "overridden_by_load", 3),
        # ... or, with no other match, the least loaded (the scorer's first)
        ([_pc("a", 0), _pc("b", 1), _pc("c", 5, 5)], ["a", "b", "c"], "overridden_by_load", 0),
        # no match anywhere: the scorer's order stands
        ([_pc("b", 0), _pc("a", 0), _pc("c", 1)], ["b", "a", "c"], "no_match", 0),
        # a demoted candidate stays last, whatever it holds
        ([_pc("a", 0, 9, demoted=True), _pc("b", 0, 1)], ["b", "a"], "matched", 1),
    ],
)
def test_choose(
    candidates: list[PrefixCandidate], order: list[str], outcome: str, matched: int
) -> None:
    choice = choose(candidates)
    assert list(choice.order) == order
    assert (choice.outcome, choice.matched_blocks) == (outcome, matched)


def test_an_override_says_who_held_the_prefix_and_the_bound() -> None:
    choice = choose([_pc("a", 0), _pc("c", 5, 5)])
    assert choice.longest_blocks == 5 and choice.bound == 4
    assert choice.reason.startswith(
        "c holds the longest prefix (5 blocks) but would have 6 in flight with this request, "
        "over the bound of 4 (1.25 x the mean); least loaded"
    )


@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_a_dominant_system_prompt_stays_within_the_bound(factor: float) -> None:
    """The hotspot case: every request shares one system prompt; requests arrive faster
    than they finish. No deployment ever exceeds ``ceil(c x mean)``."""
    rng = random.Random(7)
    index = PrefixIndex()
    names = ["d1", "d2", "d3", "d4"]
    in_flight = dict.fromkeys(names, 0)
    running: list[str] = []
    outcomes: set[str] = set()
    for turn in range(400):
        blocks = prompt_blocks(_chat(SYSTEM, f"question {rng.randrange(20)}"))
        matches = index.matches(blocks, names)
        busiest = max(in_flight.values())
        choice = choose([_pc(n, in_flight[n], matches[n]) for n in names], factor)
        outcomes.add(choice.outcome)
        in_flight[choice.chosen] += 1
        # A choice never takes a deployment past the bound (nor past the busiest already).
        assert in_flight[choice.chosen] <= max(choice.bound, busiest)
        running.append(choice.chosen)
        index.record(choice.chosen, blocks)
        if turn % 3 != 0 and running:  # two finish for every three that arrive
            in_flight[running.pop(rng.randrange(len(running)))] -= 1
    assert "overridden_by_load" in outcomes and "matched" in outcomes
    total = sum(in_flight.values())
    assert max(in_flight.values()) / (total / len(names)) <= factor + len(names) / total


# -- the router --------------------------------------------------------------------------


class Fleet:
    """A resolver over a set of deployments that may grow or shrink."""

    def __init__(self, *nodes: str) -> None:
        self.nodes = list(nodes)

    def candidates(self, model: str) -> list[Upstream]:
        return [Upstream(f"http://{n}", f"dep-{n}", n, model) for n in self.nodes]

    def models(self) -> list[str]:
        return ["m"]


def _prefix_router(fleet: Fleet, **kw: object) -> Router:
    return Router(fleet, policy="prefix", **kw)  # type: ignore[arg-type]


def _conversation(i: int, turns: int) -> dict[str, object]:
    contents = [f"system prompt of conversation {i}: " + "rules. " * 80]
    roles = ["system"]
    for t in range(turns):
        contents += [f"user turn {t} of {i}", f"assistant answer {t} of {i}"]
        roles += ["user", "assistant"]
    contents.append(f"user turn {turns} of {i}")
    roles.append("user")
    return _chat(*contents, roles=tuple(roles))


def _serve(router: Router, payload: dict[str, object]) -> Upstream:
    plan, key = router.plan_request("m", [], payload)
    router.succeeded(key, plan[0])
    return plan[0]


@pytest.mark.parametrize("change", ["join", "leave"])
def test_a_node_joining_or_leaving_moves_only_the_prefixes_it_takes_or_held(change: str) -> None:
    fleet = Fleet("n1", "n2", "n3")
    router = _prefix_router(fleet)
    where = {i: _serve(router, _conversation(i, 0)).node_id for i in range(100)}
    assert len(set(where.values())) == 3  # spread: no prefix matched, least loaded took it
    if change == "join":
        fleet.nodes.append("n4")
    else:
        fleet.nodes.remove("n2")
        router.node_lost("n2")
        assert router.prefixes.entries_of("dep-n2") == 0
    moved = {i for i in range(100) if _serve(router, _conversation(i, 1)).node_id != where[i]}
    if change == "join":
        assert moved == set()  # the new node takes only new prefixes
        fresh = {_serve(router, _conversation(1000 + i, 0)).node_id for i in range(8)}
        assert "n4" in fresh
    else:
        assert moved == {i for i, node in where.items() if node == "n2"}


def test_the_router_counts_and_remembers_its_decisions() -> None:
    counted: list[tuple[str, str]] = []
    signals = SignalBoard()
    router = _prefix_router(
        Fleet("n1", "n2"), signals=signals, on_decision=lambda p, o: counted.append((p, o))
    )
    first = _serve(router, _chat(SYSTEM, "q1"))
    again = _serve(router, _chat(SYSTEM, "q2"))
    assert again.deployment_id == first.deployment_id
    decision = router.last_decisions["m"]
    assert (decision.outcome, decision.matched_blocks) == ("matched", 5)
    assert decision.matched_tokens == len(SYSTEM) // 4
    for _ in range(3):  # its deployment gets busy: the bound overrides the match
        signals.started(first.deployment_id, first.node_id)
    third = _serve(router, _chat(SYSTEM, "q3"))
    assert third.deployment_id != first.deployment_id
    assert router.last_decisions["m"].outcome == "overridden_by_load"
    assert counted == [
        ("prefix", "no_match"),
        ("prefix", "matched"),
        ("prefix", "overridden_by_load"),
    ]


def test_a_session_header_wins_over_a_prefix_match() -> None:
    router = _prefix_router(Fleet("n1", "n2"))
    held = _serve(router, _chat(SYSTEM, "q"))
    other = "n2" if held.node_id == "n1" else "n1"
    router.affinity.record("session:s1", other)
    plan, _key = router.plan_request("m", [(b"x-session-id", b"s1")], _chat(SYSTEM, "q"))
    assert plan[0].node_id == other
    assert router.last_decisions["m"].outcome == "affinity"


def test_a_retry_goes_to_the_next_choice_and_records_it() -> None:
    router = _prefix_router(Fleet("n1", "n2", "n3"))
    payload = _chat(SYSTEM, "q")
    plan, key = router.plan_request("m", [], payload)
    assert len({u.deployment_id for u in plan}) == 3  # every candidate, best first
    router.succeeded(key, plan[1])  # the first failed; the second answered
    matches = router.prefixes.matches(prompt_blocks(payload), [u.deployment_id for u in plan])
    assert matches[plan[1].deployment_id] == 6


def test_a_stopped_deployment_s_entries_go_at_once() -> None:
    router = _prefix_router(Fleet("n1", "n2"))
    held = _serve(router, _chat(SYSTEM, "q"))
    assert router.deployment_gone(held.deployment_id) == 6
    assert "m" not in router.last_decisions


def test_the_least_load_policy_ignores_prefixes_and_records_nothing() -> None:
    router = Router(Fleet("n1", "n2"))
    _serve(router, _chat(SYSTEM, "q"))
    assert len(router.prefixes) == 0
    assert router.last_decisions["m"].outcome == "least_loaded"


# -- through the proxy, the admin API and the settings -----------------------------------


class Engines:
    """Model ``m`` on stand-in engines, one node each."""

    def __init__(self, engines: list[StandinEngine]) -> None:
        self.upstreams = [
            Upstream(e.base_url, f"d-{i}", f"n-{i}", "m") for i, e in enumerate(engines)
        ]

    def candidates(self, model: str) -> list[Upstream]:
        return list(self.upstreams)

    def models(self) -> list[str]:
        return ["m"]


async def test_the_proxy_sends_a_shared_prefix_to_one_engine_and_counts_it(
    metrics: ProxyMetrics,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(StandinEngine()) for _ in range(3)]
        resolver = Engines(engines)
        router = Router(resolver, policy="prefix", on_decision=metrics.routing_decided)
        url = await stack.enter_async_context(running_proxy(resolver, metrics, router=router))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=url))
        for turn in range(4):  # one at a time: nothing in flight, the match always wins
            body = {"model": "m", **_chat(SYSTEM, f"question {turn}")}
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    assert sorted(len(e.requests) for e in engines) == [0, 0, 4]
    assert sample(metrics, "berth_routing_decisions_total", policy="prefix", outcome="matched") == 3
    assert (
        sample(metrics, "berth_routing_decisions_total", policy="prefix", outcome="no_match") == 1
    )


def test_berth_routing_shows_the_policy_and_the_last_match() -> None:
    router = _prefix_router(Fleet("n1", "n2"))
    _serve(router, _chat(SYSTEM, "q1"))
    held = _serve(router, _chat(SYSTEM, "q2"))
    app = FastAPI()
    app.include_router(build_routing_router(router))
    with TestClient(app) as http:
        answer = http.get("/admin/routing/m")
    assert answer.status_code == 200, answer.text
    explained = RoutingExplanation.model_validate_json(answer.content)
    assert explained.policy == "prefix" and explained.last_decision is not None
    assert decision_text(explained.last_decision) == (
        f"matched on {held.deployment_id} (5 blocks, ~{len(SYSTEM) // 4} tokens): "
        "longest cached prefix (5 blocks), within the load bound of 1"
    )


def test_the_policy_is_a_setting(home: BerthHome) -> None:
    settings = Settings.load(home, env={})
    assert (settings.routing_policy, settings.prefix_load_factor) == ("least-load", 1.25)
    env = {"BERTH_ROUTING_POLICY": "prefix", "BERTH_PREFIX_LOAD_FACTOR": "2"}
    settings = Settings.load(home, env=env)
    assert (settings.routing_policy, settings.prefix_load_factor) == ("prefix", 2.0)
    for refused in ({"BERTH_ROUTING_POLICY": "random"}, {"BERTH_PREFIX_LOAD_FACTOR": "0.9"}):
        with pytest.raises(ConfigError, match=next(iter(refused))):
            Settings.load(home, env=refused)


def test_a_service_s_policy_wins_over_the_default() -> None:
    class Served(Fleet):
        def candidates(self, model: str) -> list[Upstream]:
            return [
                dataclasses.replace(u, routing_policy="least-load")
                for u in super().candidates(model)
            ]

    router = _prefix_router(Served("n1", "n2"))
    _serve(router, _chat(SYSTEM, "q"))
    assert router.last_decisions["m"].outcome == "least_loaded" and len(router.prefixes) == 0


def test_an_adapter_s_tiers_still_come_first_under_the_prefix_policy() -> None:
    class Tiered(Fleet):
        def candidates(self, model: str) -> list[Upstream]:
            # n1 must load the adapter first (tier 1); n2 and n3 have it (tier 0).
            return [
                dataclasses.replace(u, tier=1 if u.node_id == "n1" else 0)
                for u in super().candidates(model)
            ]

    router = _prefix_router(Tiered("n1", "n2", "n3"))
    router.prefixes.record("dep-n1", prompt_blocks(_chat(SYSTEM, "q")))  # n1 holds the prefix
    plan, _key = router.plan_request("m", [], _chat(SYSTEM, "q"))
    assert plan[-1].node_id == "n1"  # only a retry reaches the lower tier
    assert router.last_decisions["m"].outcome == "no_match"  # within tier 0, nobody has it
