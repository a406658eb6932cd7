"""The worker's client of the leader: a job's chat answer, its limit, and its errors.

The leader's real admin API and proxy are in ``test_desk_cli.py``; here the transport is an
``httpx.MockTransport``, to reach the answers a healthy leader rarely gives.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from berth.desk.errors import LeaderAnswerError, LeaderUnavailableError
from berth.desk.leader import ChatAnswer, LeaderClient, job_request

REQUEST = job_request("smollm2", "hello", pool_test=False)


def client(handler: object) -> LeaderClient:
    return LeaderClient(Path("/nowhere/berth.sock"), transport=httpx.MockTransport(handler))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "answer"),
    [
        ({"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 3,
          "completion_tokens": 4}}, ChatAnswer("hi", 3, 4)),
        ({"choices": [{"message": {"content": "hi"}}]}, ChatAnswer("hi", 0, 0)),
        ({"choices": [{"message": {"content": None}}], "usage": {"prompt_tokens": None}},
         ChatAnswer("", 0, 0)),
    ],
)  # fmt: skip
async def test_the_answer_and_its_token_counts_zero_when_absent(
    body: dict[str, object], answer: ChatAnswer
) -> None:
    sent: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(200, json=body)

    async with client(handler) as leader:
        assert await leader.chat(REQUEST, timeout_s=5) == answer
    assert sent == [b'{"model":"smollm2","messages":[{"role":"user","content":"hello"}],'
                    b'"stream":false}']  # fmt: skip


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (502, b'{"error": {"type": "engine_error", "message": "boom: hello"}}',
         "the leader answered chat with 502 (engine_error)"),
        (404, b'{"error": {"type": "invalid_request_error", "message": "no model"}}',
         "the leader answered chat with 404 (invalid_request_error)"),
        (500, b"<html>", "the leader answered chat with 500 (error)"),
        (200, b"{not json", "the leader answered chat with 200 (malformed answer)"),
        (200, b'{"choices": []}', "the leader answered chat with 200 (an answer without choices)"),
    ],
)  # fmt: skip
async def test_an_error_names_the_status_but_never_the_engines_message(
    status: int, body: bytes, message: str
) -> None:
    async with client(lambda _request: httpx.Response(status, content=body)) as leader:
        with pytest.raises(LeaderAnswerError) as caught:
            await leader.chat(REQUEST, timeout_s=5)
    assert str(caught.value) == message  # an engine may quote the prompt in its message


async def test_no_answer_within_the_limit_is_a_timeout() -> None:
    async def handler(_request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200)

    async with client(handler) as leader:
        with pytest.raises(LeaderAnswerError, match=r"did not answer chat within 0\.2 s"):
            await leader.chat(REQUEST, timeout_s=0.2)


async def test_a_leader_that_is_not_running_is_unavailable() -> None:
    async with LeaderClient(Path("/nonexistent/berth.sock")) as leader:
        with pytest.raises(LeaderUnavailableError, match="start it with: berth daemon start"):
            await leader.served_models()
        with pytest.raises(LeaderUnavailableError):
            await leader.chat(REQUEST, timeout_s=5)
