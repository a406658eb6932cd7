"""Server-sent event splitting and token-usage extraction: pure functions, no I/O.

The proxy relays an engine's event stream byte for byte. It uses this module for two things
only: to find where complete events end (so that it forwards whole events and can close a
broken stream cleanly), and to read the token counts an engine reports, for metrics.

Framing follows the WHATWG HTML Living Standard, "Server-sent events", section 9.2.5/9.2.6
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):
a line ends with CRLF, LF or a lone CR; a blank line ends an event; ``data`` lines of one event
are joined with LF; lines starting with ``:`` are comments; a stream may begin with a UTF-8 BOM.

Usage shapes come from the OpenAI API reference:

* chat completions, completions and embeddings carry ``usage.prompt_tokens`` and
  ``usage.completion_tokens`` (embeddings have no completion tokens) in the JSON body, or, when
  streaming with ``stream_options.include_usage``, in the last chunk before ``data: [DONE]``;
* the Responses API carries ``usage.input_tokens`` and ``usage.output_tokens`` in the body,
  or, when streaming, in ``response.usage`` of the ``response.completed`` event (also of
  ``response.incomplete`` and ``response.failed``).

Nothing here raises on bad input: a malformed event or body yields ``None``, because a parse
failure may cost a metric but must never disturb the relay.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TypeGuard

# Two consecutive line terminators: the end of an event. A CR directly followed by LF is one
# CRLF terminator, hence the lookaheads; a CR at the very end of the data counts as a lone CR.
_EVENT_END = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r(?!\n))")
_BOM = "\ufeff"
_USAGE_KEY = b'"usage"'
# The last ``"usage": {...}`` object in a JSON text, allowing one level of nested objects
# (``prompt_tokens_details``, ``input_tokens_details`` and the like).
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*(\{(?:[^{}]|\{[^{}]*\})*\})')


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event.

    ``event`` is the event type (``"message"`` when the stream gave none), ``data`` the joined
    ``data`` lines, ``id`` the event's own ``id`` field if it had one, ``retry_ms`` its
    ``retry`` field (milliseconds) if it had a valid one.
    """

    data: str
    event: str = "message"
    id: str | None = None
    retry_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts an engine reported for one request (OpenAI ``usage``)."""

    prompt_tokens: int
    completion_tokens: int


class SSEEventSplitter:
    """Incremental splitter: bytes in as they arrive, complete events out.

    ``feed`` returns the longest prefix of everything fed so far (and not yet returned) that
    ends exactly at an event boundary, as the raw bytes the engine sent: nothing is decoded,
    re-encoded or re-framed, so a multibyte UTF-8 character cut across reads comes out whole.
    The bytes after the last boundary stay pending until more data completes them.
    Concatenating every ``feed`` result and the final ``take_pending()`` gives back exactly
    the input.
    """

    __slots__ = ("_pending", "_scan_from")

    def __init__(self) -> None:
        self._pending = b""
        # Offset in ``_pending`` where the next search for a boundary may start: everything
        # before it was already searched, minus two bytes for a terminator cut by a read.
        self._scan_from = 0

    @property
    def pending_bytes(self) -> int:
        """How many bytes are held back, waiting for the end of their event."""
        return len(self._pending)

    def feed(self, data: bytes) -> bytes:
        """Add ``data``; return the complete events now available (``b""`` if none)."""
        buf = self._pending + data if self._pending else data
        # Engines end every write with an event, so this is the common case.
        if buf.endswith(b"\n\n") or buf.endswith(b"\r\n\r\n"):
            self._pending = b""
            self._scan_from = 0
            return buf
        end = -1
        for match in _EVENT_END.finditer(buf, self._scan_from):
            end = match.end()
        if end < 0:
            self._pending = buf
            self._scan_from = max(0, len(buf) - 2)
            return b""
        self._pending = buf[end:]
        self._scan_from = max(0, len(self._pending) - 2)
        return buf[:end]

    def take_pending(self) -> bytes:
        """Return and forget the held-back bytes (at the end of a stream, or when too large)."""
        pending = self._pending
        self._pending = b""
        self._scan_from = 0
        return pending


def split_events(data: bytes) -> list[bytes]:
    """Split ``data`` (as returned by :meth:`SSEEventSplitter.feed`) into raw events.

    Each item ends with its blank line; bytes after the last boundary, if any, are dropped.
    """
    events: list[bytes] = []
    start = 0
    for match in _EVENT_END.finditer(data):
        events.append(data[start : match.end()])
        start = match.end()
    return events


def parse_event(raw: bytes) -> SSEEvent | None:
    """Interpret one raw event per the SSE spec; ``None`` when it dispatches nothing.

    An event with no ``data`` line dispatches nothing (comments, keep-alives, a stray blank
    line). Invalid UTF-8 is replaced with U+FFFD, as the spec's decoder does.
    """
    text = raw.decode("utf-8", errors="replace")
    if text.startswith(_BOM):
        text = text[1:]
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    data_lines: list[str] = []
    event_type = ""
    event_id: str | None = None
    retry_ms: int | None = None
    for line in text.split("\n"):
        if not line or line[0] == ":":
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data_lines.append(value)
        elif name == "event":
            event_type = value
        elif name == "id":
            if "\0" not in value:
                event_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            retry_ms = int(value)
    if not data_lines:
        return None
    return SSEEvent(
        data="\n".join(data_lines),
        event=event_type or "message",
        id=event_id,
        retry_ms=retry_ms,
    )


def usage_from_event(raw: bytes) -> Usage | None:
    """Token usage carried by one raw event, or ``None``.

    Understands a chat/completions chunk with a non-null ``usage`` and a Responses API event
    whose ``response`` has a ``usage``. Events that cannot mention usage are skipped without
    being parsed, so calling this on every event of a stream is cheap.
    """
    if _USAGE_KEY not in raw:
        return None
    event = parse_event(raw)
    if event is None or event.data == "[DONE]":
        return None
    return usage_from_json(event.data.encode())


def usage_from_json(body: bytes) -> Usage | None:
    """Token usage in a complete JSON response body (or one event's JSON data), or ``None``."""
    try:
        obj = json.loads(body)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return None
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is None:
        response = obj.get("response")
        if isinstance(response, dict):
            usage = response.get("usage")
    return _usage_of(usage)


def usage_from_json_tail(data: bytes) -> Usage | None:
    """Token usage from the last ``"usage": {...}`` object in ``data``, without parsing the rest.

    ``data`` is a whole JSON answer or only its last bytes (for a body too large to keep).
    OpenAI-compatible servers put ``usage`` after ``choices``/``data``, so the last ``"usage"``
    key is the top-level one. This is cheaper than :func:`usage_from_json` on a large answer.
    Best effort: ``None`` when that key is absent, ``null``, cut off or malformed.
    """
    start = data.rfind(_USAGE_KEY)
    if start < 0:
        return None
    found = _USAGE_OBJECT.match(data, start)
    if found is None:
        return None
    try:
        usage = json.loads(found.group(1))
    except ValueError:
        return None
    return _usage_of(usage)


def _usage_of(usage: object) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if not (_is_count(prompt) and _is_count(completion)):
        return None
    return Usage(prompt_tokens=prompt, completion_tokens=completion)


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
