"""A Messages API request translated to an OpenAI chat completion request: pure, no I/O.

An engine that serves ``/v1/chat/completions`` but not ``/v1/messages`` (an adopted
endpoint, SGLang) is asked in the chat completion form; its answer is given back in the
Messages form. :func:`translate_request` turns a Messages request (its parsed JSON) into a
chat completion request (:class:`Translated`: the body and what the answer needs of the
request). The answer's translation is :mod:`berth.gateway.anthropic_answer` (whole) and
:mod:`berth.gateway.anthropic_stream` (streamed).

Shapes: the Anthropic API reference ("Messages", "Streaming Messages") and OpenAI's ("Chat
Completions"). What the request may hold, field by field:

* translated: ``model``, ``max_tokens``, ``messages``, ``system`` (a string or text blocks,
  one system message), ``stop_sequences`` (``stop``), ``temperature``, ``top_p``, ``top_k``
  (an extension llama.cpp and vLLM read), ``stream`` (with ``stream_options.include_usage``),
  ``tools`` (client tools: ``function`` tools, ``input_schema`` as ``parameters``),
  ``tool_choice`` (``auto``, ``any`` -> ``required``, ``tool`` -> the named function,
  ``none``; ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``);
* content blocks: ``text``; ``image`` from base64 (a ``data:`` URL) or a URL, as an
  ``image_url`` part; ``tool_use`` (an assistant's ``tool_calls``, its input as JSON
  arguments); ``tool_result`` (a ``tool`` message before the rest of its user turn; text
  content only; ``is_error`` says so in the text, as ``Error: ...``);
* ignored, knowingly: ``metadata``, ``service_tier``, ``inference_geo``, ``speed``,
  ``cache_control`` anywhere (the engine's own prefix cache works without the hint), a
  ``thinking`` of type ``disabled``, a tool's ``eager_input_streaming``, the ``citations``
  of a text block, and ``thinking`` / ``redacted_thinking`` blocks of earlier assistant
  turns (Anthropic's API leaves those out of the context too);
* refused (400 ``not_translated``, naming the field): ``thinking`` enabled, server tools
  (any tool ``type`` but ``custom``), ``document``, ``search_result``, container and server
  tool blocks, an image from the Files API, an image inside a ``tool_result``, and every
  other field (``container``, ``mcp_servers``, ``context_management``, ``output_config``,
  ...). A malformed request is refused 400 ``invalid_request``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final, Literal, NoReturn

from berth.gateway.anthropic_shapes import (
    AssistantMessage,
    ChatMessage,
    ChatRequest,
    ContentPart,
    FunctionSpec,
    ImagePart,
    JsonObject,
    ToolCall,
    ToolChoice,
    ToolMessage,
    ToolSpec,
)
from berth.routing.errors import InvalidRequestError

__all__ = ["NOT_TRANSLATED", "Translated", "translate_request"]

#: The error code of a request that uses what is not translated (400).
NOT_TRANSLATED: Final = "not_translated"

# The request fields translated, those ignored knowingly, and (everything else) refused.
_TRANSLATED: Final = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "tools",
        "tool_choice",
        "thinking",  # only when disabled; checked apart
    }
)
_IGNORED: Final = frozenset({"metadata", "service_tier", "inference_geo", "speed", "cache_control"})
_TOOL_FIELDS: Final = frozenset(
    {"type", "name", "description", "input_schema", "cache_control", "strict"}
)
_TOOL_IGNORED: Final = frozenset({"eager_input_streaming"})
_SAMPLING: Final[tuple[Literal["temperature", "top_p", "top_k"], ...]] = (
    "temperature",
    "top_p",
    "top_k",
)


@dataclass(frozen=True, slots=True)
class Translated:
    """A Messages request as a chat completion request.

    ``body``: the chat completion request, compact UTF-8 JSON; ``chat``: the same parsed (a
    new dict, for a rewriter that sets an engine's model name). ``model``: the model as the
    client named it (the answer names it so). ``stop_sequences``: the client's, to tell a
    stop sequence from the end of a turn in the answer. ``streamed``: it asked for a stream.
    """

    body: bytes
    chat: JsonObject
    model: str
    stop_sequences: tuple[str, ...] = ()
    streamed: bool = False


# -- the request ----------------------------------------------------------------------------


def translate_request(payload: dict[str, object]) -> Translated:
    """The chat completion request for the Messages request ``payload`` (its parsed JSON).

    Raises :class:`InvalidRequestError` (400): code ``not_translated`` for a field or
    block that is not translated (the module docstring lists them; ``param`` names where it
    is), ``invalid_request`` for a request that is malformed.
    """
    for name in payload:
        if name not in _TRANSLATED and name not in _IGNORED:
            _refuse(f"the request field {name!r}", name)
    thinking = payload.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and _type(thinking) == "disabled"):
        _refuse("extended thinking", "thinking")
    model = payload.get("model")
    if not isinstance(model, str):
        raise _invalid("model must be a string", "model")
    max_tokens = payload.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise _invalid("max_tokens must be a whole number", "max_tokens")
    streamed = payload.get("stream") is True
    messages: list[ChatMessage] = []
    system = _system(payload.get("system"))
    if system is not None:
        messages.append({"role": "system", "content": system})
    raw_messages = payload.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _invalid("messages must be a non-empty array", "messages")
    for i, message in enumerate(raw_messages):
        messages.extend(_message(message, f"messages.{i}"))
    chat: ChatRequest = {"model": model, "max_tokens": max_tokens, "messages": messages}
    stops = _stop_sequences(payload.get("stop_sequences"))
    if stops:
        chat["stop"] = list(stops)
    for name in _SAMPLING:
        value = payload.get(name)
        if value is not None:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise _invalid(f"{name} must be a number", name)
            chat[name] = value
    tools = payload.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = payload.get("tool_choice")
    if choice is not None:
        chat["tool_choice"], parallel = _tool_choice(choice)
        if not parallel:
            chat["parallel_tool_calls"] = False
    if streamed:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    body = json.dumps(chat, ensure_ascii=False, separators=(",", ":")).encode()
    return Translated(body, dict(chat), model, stops, streamed)


def _system(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value or None
    if not isinstance(value, list):
        raise _invalid("system must be a string or an array of text blocks", "system")
    texts: list[str] = []
    for i, block in enumerate(value):
        where = f"system.{i}"
        if not isinstance(block, dict) or _type(block) != "text":
            if isinstance(block, dict) and isinstance(block.get("type"), str):
                _refuse(f"a {block['type']!r} block in the system prompt", where)
            raise _invalid("the system prompt's blocks must be text blocks", where)
        texts.append(_text(block, where))
    return "\n".join(texts) or None


def _message(message: object, where: str) -> list[ChatMessage]:
    """The chat messages of one Messages turn: a user turn's tool results come first (as
    ``tool`` messages, which must follow the assistant's tool calls), then its other
    content."""
    if not isinstance(message, dict):
        raise _invalid("a message must be an object", where)
    role = message.get("role")
    content = message.get("content")
    if role not in ("user", "assistant"):
        raise _invalid("a message's role must be 'user' or 'assistant'", f"{where}.role")
    if isinstance(content, str):
        turn: ChatMessage = (
            {"role": "user", "content": content}
            if role == "user"
            else {"role": "assistant", "content": content}
        )
        return [turn]
    if not isinstance(content, list):
        raise _invalid("content must be a string or an array of blocks", f"{where}.content")
    if role == "assistant":
        return [_assistant(content, f"{where}.content")]
    tool_messages: list[ToolMessage] = []
    parts: list[ContentPart] = []
    for i, raw in enumerate(content):
        at = f"{where}.content.{i}"
        kind, block = _block(raw, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            tool_messages.append(_tool_result(block, at))
        else:
            _refuse(f"a {kind!r} content block", at)
    out: list[ChatMessage] = [*tool_messages]
    first = parts[0] if len(parts) == 1 else None
    if first is not None and first["type"] == "text":
        out.append({"role": "user", "content": first["text"]})
    elif parts:
        out.append({"role": "user", "content": parts})
    elif not tool_messages:
        out.append({"role": "user", "content": ""})
    return out


def _assistant(content: list[object], where: str) -> AssistantMessage:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for i, raw in enumerate(content):
        at = f"{where}.{i}"
        kind, block = _block(raw, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_tool_call(block, at))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier turn's thinking: out of the context, as at Anthropic
        else:
            _refuse(f"a {kind!r} block in an assistant turn", at)
    out: AssistantMessage = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        out["tool_calls"] = calls
    elif out["content"] is None:
        out["content"] = ""
    return out


def _block(block: object, where: str) -> tuple[str, JsonObject]:
    """A content block's type, and the block."""
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(block, dict) or not isinstance(kind, str):
        raise _invalid("a content block must be an object with a type", where)
    return kind, block


def _text(block: JsonObject, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _invalid("a text block must have a string text", f"{where}.text")
    return text


def _image(block: JsonObject, where: str) -> ImagePart:
    source = block.get("source")
    if not isinstance(source, dict):
        raise _invalid("an image block must have a source", f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise _invalid("a base64 image needs a media_type and data", f"{where}.source")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        found = source.get("url")
        if not isinstance(found, str):
            raise _invalid("a url image needs a url", f"{where}.source.url")
        url = found
    else:
        _refuse(f"an image from a {kind!r} source", f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_call(block: JsonObject, where: str) -> ToolCall:
    ident, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(ident, str) or not isinstance(name, str):
        raise _invalid("a tool_use block needs an id and a name", where)
    if not isinstance(arguments, dict):
        raise _invalid("a tool_use block's input must be an object", f"{where}.input")
    encoded = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": encoded}}


def _tool_result(block: JsonObject, where: str) -> ToolMessage:
    ident = block.get("tool_use_id")
    if not isinstance(ident, str):
        raise _invalid("a tool_result block needs a tool_use_id", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for i, raw in enumerate(content):
            at = f"{where}.content.{i}"
            kind, inner = _block(raw, at)
            if kind != "text":
                _refuse(f"a {kind!r} block in a tool_result", at)
            texts.append(_text(inner, at))
        text = "\n".join(texts)
    else:
        raise _invalid("a tool_result's content must be a string or blocks", f"{where}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": ident, "content": text}


def _stop_sequences(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _invalid("stop_sequences must be an array of strings", "stop_sequences")
    return tuple(value)


def _tools(value: object) -> list[ToolSpec]:
    if not isinstance(value, list):
        raise _invalid("tools must be an array", "tools")
    out: list[ToolSpec] = []
    for i, tool in enumerate(value):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _invalid("a tool must be an object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            _refuse(f"the server tool {kind!r}", f"{where}.type")
        for name in tool:
            if name not in _TOOL_FIELDS and name not in _TOOL_IGNORED:
                _refuse(f"the tool field {name!r}", f"{where}.{name}")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not isinstance(schema, dict):
            raise _invalid("a tool needs a name and an input_schema object", where)
        function: FunctionSpec = {"name": name, "parameters": schema}
        description, strict = tool.get("description"), tool.get("strict")
        if isinstance(description, str):
            function["description"] = description
        if isinstance(strict, bool):
            function["strict"] = strict
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: object) -> tuple[ToolChoice, bool]:
    """The chat request's ``tool_choice``, and whether the model may call tools in
    parallel (``False``: ``parallel_tool_calls: false``)."""
    if not isinstance(value, dict):
        raise _invalid("tool_choice must be an object", "tool_choice")
    kind = _type(value)
    choice: ToolChoice
    if kind == "auto":
        choice = "auto"
    elif kind == "any":
        choice = "required"
    elif kind == "none":
        choice = "none"
    elif kind == "tool":
        name = value.get("name")
        if not isinstance(name, str):
            raise _invalid("a tool_choice of type 'tool' needs a name", "tool_choice.name")
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise _invalid(f"unknown tool_choice type {kind!r}", "tool_choice.type")
    return choice, value.get("disable_parallel_tool_use") is not True


def _type(value: JsonObject) -> object:
    return value.get("type")


def _refuse(what: str, param: str) -> NoReturn:
    """Raise the 400 for what is not translated."""
    raise InvalidRequestError(
        f"{what} is not supported: this model's engine has no /v1/messages, and berth's "
        "translation to /v1/chat/completions does not carry it",
        code=NOT_TRANSLATED,
        param=param,
    )


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_request", param=param)
