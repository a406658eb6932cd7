"""Anthropic's Messages API on real parts: the Anthropic SDK against a real leader (real CLI,
daemon, TLS) in front of llama.cpp's llama-server on SmolLM2, which serves ``/v1/messages``
itself; berth passes it through, and its usage ledger counts what the engine reported."""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import anthropic
import pytest

from support.berth_cli import Berth
from test_e2e_leader import deployment, real_leader

pytestmark = [pytest.mark.slow, pytest.mark.needs("llama-server", "smollm2")]

__all__ = ["deployment", "real_leader"]  # the module fixtures, reused

ASK = {
    "model": "smollm2",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "Count to three."}],
}


def client_for(berth: Berth, port: int, key: str) -> anthropic.Anthropic:
    """The SDK pointed at the leader: its base URL (the SDK adds ``/v1/messages``), a key,
    and berth's CA for TLS."""
    tls = ssl.create_default_context(cafile=str(berth.home / "ca" / "ca.pem"))
    return anthropic.Anthropic(
        base_url=f"https://127.0.0.1:{port}",
        api_key=key,
        http_client=anthropic.DefaultHttpxClient(verify=tls),
        max_retries=0,
    )


@pytest.fixture(scope="module")
def claude(
    real_leader: tuple[Berth, int], deployment: dict[str, object]
) -> Iterator[anthropic.Anthropic]:
    berth, port = real_leader
    secret = berth.json("key", "create", "anthropic")["secret"]  # type: ignore[index]
    with client_for(berth, port, secret) as client:
        yield client


def test_create_stream_and_count_tokens_are_what_llama_server_answers_and_are_counted(
    real_leader: tuple[Berth, int], claude: anthropic.Anthropic
) -> None:
    berth, _port = real_leader
    whole = claude.messages.create(**ASK)  # type: ignore[arg-type]
    with claude.messages.stream(**ASK) as stream:  # type: ignore[arg-type]
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    counted = claude.messages.count_tokens(model="smollm2", messages=ASK["messages"])  # type: ignore[arg-type]

    assert whole.type == "message" and whole.stop_reason in ("max_tokens", "end_turn")
    assert whole.content[0].text  # type: ignore[union-attr]
    assert texts and "".join(texts) == final.content[0].text  # type: ignore[union-attr]

    def prompt(usage: anthropic.types.Usage) -> int:
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)

    # llama-server tokenises the same prompt for count_tokens as for a message.
    assert counted.input_tokens == prompt(whole.usage) == prompt(final.usage)
    (row,) = berth.json("usage", "--key", "anthropic", "--by", "key")["rows"]  # type: ignore[index]
    assert row["requests"] == 3 and row["estimated_requests"] == 0
    assert row["prompt_tokens"] == prompt(whole.usage) + prompt(final.usage)
    assert row["completion_tokens"] == whole.usage.output_tokens + final.usage.output_tokens


def test_a_wrong_key_a_missing_model_and_a_keys_limit_raise_the_sdks_errors(
    real_leader: tuple[Berth, int], claude: anthropic.Anthropic
) -> None:
    berth, port = real_leader
    with (
        client_for(berth, port, "sk-berth-not-a-key") as wrong,
        pytest.raises(anthropic.AuthenticationError) as bad_key,
    ):
        wrong.messages.create(**ASK)  # type: ignore[arg-type]
    with pytest.raises(anthropic.NotFoundError) as no_model:
        claude.messages.create(**{**ASK, "model": "no-such-model"})  # type: ignore[arg-type]
    secret = berth.json("key", "create", "one-a-minute", "--rpm", "1")["secret"]  # type: ignore[index]
    with client_for(berth, port, secret) as limited:
        limited.messages.create(**ASK)  # type: ignore[arg-type]
        with pytest.raises(anthropic.RateLimitError) as limit:
            limited.messages.create(**ASK)  # type: ignore[arg-type]

    assert bad_key.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert no_model.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert limit.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(limit.value.response.headers["retry-after"]) >= 1
