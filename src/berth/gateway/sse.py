"""Server-sent event splitting and token-usage extraction: pure functions, no I/O.

The proxy relays an engine's event stream byte for byte. It uses this module for three
things only: to find where complete events end (so that it forwards whole events and can
close a broken stream cleanly), to read the token counts an engine reports (for metrics and
the usage ledger), and to take out the usage event berth asked for on a client's behalf
(:func:`take_usage_event`).

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
  ``response.incomplete`` and ``response.failed``);
* the prompt tokens read from a cache, where an engine says, are ``cached_tokens`` in the
  usage's ``prompt_tokens_details`` (``input_tokens_details`` for the Responses API):
  :class:`Usage`'s ``cached_tokens``, a part of its ``prompt_tokens``.

Anthropic's Messages API (its reference, "Messages" and "Streaming Messages") counts input
apart from the cache: ``usage.input_tokens`` (not cached), ``cache_read_input_tokens`` and
``cache_creation_input_tokens``, and ``output_tokens``; in the body, or, streamed, in
``message_start``'s ``message.usage`` (the input, a first output count) and then
``message_delta``'s ``usage`` (the output so far; some engines repeat the input there).
:func:`messages_usage` and :func:`messages_stream_usage` read that form into the same
:class:`Usage`, whose ``prompt_tokens`` is then every input token, cached or not (what
OpenAI's ``prompt_tokens`` counts too), and ``cached_tokens`` the cache's share.

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
_USAGE_OPENS = re.compile(rb'"usage"\s*:\s*\{')
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
# A count inside a usage object; "prompt_tokens_details" and the like do not match.
_TOKEN_COUNT = re.compile(
    rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens)"\s*:\s*(\d+)'
)

# The prompt tokens read from a cache: ``prompt_tokens_details`` (chat, completions) or
# ``input_tokens_details`` (Responses) of a usage object.
_CACHED_COUNT = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')

# A count inside a Messages API usage object.
_MESSAGES_COUNT = re.compile(
    rb'"(input_tokens|output_tokens|cache_read_input_tokens|cache_creation_input_tokens)"'
    rb"\s*:\s*(\d+)"
)


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
    """Token counts an engine reported for one request (OpenAI ``usage``; for the Messages
    API, ``prompt_tokens`` is its input, cache reads and writes included, and
    ``cached_tokens`` the ``cache_read_input_tokens`` among them)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


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
        if b"\r" in buf:
            end = -1
            for match in _EVENT_END.finditer(buf, self._scan_from):
                end = match.end()
        else:  # LF-only line ends (every engine): a plain search does
            end = buf.rfind(b"\n\n", self._scan_from)
            if end >= 0:
                end += 2
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
    if b"\r" not in data:  # LF-only line ends (every engine): a plain split does
        return [event + b"\n\n" for event in data.split(b"\n\n")[:-1]]
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
    if event is None:
        return None
    return find_usage(event.data.encode())


def last_usage(events: bytes) -> Usage | None:
    """The usage reported by the last event in ``events`` (complete events) that has one.

    Only the events around a ``"usage"`` key are looked at, newest first.
    """
    if b"\r" in events:
        for raw in reversed(split_events(events)):
            usage = usage_from_event(raw)
            if usage is not None:
                return usage
        return None
    at = events.rfind(_USAGE_KEY)
    while at >= 0:
        boundary = events.rfind(b"\n\n", 0, at)
        begin = boundary + 2 if boundary >= 0 else 0
        end = events.find(b"\n\n", at)
        usage = usage_from_event(events[begin : end + 2 if end >= 0 else len(events)])
        if usage is not None:
            return usage
        at = events.rfind(_USAGE_KEY, 0, begin)
    return None


def has_usage_object(events: bytes) -> bool:
    """Whether ``events`` may hold a usage object (not a ``null`` one): one substring search
    for ``"usage"``, and a look at what follows each one found, so the relay can ask it of
    every piece of a stream."""
    at = events.find(_USAGE_KEY)
    while at >= 0:
        after = events[at + 7 : at + 10]  # len(b'"usage"') == 7
        if after.startswith((b":{", b": {")):
            return True
        at = events.find(_USAGE_KEY, at + 7)
    return False


def take_usage_event(events: bytes) -> tuple[bytes, Usage | None]:
    """``events`` (complete events, as :meth:`SSEEventSplitter.feed` returns them) without
    the chunk of a chat or completion stream that carries only usage, and that usage.

    That chunk is what an engine adds for ``stream_options.include_usage`` (the OpenAI API
    reference: "an additional chunk ... before the data: [DONE] message", whose ``choices``
    is empty and whose ``usage`` holds the request's counts), so the proxy removes it from
    the stream of a client that did not ask for it. Only an event with an empty
    ``choices`` and a usage object is removed; when the usage rides on a chunk that also
    carries text or a finish reason (some engines' completions streams), the events are
    returned unchanged with that usage. ``(events, None)`` when there is none.
    """
    if b"\r" in events:
        raws = split_events(events)
        for index in range(len(raws) - 1, -1, -1):
            usage = usage_from_event(raws[index])
            if usage is not None:
                if _NO_CHOICES.search(raws[index]):
                    return b"".join(raws[:index] + raws[index + 1 :]), usage
                return events, usage
        return events, None
    at = events.rfind(_USAGE_KEY)
    while at >= 0:
        boundary = events.rfind(b"\n\n", 0, at)
        begin = boundary + 2 if boundary >= 0 else 0
        end = events.find(b"\n\n", at)
        end = end + 2 if end >= 0 else len(events)
        raw = events[begin:end]
        usage = find_usage(raw)  # the event's own bytes: no need to decode its data lines
        if usage is not None:
            if _NO_CHOICES.search(raw):
                return events[:begin] + events[end:], usage
            return events, usage
        at = events.rfind(_USAGE_KEY, 0, begin)
    return events, None


def usage_from_json(body: bytes) -> Usage | None:
    """Token usage in a complete JSON response body (or one event's JSON data), or ``None``.

    Parses the whole document: exact, and the reference :func:`find_usage` is tested against.
    """
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


def find_usage(data: bytes) -> Usage | None:
    """Token usage from the last ``"usage": {...}`` object in ``data``, found without parsing.

    ``data`` is a JSON answer, the last bytes of one too large to keep, or one event's data.
    OpenAI-compatible servers put ``usage`` after ``choices``/``data``/``output``, so the last
    ``"usage"`` key is the one that counts. This scans for the counts (a few microseconds where
    parsing a whole answer takes tens), so the proxy uses it on every answer. Best effort:
    ``None`` when that key is absent, ``null``, cut off or has no prompt/input count.
    """
    start = data.rfind(_USAGE_KEY)
    found = _usage_object(data, start, _TOKEN_COUNT) if start >= 0 else None
    if found is None:
        return None
    counts, end = found
    prompt = counts.get(b"prompt_tokens", counts.get(b"input_tokens"))
    if prompt is None:
        return None
    completion = counts.get(b"completion_tokens", counts.get(b"output_tokens", 0))
    cached = _CACHED_COUNT.search(data, start, end)
    cached_tokens = min(int(cached.group(1)), prompt) if cached is not None else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached_tokens)


def messages_usage(data: bytes) -> Usage | None:
    """Token usage of a Messages API answer (its JSON body, or the last bytes of one), from
    its last ``"usage": {...}`` object, found without parsing as :func:`find_usage` does;
    ``None`` when that object is absent, cut off, or counts no input."""
    start = data.rfind(_USAGE_KEY)
    return _messages_counts(data, start, None) if start >= 0 else None


def messages_stream_usage(events: bytes, previous: Usage | None) -> Usage | None:
    """The usage of a Messages stream so far: ``previous`` (what its earlier events said)
    updated by every usage object in ``events`` (complete events, as
    :meth:`SSEEventSplitter.feed` returns them), in order. A count an event gives replaces
    the one before it (Anthropic's counts are cumulative); one it leaves out (the input, in
    a ``message_delta``) stays. ``None`` while no input was counted."""
    usage = previous
    at = events.find(_USAGE_KEY)
    while at >= 0:
        usage = _messages_counts(events, at, usage) or usage
        at = events.find(_USAGE_KEY, at + 7)
    return usage


def _usage_object(
    data: bytes, start: int, count: re.Pattern[bytes]
) -> tuple[dict[bytes, int], int] | None:
    """The token counts ``count`` finds (name, then number) in the usage object whose
    ``"usage"`` key is at ``start`` in ``data``, the first of each name, and where the object
    ends; ``None`` when no whole object follows the key."""
    opens = _USAGE_OPENS.match(data, start)
    if opens is None:
        return None
    end = _object_end(data, opens.end() - 1)
    if end < 0:
        return None
    counts: dict[bytes, int] = {}
    for found in count.finditer(data, start, end):
        counts.setdefault(found.group(1), int(found.group(2)))
    return counts, end


def _messages_counts(data: bytes, start: int, previous: Usage | None) -> Usage | None:
    """``previous`` updated by the Messages usage object whose ``"usage"`` key is at
    ``start`` in ``data``; ``None`` when there is none there or no input is known."""
    found = _usage_object(data, start, _MESSAGES_COUNT)
    if found is None:
        return None
    counts, _ = found
    completion = counts.get(b"output_tokens")
    if previous is not None and completion is None:
        completion = previous.completion_tokens
    if b"input_tokens" in counts:
        cached = counts.get(b"cache_read_input_tokens", 0)
        written = counts.get(b"cache_creation_input_tokens", 0)
        prompt = counts[b"input_tokens"] + cached + written
    elif previous is not None:
        prompt, cached = previous.prompt_tokens, previous.cached_tokens
    else:
        return None
    return Usage(prompt_tokens=prompt, completion_tokens=completion or 0, cached_tokens=cached)


def _object_end(data: bytes, opening: int) -> int:
    """The offset just past the ``}`` closing the object opened at ``opening``, or -1.

    Counts braces only, which is right for a usage object: numbers and nested objects, no
    strings that could hold a brace.
    """
    depth = 0
    pos = opening
    while True:
        close = data.find(b"}", pos)
        if close < 0:
            return -1
        nested = data.find(b"{", pos, close)
        if nested >= 0:
            depth += 1
            pos = nested + 1
            continue
        depth -= 1
        pos = close + 1
        if depth == 0:
            return pos


def _usage_of(usage: object) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if not (_is_count(prompt) and _is_count(completion)):
        return None
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached_tokens = min(cached, prompt) if _is_count(cached) else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached_tokens)


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
