"""The desk worker's whole loop, in-process and fast: registration, pulses, claims, plain,
sealed and pool-test jobs, finish and fail, against the stand-in desk on real loopback HTTP.

The leader is :class:`FakeLeader` (the worker's ``Leader`` interface in memory); the real
leader is in ``test_desk_cli.py`` and ``test_desk_e2e.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from berth.desk.client import DeskClient
from berth.desk.commands import register_models
from berth.desk.errors import LeaderAnswerError, LeaderUnavailableError
from berth.desk.leader import ChatAnswer, ChatRequest, job_request
from berth.desk.pulse import ModelServing
from berth.desk.state import DeskFiles, load_key_pair, load_nodes
from berth.desk.worker import DeskWorker, WorkerTimings
from berth.errors import ConfigError
from berth.paths import BerthHome
from support.desk_standin import CHECK_PROMPT, DeskStandin, Fault

FAST = WorkerTimings(
    claim_idle_s=0.05,
    pulse_every_s=0.3,
    refresh_s=0.05,
    job_timeout_s=2.0,
    backoff_first_s=0.02,
    backoff_max_s=0.1,
    check_retry_s=0.1,
    speed_retry_s=0.1,
    tick_s=0.02,
)
PROMPT = "What is the capital of France? (a secret prompt 7f3a)"
SEALED_PROMPT = "The sealed question 9c1e: who wrote Dune?"
ANSWER = ChatAnswer(output="Paris is the capital.", prompt_tokens=12, completion_tokens=5)
SPEED = ChatAnswer(output="hello", prompt_tokens=2, completion_tokens=8)
H200 = ModelServing("smollm2", 1, 0, chip="NVIDIA H200", vram_gb=140.4, vram_used_gb=2.5)


class Hang:
    """A scripted reply: no answer within the request's limit."""


class FakeLeader:
    """The worker's ``Leader`` in memory: what it serves, and scripted chat replies."""

    def __init__(self, serving: Sequence[ModelServing], *, extra_names: Sequence[str] = ()):
        self.serving_now = {s.model: s for s in serving}
        self.extra_names = list(extra_names)
        self.available = True
        self.chats: list[ChatRequest] = []
        self.replies: deque[ChatAnswer | Exception | Hang] = deque()
        self.release = asyncio.Event()

    def job_chats(self) -> list[ChatRequest]:
        return [c for c in self.chats if c.max_tokens != 16]

    async def served_models(self) -> list[str]:
        if not self.available:
            raise LeaderUnavailableError("/tmp/berth.sock", "ConnectError")
        return [*self.serving_now, *self.extra_names]

    async def serving(self, models: Sequence[str]) -> dict[str, ModelServing]:
        if not self.available:
            raise LeaderUnavailableError("/tmp/berth.sock", "ConnectError")
        return {m: s for m, s in self.serving_now.items() if m in models}

    async def chat(self, request: ChatRequest, *, timeout_s: float) -> ChatAnswer:
        self.chats.append(request)
        if request.max_tokens == 16:  # the speed test
            return SPEED
        reply = self.replies.popleft() if self.replies else ANSWER
        if isinstance(reply, Hang):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self.release.wait()
            raise LeaderAnswerError("chat", 0, "timeout", f"within {timeout_s:g} s")
        if isinstance(reply, Exception):
            raise reply
        return reply


@pytest.fixture
async def desk_standin() -> AsyncIterator[DeskStandin]:
    async with DeskStandin() as standin:
        yield standin


@pytest.fixture
def files(tmp_path: Path) -> DeskFiles:
    return DeskFiles(BerthHome(tmp_path / "home"))


async def register(
    files: DeskFiles,
    desk_standin: DeskStandin,
    leader: FakeLeader,
    models: Sequence[str] = (),
    price: int | None = None,
    warnings: list[str] | None = None,
) -> None:
    async with DeskClient(desk_standin.url) as client:
        await register_models(
            files=files,
            leader=leader,
            desk=client,
            models=models,
            price=price,
            warn=(warnings if warnings is not None else []).append,
            now=lambda: 1.0,
        )


@contextlib.asynccontextmanager
async def serving(
    files: DeskFiles,
    desk_standin: DeskStandin,
    leader: FakeLeader,
    *,
    wait_s: int | None = None,
    timings: WorkerTimings = FAST,
) -> AsyncIterator[DeskWorker]:
    async with DeskClient(desk_standin.url) as client:
        keys = load_key_pair(files)
        assert keys is not None
        worker = DeskWorker(
            desk=client,
            leader=leader,
            files=files,
            nodes=load_nodes(files).nodes,
            keys=keys,
            wait_s=wait_s,
            timings=timings,
        )
        task = asyncio.create_task(worker.run())
        try:
            yield worker
        finally:
            task.cancel()
            await asyncio.wait([task])
            assert task.cancelled(), "the worker ended on its own"


# -- registration ---------------------------------------------------------------------------------


async def test_register_groups_models_as_one_machine_and_keeps_secrets_private(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader(
        [H200, ModelServing("qwen2.5:7b", 1, 0, None, None, None)], extra_names=["has space"]
    )
    warnings: list[str] = []
    await register(files, desk_standin, leader, price=150, warnings=warnings)
    assert warnings == [
        "served model 'has space' is not a valid desk model id ([a-zA-Z0-9._:/-]{1,80}); skipped"
    ]
    first, second = desk_standin.registrations
    keys = load_key_pair(files)
    assert keys is not None
    assert first == {"model": "smollm2", "enc_pubkey": keys.public_b64, "price": 150}
    book = load_nodes(files)
    assert second == {
        "model": "qwen2.5:7b",
        "enc_pubkey": keys.public_b64,
        "price": 150,
        "machineSecret": book.nodes[0].secret,
    }
    assert {n.machine for n in desk_standin.nodes.values()} == {"m1"}
    assert [(n.model, n.code, n.price, n.price_basis) for n in book.nodes] == [
        ("smollm2", "N001", 150, "host"),
        ("qwen2.5:7b", "N002", 150, "host"),
    ]
    assert book.pool_url == desk_standin.url
    for path in (files.nodes_file, files.key_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(files.folder.stat().st_mode) == 0o700

    await register(files, desk_standin, leader)  # again: nothing new
    assert len(desk_standin.registrations) == 2
    assert load_key_pair(files) == keys


async def test_register_without_a_price_takes_the_desks_suggestion(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    await register(files, desk_standin, FakeLeader([H200]))
    assert desk_standin.registrations == [
        {"model": "smollm2", "enc_pubkey": desk_standin.registrations[0]["enc_pubkey"]}
    ]
    (node,) = load_nodes(files).nodes
    assert (node.price, node.price_basis) == (120, "suggested")


@pytest.mark.parametrize(
    ("models", "price", "message"),
    [
        (["llama3"], None, "model 'llama3' is not served by this leader (served: smollm2)"),
        (["has space"], None, "'has space' is not a valid desk model id"),
        ([], 0, "--price 0: a price is 1 to 5000 cents per million tokens"),
        ([], 5001, "--price 5001"),
    ],
)
async def test_register_refuses_bad_input_and_writes_nothing(
    files: DeskFiles, desk_standin: DeskStandin, models: list[str], price: int | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        await register(files, desk_standin, FakeLeader([H200]), models=models, price=price)
    assert desk_standin.registrations == []
    assert not files.folder.exists()


async def test_a_desk_refusal_keeps_the_registrations_before_it(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200, ModelServing("qwen", 1, 0, None, None, None)])
    desk_standin.script(
        "/api/v1/node",
        Fault(200, b'{"secret": "sk-node-0123456789abcdefghijklmnopqrstuv", "code": "N9"}'),
        Fault(503, b'{"error": "full"}'),
    )
    with pytest.raises(Exception, match="the desk refused registration with HTTP 503: full"):
        await register(files, desk_standin, leader)
    assert [n.model for n in load_nodes(files).nodes] == ["smollm2"]


# -- jobs -----------------------------------------------------------------------------------------


async def test_a_plain_job_goes_through_the_leader_and_finishes_with_its_token_counts(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    job_id = desk_standin.add_job("smollm2", PROMPT)
    async with serving(files, desk_standin, leader):
        outcome = await desk_standin.outcome_of(job_id)
    assert outcome.kind == "finish"
    assert outcome.body == {
        "id": job_id,
        "output": ANSWER.output,
        "prompt_tokens": 12,
        "completion_tokens": 5,
    }
    assert leader.job_chats() == [job_request("smollm2", PROMPT, pool_test=False)]
    assert leader.chats[0].max_tokens == 16  # the speed test went first, alone in the slot


async def test_a_sealed_job_is_opened_for_this_node_and_answered(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    job_id = desk_standin.add_job("smollm2", SEALED_PROMPT, sealed=True)
    async with serving(files, desk_standin, leader):
        outcome = await desk_standin.outcome_of(job_id)
    assert outcome.kind == "finish" and outcome.body["completion_tokens"] == 5
    assert [c.messages[0].content for c in leader.job_chats()] == [SEALED_PROMPT]


@pytest.mark.parametrize("tamper", ["envelope_aad", "wrap_aad", "tag", "wrap_tag", "other_key"])
async def test_a_tampered_sealed_job_fails_and_never_reaches_the_engine(
    files: DeskFiles, desk_standin: DeskStandin, tamper: str, caplog: pytest.LogCaptureFixture
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    bad = desk_standin.add_job("smollm2", SEALED_PROMPT, sealed=True, tamper=tamper)  # type: ignore[arg-type]
    good = desk_standin.add_job("smollm2", SEALED_PROMPT, sealed=True)
    with caplog.at_level(logging.INFO, logger="berth.desk"):
        async with serving(files, desk_standin, leader):
            assert (await desk_standin.outcome_of(bad)).body == {"id": bad}
            assert (await desk_standin.outcome_of(good)).kind == "finish"
    assert desk_standin.outcome(bad).kind == "fail"  # type: ignore[union-attr]
    # Only the good one reached the engine, and the bad one was never retried.
    assert [c.messages[0].content for c in leader.job_chats()].count(SEALED_PROMPT) == 1
    assert f"job {bad} (smollm2): the sealed prompt does not open" in caplog.text


async def test_a_pool_test_is_requested_and_answered_with_its_limits(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    async with serving(files, desk_standin, leader):
        await desk_standin.until(lambda: bool(desk_standin.check_requests))
        node = desk_standin.node_for("smollm2")
        await desk_standin.until(
            lambda: node.check is not None and node.check["status"] == "passed"
        )
    assert leader.job_chats() == [job_request("smollm2", CHECK_PROMPT, pool_test=True)]
    assert leader.job_chats()[0].max_tokens == 512 and leader.job_chats()[0].temperature == 0
    accepted = load_nodes(files).nodes[0].check_accepted_at
    assert accepted is not None

    # Accepted less than 12 hours ago: a restarted worker does not ask again.
    before = len(node.pulses)
    async with serving(files, desk_standin, leader):
        # Two pulses: the first, then one 0.3 s later; a request would follow the first.
        await desk_standin.until(lambda: len(node.pulses) >= before + 2)
    assert desk_standin.check_requests == ["smollm2"]


@pytest.mark.parametrize(
    "reply",
    [
        LeaderAnswerError("chat", 502, "engine_error"),
        LeaderAnswerError("chat", 503, "no_ready_deployment"),
        LeaderUnavailableError("/tmp/berth.sock", "ConnectError"),
        Hang(),
        RuntimeError("a bug in the worker's path"),
    ],
)
async def test_an_engine_that_errors_or_does_not_answer_fails_the_job(
    files: DeskFiles, desk_standin: DeskStandin, reply: Exception | Hang
) -> None:
    leader = FakeLeader([H200])
    leader.replies.append(reply)
    await register(files, desk_standin, leader)
    failing = desk_standin.add_job("smollm2", PROMPT)
    after = desk_standin.add_job("smollm2", PROMPT)
    async with serving(files, desk_standin, leader, timings=replace(FAST, job_timeout_s=0.3)):
        assert (await desk_standin.outcome_of(failing)).kind == "fail"
        assert (await desk_standin.outcome_of(after)).kind == "finish"


async def test_a_finish_that_does_not_land_is_reported_failed(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    desk_standin.script("/api/v1/jobs/finish", Fault(500, b'{"error": "database down"}'))
    job_id = desk_standin.add_job("smollm2", PROMPT)
    async with serving(files, desk_standin, leader):
        assert (await desk_standin.outcome_of(job_id)).kind == "fail"


async def test_a_job_for_another_model_fails(files: DeskFiles, desk_standin: DeskStandin) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    job_id = desk_standin.add_job("smollm2", PROMPT)
    desk_standin.jobs[job_id].model = "llama3"
    async with serving(files, desk_standin, leader):
        assert (await desk_standin.outcome_of(job_id)).kind == "fail"
    assert leader.job_chats() == []


async def test_stopping_the_worker_reports_its_running_job_failed(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200])
    leader.replies.append(Hang())
    await register(files, desk_standin, leader)
    job_id = desk_standin.add_job("smollm2", PROMPT)
    async with serving(files, desk_standin, leader):
        await desk_standin.until(lambda: len(leader.job_chats()) == 1)
    assert desk_standin.outcome(job_id).kind == "fail"  # type: ignore[union-attr]


# -- pulses and claims ----------------------------------------------------------------------------


async def test_pulses_describe_the_model_and_follow_busy(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    keys = load_key_pair(files)
    assert keys is not None
    node = desk_standin.node_for("smollm2")
    async with serving(files, desk_standin, leader):
        await desk_standin.until(lambda: any(p["tok_per_s"] is not None for p in node.pulses))
        leader.replies.append(Hang())
        job_id = desk_standin.add_job("smollm2", PROMPT)
        await desk_standin.until(lambda: node.pulses[-1]["busy"])
        leader.release.set()
        await desk_standin.outcome_of(job_id)
        await desk_standin.until(lambda: not node.pulses[-1]["busy"])
    first = node.pulses[0]
    assert first == {
        "chip": "NVIDIA H200",
        "vram_gb": 140.4,
        "vram_used_gb": 2.5,
        "tok_per_s": None,
        "busy": False,
        "slots": 1,
        "models": ["smollm2"],
        "enc_pubkey": keys.public_b64,
    }
    measured = next(p["tok_per_s"] for p in node.pulses if p["tok_per_s"] is not None)
    assert measured > 0


async def test_every_offered_model_pulses_and_lists_all_models(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200, ModelServing("qwen", 2, 0, None, None, None)])
    await register(files, desk_standin, leader)
    async with serving(files, desk_standin, leader, wait_s=5):
        qwen = desk_standin.node_for("qwen")
        await desk_standin.until(lambda: bool(qwen.pulses) and bool(qwen.claim_headers))
        two_model_claims = list(qwen.claim_headers)
        del leader.serving_now["smollm2"]  # the model list changes: a pulse at once
        await desk_standin.until(lambda: qwen.pulses[-1]["models"] == ["qwen"])
    assert qwen.pulses[0]["models"] == ["smollm2", "qwen"]
    assert qwen.pulses[0]["slots"] == 2 and qwen.pulses[0]["chip"] is None
    # Two models offered: no x-ow-wait (the protocol keeps it for one-model hosts).
    assert all("x-ow-wait" not in headers for headers in two_model_claims)


async def test_a_one_model_host_sends_the_wait_header(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    node = desk_standin.node_for("smollm2")
    async with serving(files, desk_standin, leader, wait_s=1):
        await desk_standin.until(lambda: len(node.claim_headers) >= 2)
    assert {h.get("x-ow-wait") for h in node.claim_headers} == {"1"}


async def test_a_model_registered_while_serving_is_offered(
    files: DeskFiles, desk_standin: DeskStandin
) -> None:
    leader = FakeLeader([H200, ModelServing("qwen", 1, 0, None, None, None)])
    await register(files, desk_standin, leader, models=["smollm2"])
    async with serving(files, desk_standin, leader) as worker:
        await desk_standin.until(lambda: bool(desk_standin.node_for("smollm2").pulses))
        await register(files, desk_standin, leader, models=["qwen"])
        job_id = desk_standin.add_job("qwen", PROMPT)
        assert (await desk_standin.outcome_of(job_id)).kind == "finish"
        assert worker.offered == ["smollm2", "qwen"]
    assert desk_standin.node_for("qwen").machine == desk_standin.node_for("smollm2").machine


async def test_a_served_name_that_is_not_a_model_id_is_skipped_with_a_warning(
    files: DeskFiles, desk_standin: DeskStandin, caplog: pytest.LogCaptureFixture
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    leader.extra_names = ["bad name!", "qwen"]
    with caplog.at_level(logging.INFO, logger="berth.desk"):
        async with serving(files, desk_standin, leader) as worker:
            await desk_standin.until(lambda: bool(desk_standin.node_for("smollm2").pulses))
            assert worker.offered == ["smollm2"]
    assert "served model 'bad name!' is not a valid desk model id" in caplog.text
    assert "model qwen is served but not registered with the desk" in caplog.text
    assert caplog.text.count("'bad name!'") == 1  # warned once, not every refresh


# -- a desk or leader in trouble ------------------------------------------------------------------


async def test_a_desk_that_errors_or_answers_garbage_is_retried_after_a_backoff(
    files: DeskFiles, desk_standin: DeskStandin, caplog: pytest.LogCaptureFixture
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    desk_standin.script(
        "/api/v1/jobs/claim",
        Fault(500, b'{"error": "overloaded"}'),
        Fault(200, b"{not json"),
        Fault(200, b'{"model": "smollm2"}'),
        Fault(502, b"<html>bad gateway</html>"),
    )
    desk_standin.script("/api/v1/pulse", Fault(503, b"{}"), Fault(200, b""))
    job_id = desk_standin.add_job("smollm2", PROMPT)
    with caplog.at_level(logging.INFO, logger="berth.desk"):
        async with serving(files, desk_standin, leader):
            assert (await desk_standin.outcome_of(job_id)).kind == "finish"
            await desk_standin.until(lambda: bool(desk_standin.node_for("smollm2").pulses))
    text = caplog.text
    assert "claim failed: the desk refused jobs/claim with HTTP 500: overloaded" in text
    assert "the desk's answer to jobs/claim is malformed: not JSON" in text
    assert "malformed: Object missing required field `id`" in text
    assert "the desk refused jobs/claim with HTTP 502" in text
    assert "pulse failed: the desk refused pulse with HTTP 503" in text


async def test_an_unreachable_desk_is_retried_until_it_answers(
    files: DeskFiles, desk_standin: DeskStandin, caplog: pytest.LogCaptureFixture
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    port = desk_standin.port
    await desk_standin.stop()
    with caplog.at_level(logging.INFO, logger="berth.desk"):
        async with serving(files, desk_standin, leader):
            await asyncio.sleep(0.3)
            job_id = desk_standin.add_job("smollm2", PROMPT)
            await desk_standin.start(port=port)
            assert (await desk_standin.outcome_of(job_id)).kind == "finish"
    assert f"the desk at {desk_standin.url} did not answer" in caplog.text


async def test_a_leader_that_goes_away_stops_the_offer_until_it_is_back(
    files: DeskFiles, desk_standin: DeskStandin, caplog: pytest.LogCaptureFixture
) -> None:
    leader = FakeLeader([H200])
    await register(files, desk_standin, leader)
    node = desk_standin.node_for("smollm2")
    with caplog.at_level(logging.INFO, logger="berth.desk"):
        async with serving(files, desk_standin, leader) as worker:
            await desk_standin.until(lambda: bool(node.pulses))
            leader.available = False
            await desk_standin.until(lambda: worker.offered == [])
            claims = len(node.claim_headers)
            await asyncio.sleep(0.3)
            assert len(node.claim_headers) <= claims + 1  # one claim may have been on its way
            job_id = desk_standin.add_job("smollm2", PROMPT)
            leader.available = True
            assert (await desk_standin.outcome_of(job_id)).kind == "finish"
    assert "the berth leader does not answer" in caplog.text
    assert "nothing is offered until it answers" in caplog.text
    assert caplog.text.count("the berth leader does not answer") == 1


async def test_no_prompt_or_answer_is_ever_logged(
    files: DeskFiles, desk_standin: DeskStandin, caplog: pytest.LogCaptureFixture
) -> None:
    leader = FakeLeader([H200])
    leader.replies.extend([ANSWER, LeaderAnswerError("chat", 400, "invalid_request_error")])
    await register(files, desk_standin, leader)
    jobs = [
        desk_standin.add_job("smollm2", PROMPT),
        desk_standin.add_job("smollm2", PROMPT),
        desk_standin.add_job("smollm2", SEALED_PROMPT, sealed=True),
        desk_standin.add_job("smollm2", SEALED_PROMPT, sealed=True, tamper="tag"),
    ]
    with caplog.at_level(logging.DEBUG):
        async with serving(files, desk_standin, leader):
            for job_id in jobs:
                await desk_standin.outcome_of(job_id)
    assert [desk_standin.outcome(j).kind for j in jobs] == ["finish", "fail", "finish", "fail"]  # type: ignore[union-attr]
    for secret in (PROMPT, SEALED_PROMPT, ANSWER.output, "7f3a", "9c1e"):
        assert secret not in caplog.text
    for path in files.home.root.rglob("*"):
        if path.is_file():
            assert b"7f3a" not in path.read_bytes() and b"9c1e" not in path.read_bytes()


def test_the_wire_uses_the_desks_field_names() -> None:
    from berth.desk.wire import RegisterRequest, encode

    body = msgspec.json.decode(encode(RegisterRequest("m", "K", 10, "sk-node-" + "a" * 32)))
    assert body == {
        "model": "m",
        "enc_pubkey": "K",
        "price": 10,
        "machineSecret": "sk-node-" + "a" * 32,
    }
