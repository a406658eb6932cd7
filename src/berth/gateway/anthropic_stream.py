"""A chat completion stream translated into a Messages stream: a small sans-I/O state machine.

:class:`ChatToMessagesStream` takes the data of each event of an OpenAI chat completion
stream (``chat.completion.chunk`` JSON, then ``[DONE]``) and returns the bytes of the
Anthropic Messages stream events it makes (the "Streaming Messages" reference)::

    event: message_start        {"message": {..., "content": [], "usage": {0, 0}}}
    event: ping
    event: content_block_start  {"index": 0, "content_block": {"type": "text", "text": ""}}
    event: content_block_delta  {"index": 0, "delta": {"type": "text_delta", "text": ...}}
    event: content_block_stop   {"index": 0}
    event: content_block_start  {"index": 1, "content_block": {"type": "tool_use", ...}}
    event: content_block_delta  {"index": 1, "delta": {"type": "input_json_delta", ...}}
    event: content_block_stop   {"index": 1}
    event: message_delta        {"delta": {"stop_reason", "stop_sequence"}, "usage": {...}}
    event: message_stop

States: nothing sent yet; the message started, with no block open, a text block open, or
a tool_use block open (for the engine's tool call of one ``index``); ended. The first
chunk starts the message (``message_start``, then a ``ping``). A text delta opens a text
block unless one is open; a tool call with a new index closes the open block and opens a
``tool_use`` block (its ``id`` and ``name``, an empty input), and its argument fragments
are ``input_json_delta``\\ s. ``finish_reason`` and the usage chunk are kept for the end:
``[DONE]`` (or :meth:`finish`, at the end of the engine's stream) closes the open block and
sends ``message_delta`` (the stop reason, and the usage: the prompt's tokens are not
known before it, so ``message_start`` counts 0 and ``message_delta`` gives them, as the
Anthropic SDK reads a ``message_delta``'s input counts) and ``message_stop``.

An ``error`` chunk, data that is not JSON, or a stream that ends with no finish reason
ends the stream with Anthropic's ``event: error`` instead. Only choice 0 is read (a
translated request never asks for more); an engine's ``reasoning_content`` is not given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from berth.anthropic_errors import stream_error_event
from berth.gateway.anthropic_answer import message_id, stop_reason, usage_counts
from berth.gateway.anthropic_chat import Translated
from berth.gateway.anthropic_shapes import ContentBlock, JsonObject, Message, Usage

__all__ = ["ChatToMessagesStream"]


def _event(kind: str, payload: Mapping[str, object]) -> bytes:
    """One event of a Messages stream: its name and its data, ``type`` first."""
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class ChatToMessagesStream:
    """Translates one chat completion stream (see the module docstring) answering the
    request ``translated``; ``fallback_id`` names the message when the chunks have no
    ``id``. :meth:`feed` each event's data in order, then :meth:`finish`; both return the
    bytes to send (possibly empty). :attr:`ended`: nothing more will be sent."""

    __slots__ = (
        "_block_kind",
        "_block_tool",
        "_called_tools",
        "_fallback_id",
        "_finish_reason",
        "_matched",
        "_next_index",
        "_started",
        "_translated",
        "_usage",
        "ended",
    )

    def __init__(self, translated: Translated, *, fallback_id: str) -> None:
        self._translated = translated
        self._fallback_id = fallback_id
        self._started = False
        self._block_kind: str | None = None  # "text", "tool_use", or None: no block open
        self._block_tool: object = None  # the engine's index of the open tool call
        self._next_index = 0
        self._finish_reason: object = None
        self._matched: object = None
        self._called_tools = False
        self._usage: Usage | None = None
        self.ended = False

    def feed(self, data: str) -> bytes:
        """The events for one chunk (``data``: one SSE event's data)."""
        if self.ended:
            return b""
        if data.strip() == "[DONE]":
            return self.finish()
        try:
            chunk = json.loads(data)
        except ValueError:
            return self._fail("the engine sent an event that is not JSON")
        if not isinstance(chunk, dict):
            return self._fail("the engine sent an event that is not a JSON object")
        error = chunk.get("error")
        if error is not None and not chunk.get("choices"):
            found = error.get("message") if isinstance(error, dict) else error
            message = found if isinstance(found, str) and found else "the engine failed"
            return self._fail(message)
        out = b"" if self._started else self._start(chunk.get("id"))
        usage = usage_counts(chunk.get("usage"))
        if usage is not None:
            self._usage = usage
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                out += self._choice(choice)
        return out

    def finish(self) -> bytes:
        """The events that end the message (the engine's stream ended); the error event
        when it ended before a finish reason came."""
        if self.ended:
            return b""
        if self._finish_reason is None:
            return self._fail("the engine's stream ended before its answer was finished")
        self.ended = True
        out = self._close_block()
        reason, sequence = stop_reason(
            self._finish_reason,
            self._matched,
            self._translated.stop_sequences,
            called_tools=self._called_tools,
        )
        usage: Usage = self._usage or {"output_tokens": 0}
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out += _event("message_delta", {"delta": delta, "usage": usage})
        return out + _event("message_stop", {})

    # -- inside -------------------------------------------------------------------------------

    def _start(self, chat_id: object) -> bytes:
        self._started = True
        message: Message = {
            "id": message_id(chat_id, self._fallback_id),
            "type": "message",
            "role": "assistant",
            "model": self._translated.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", {"message": message}) + _event("ping", {})

    def _choice(self, choice: JsonObject) -> bytes:
        out = b""
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content")
            if isinstance(text, str) and text:
                out += self._text(text)
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                if isinstance(call, dict):
                    out += self._tool_call(call)
        reason = choice.get("finish_reason")
        if reason is not None:
            self._finish_reason = reason
            self._matched = choice.get("stop_reason")  # vLLM: the stop string that matched
        return out

    def _text(self, text: str) -> bytes:
        out = b""
        if self._block_kind != "text":
            out += self._close_block() + self._open({"type": "text", "text": ""}, "text")
        delta = {"type": "text_delta", "text": text}
        return out + _event("content_block_delta", {"index": self._next_index - 1, "delta": delta})

    def _tool_call(self, call: JsonObject) -> bytes:
        out = b""
        index = call.get("index", 0)
        found = call.get("function")
        function: JsonObject = found if isinstance(found, dict) else {}
        if self._block_kind != "tool_use" or self._block_tool != index:
            ident = call.get("id")
            name = function.get("name")
            block: ContentBlock = {
                "type": "tool_use",
                "id": ident if isinstance(ident, str) and ident else f"toolu_{self._next_index}",
                "name": name if isinstance(name, str) else "",
                "input": {},
            }
            out += self._close_block() + self._open(block, "tool_use")
            self._block_tool = index
            self._called_tools = True
        fragment = function.get("arguments")
        if isinstance(fragment, str) and fragment:
            delta = {"type": "input_json_delta", "partial_json": fragment}
            out += _event("content_block_delta", {"index": self._next_index - 1, "delta": delta})
        return out

    def _open(self, block: ContentBlock, kind: str) -> bytes:
        self._block_kind = kind
        index = self._next_index
        self._next_index += 1
        return _event("content_block_start", {"index": index, "content_block": block})

    def _close_block(self) -> bytes:
        if self._block_kind is None:
            return b""
        self._block_kind = None
        self._block_tool = None
        return _event("content_block_stop", {"index": self._next_index - 1})

    def _fail(self, message: str) -> bytes:
        self.ended = True
        return stream_error_event(message)
