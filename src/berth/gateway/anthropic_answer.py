"""An OpenAI chat completion given back as an Anthropic Message: pure, no I/O.

The answer half of the translation (the request's: :mod:`berth.gateway.anthropic_chat`).
:func:`translate_answer` turns a chat completion (its JSON bytes) into a Message: its first
choice's text as a ``text`` block, its tool calls as ``tool_use`` blocks (arguments that are
not a JSON object give ``{}``), ``finish_reason`` as ``stop_reason`` (:func:`stop_reason`),
``usage`` as Anthropic's counts with the cached prompt tokens
(``prompt_tokens_details.cached_tokens``) as ``cache_read_input_tokens``
(:func:`usage_counts`). An engine's ``reasoning_content`` is not given back. The stream's
translation (:mod:`berth.gateway.anthropic_stream`) is built on the same pieces.

Shapes: the Anthropic API reference ("Messages") and OpenAI's ("Chat Completions").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Final, TypeGuard

from berth.gateway.anthropic_chat import Translated
from berth.gateway.anthropic_shapes import ContentBlock, JsonObject, Message, Usage

__all__ = [
    "AnswerNotTranslatableError",
    "message_id",
    "stop_reason",
    "tool_input",
    "translate_answer",
    "usage_counts",
]

# OpenAI's finish reasons and the Anthropic stop reason each is.
_STOP_REASONS: Final = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


class AnswerNotTranslatableError(ValueError):
    """An engine's answer is not a chat completion that can be given back as a Message
    (``why`` says what is wrong with it)."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(why)


def stop_reason(
    finish_reason: object,
    matched: object,
    stop_sequences: Sequence[str],
    *,
    called_tools: bool,
) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for an OpenAI ``finish_reason``.

    ``stop`` is ``end_turn``, or ``stop_sequence`` when ``matched`` (vLLM's ``stop_reason``
    field of the choice: the stop string that ended it) is one of ``stop_sequences``;
    ``length`` is ``max_tokens``; ``tool_calls`` (and the older ``function_call``) is
    ``tool_use``, as is any end of an answer with tool calls (``called_tools``);
    ``content_filter`` is ``refusal``; anything else (``None``) is ``end_turn``.
    """
    if finish_reason == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    if called_tools and finish_reason != "length":
        return "tool_use", None
    reason = _STOP_REASONS.get(finish_reason) if isinstance(finish_reason, str) else None
    return reason or "end_turn", None


def usage_counts(usage: object) -> Usage | None:
    """Anthropic's usage counts for an OpenAI ``usage`` object, ``None`` when it has no
    prompt count: ``input_tokens`` the prompt tokens not read from the cache,
    ``cache_read_input_tokens`` those that were (``prompt_tokens_details.cached_tokens``),
    ``cache_creation_input_tokens`` 0 (no engine says), ``output_tokens`` the completion's."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    if not _is_count(prompt) or not _is_count(completion):
        return None
    details = usage.get("prompt_tokens_details")
    found = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    cached = min(found, prompt) if _is_count(found) else 0
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": completion,
    }


def message_id(chat_id: object, fallback: str) -> str:
    """A Message's ``id`` for the chat completion ``chat_id`` (``fallback`` when it has
    none): ``msg_`` and that id."""
    ident = chat_id if isinstance(chat_id, str) and chat_id else fallback
    return ident if ident.startswith("msg_") else f"msg_{ident}"


def tool_input(arguments: object) -> JsonObject:
    """A tool call's ``arguments`` (JSON text) as a ``tool_use`` block's input: ``{}``
    when they are not a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def translate_answer(data: bytes, translated: Translated, *, fallback_id: str) -> bytes:
    """The Message (compact UTF-8 JSON) for the chat completion ``data`` answering the
    request ``translated``; ``fallback_id`` names it when the completion has no ``id``.

    Raises :class:`AnswerNotTranslatableError` when ``data`` is not a chat completion
    with a choice.
    """
    try:
        answer = json.loads(data)
    except ValueError:
        raise AnswerNotTranslatableError("the engine's answer is not JSON") from None
    if not isinstance(answer, dict):
        raise AnswerNotTranslatableError("the engine's answer is not a JSON object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise AnswerNotTranslatableError("the engine's answer has no choice")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise AnswerNotTranslatableError("the engine's choice has no message")
    content: list[ContentBlock] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            continue
        function = call["function"]
        ident, name = call.get("id"), function.get("name")
        content.append(
            {
                "type": "tool_use",
                "id": ident if isinstance(ident, str) else f"toolu_{len(content)}",
                "name": name if isinstance(name, str) else "",
                "input": tool_input(function.get("arguments")),
            }
        )
    called = any(block["type"] == "tool_use" for block in content)
    reason, sequence = stop_reason(
        choice.get("finish_reason"),
        choice.get("stop_reason"),
        translated.stop_sequences,
        called_tools=called,
    )
    usage = usage_counts(answer.get("usage")) or {"input_tokens": 0, "output_tokens": 0}
    out: Message = {
        "id": message_id(answer.get("id"), fallback_id),
        "type": "message",
        "role": "assistant",
        "model": translated.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
