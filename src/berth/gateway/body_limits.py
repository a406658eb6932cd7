"""What a request body may hold beyond its size: its JSON elements, counted as it arrives,
and its messages and content parts, counted once it is parsed.

Parsing costs per element far more than per byte. A 16.5 MB body of five million empty
arrays (``{"model":"x","messages":[[],[],...]}``) took about 390 MB and 1.5-3.5 s of the
event loop to parse, mostly in the garbage collector; a 16 MB prompt of text takes a few
tens of milliseconds. So the byte bound (``max_body_bytes``) does not bound what a body
costs, and the request path bounds its elements before it parses anything:

- :class:`ElementCounter` counts a JSON text's elements chunk by chunk as the body arrives,
  without parsing it: each comma and each opening bracket outside strings, which is one per
  array item and object member, and one per array or object (``[[],[]]`` counts 4). Strings
  are told apart by their quotes once the escapes are taken out, so commas and brackets in
  a prompt do not count. Every step is a C-speed bytes operation (``replace``, ``split``,
  ``count``) over one chunk, so a body is refused as soon as its count passes the limit,
  after about one chunk's work beyond it, and the rest of it is never held.
- :func:`check_shape` counts the messages of a parsed body and the content parts of each
  message, for the paths that take messages.

A body of at most ``max_elements`` bytes cannot hold more elements than that (each needs a
byte), so it is never counted: the small requests of the hot path pay nothing here.

The limits are :class:`BodyLimits`, from the ``[server]`` settings ``max_body_elements``,
``max_messages`` and ``max_content_parts``; a body over one is answered 413 with the limit
and the setting named (:class:`~berth.routing.errors.InvalidRequestError`, codes
``too_many_elements``, ``too_many_messages``, ``too_many_content_parts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from berth.routing.errors import InvalidRequestError

__all__ = ["BodyLimits", "ElementCounter", "check_shape", "too_many_elements"]

#: The paths whose body's ``messages`` are a conversation (OpenAI's chat completions,
#: Anthropic's Messages and its token count), and the one whose ``input`` may be a list of
#: items that each may have content parts (OpenAI's Responses).
_MESSAGES_PATHS: Final = frozenset(
    {"/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"}
)
_INPUT_PATHS: Final = frozenset({"/v1/responses"})


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """The bounds on one request body's structure (its size is ``max_body_bytes``'s).

    ``max_elements``: JSON elements (see the module doc for how they are counted), 500,000
    by default: an embeddings batch at OpenAI's limit of 300,000 tokens summed over its
    inputs, sent as token ids, fits, and such a body parses in about 30-100 ms here.
    ``max_messages``: messages of a chat completion or a Messages request, or items of a
    Responses request's ``input``; 100,000, Anthropic's documented limit for one Messages
    request. ``max_content_parts``: content parts of one message (text, image, audio, file
    parts); 10,000, far above the hundreds of images the hosted APIs take in one request.
    """

    max_elements: int = 500_000
    max_messages: int = 100_000
    max_content_parts: int = 10_000


def too_many_elements(limit: int) -> InvalidRequestError:
    """The 413 for a body of more than ``limit`` elements."""
    return InvalidRequestError(
        f"the request body has more than {limit} JSON elements (array items and object "
        "members), the server's max_body_elements",
        code="too_many_elements",
        status=413,
    )


class ElementCounter:
    """Counts a JSON text's elements from its bytes, fed in order in chunks of any size
    (:meth:`feed`); :attr:`count` is the elements so far. Pure: no I/O, no clock.

    ``utf8``: the text is UTF-8 (RFC 8259's encoding for JSON between systems), in which
    the bytes of quotes, backslashes, commas and brackets are those characters and nothing
    else, so strings are told apart. ``False`` (UTF-16 or -32, which the parser also
    reads): every comma and bracket byte counts, strings and code units of other
    characters too, which can only count more.

    The text need not be valid JSON: an invalid one is counted somehow and refused by the
    parser later. The state carried from one chunk to the next is whether it ends inside a
    string, and whether it ends on the backslash of an escape whose letter comes next.
    """

    __slots__ = ("_escaped", "_in_string", "_utf8", "count")

    def __init__(self, *, utf8: bool = True) -> None:
        self.count = 0
        self._utf8 = utf8
        self._in_string = False
        self._escaped = False

    def feed(self, chunk: bytes) -> int:
        """Count ``chunk``, the next bytes of the text; the elements so far."""
        if not self._utf8:
            self.count += _structural(chunk)
            return self.count
        data = chunk
        if self._escaped:  # its first byte is the letter of an escape the last one began
            data = data[1:]
            self._escaped = False
        if b"\\" in data:
            # Escapes are read left to right: an escaped backslash first, then every
            # backslash left begins a one-letter (or \uXXXX) escape, and an escaped quote
            # is the only one that matters. Neither holds a comma or a bracket.
            data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
            if data.endswith(b"\\"):
                self._escaped = True
                data = data[:-1]
        if b'"' not in data:
            if not self._in_string:
                self.count += _structural(data)
            return self.count
        pieces = data.split(b'"')  # quotes now only open and close strings
        outside = pieces[1::2] if self._in_string else pieces[0::2]
        if len(pieces) % 2 == 0:  # an odd number of quotes: it ends on the other side
            self._in_string = not self._in_string
        self.count += _structural(b"".join(outside))
        return self.count


def _structural(data: bytes) -> int:
    return data.count(b",") + data.count(b"[") + data.count(b"{")


def check_shape(path: str, body: dict[str, Any], limits: BodyLimits, elements: int) -> None:
    """Refuse a parsed body of ``path`` with more messages than ``limits.max_messages``, or
    a message with more content parts than ``limits.max_content_parts`` (413).

    ``elements`` is a bound on the body's elements (its count, or its size in bytes): no
    message can have more parts than that, so the messages are not looked at one by one
    when it is within the parts' limit.
    """
    if path in _MESSAGES_PATHS:
        field = "messages"
    elif path in _INPUT_PATHS:
        field = "input"
    else:
        return
    messages = body.get(field)
    if not isinstance(messages, list):
        return
    if len(messages) > limits.max_messages:
        raise InvalidRequestError(
            f"the request has {len(messages)} {field}, more than the server's limit of "
            f"{limits.max_messages} (max_messages)",
            code="too_many_messages",
            param=field,
            status=413,
        )
    cap = limits.max_content_parts
    if elements <= cap:
        return
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and len(content) > cap:
            raise InvalidRequestError(
                f"{field}[{index}] has {len(content)} content parts, more than the "
                f"server's limit of {cap} (max_content_parts)",
                code="too_many_content_parts",
                param=f"{field}[{index}].content",
                status=413,
            )
