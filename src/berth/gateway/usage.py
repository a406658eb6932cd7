"""Asking an engine for a stream's token usage when the client did not (the usage ledger
counts every request).

A chat or text completion stream carries its usage only when the request says
``"stream_options": {"include_usage": true}`` (OpenAI API reference, "stream_options"); the
engines berth runs follow it. For a stream that does not ask, :func:`asking_for_usage`
returns the body with it asked, and the relay later takes the extra usage event out of what
the client receives (:func:`berth.gateway.sse.take_usage_event`), so the client's stream is
the engine's minus that event.
"""

from __future__ import annotations

import json
from typing import Any, Final

#: The paths whose streams carry usage only when asked.
USAGE_STREAM_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions"})

_ASK = b',"stream_options":{"include_usage":true}'


def asking_for_usage(
    path: str, body: bytes, payload: dict[str, Any]
) -> tuple[dict[str, Any], bytes] | None:
    """``payload`` (the parsed form of ``body``) asking the engine for usage, as a new dict
    and its bytes, or ``None`` when it need not change: not a stream of
    :data:`USAGE_STREAM_PATHS`, or the client asked itself. ``payload`` is not changed.

    Without a ``stream_options`` the field is written into the body's bytes just before its
    closing brace, the rest untouched (cheap: no JSON is written); with one, the body is
    written again from ``payload`` with ``include_usage`` set.
    """
    if path not in USAGE_STREAM_PATHS or payload.get("stream") is not True:
        return None
    options = payload.get("stream_options")
    if options is None and "stream_options" not in payload:
        end = body.rstrip().rfind(b"}")
        if end > 0:
            # The same object json.loads would make of the new bytes: the field comes last.
            appended = {**payload, "stream_options": {"include_usage": True}}
            return appended, body[:end].rstrip() + _ASK + body[end:]
    if isinstance(options, dict):
        if options.get("include_usage") is True:
            return None
        asked: dict[str, object] = {**options, "include_usage": True}
    else:
        asked = {"include_usage": True}
    rewritten = {**payload, "stream_options": asked}
    return rewritten, _dumps(rewritten)


def _dumps(payload: dict[str, Any]) -> bytes:
    # allow_nan=False: a rewritten body is JSON or nothing (the edge refuses non-finite
    # numbers already; this keeps a rewrite from ever writing Infinity).
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
