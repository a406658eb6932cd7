"""The JSON shapes of the Messages translation (:mod:`.anthropic_chat`,
:mod:`.anthropic_answer`, :mod:`.anthropic_stream`), as types: what it writes, field by field.

Two directions, from the two API references the translation follows (Anthropic's
"Messages" and "Streaming Messages", OpenAI's "Chat Completions"):

* to the engine, a chat completion request (:class:`ChatRequest`) and its messages, content
  parts, tool calls and tools;
* to the client, a Message (:class:`Message`) and its content blocks and usage, whole or as
  the stream's events.

What the translation reads (a client's request, an engine's answer) is untrusted JSON: a
:data:`JsonObject`, every field checked where it is read. These types are for what berth
builds, so a misspelt key or a missing field is mypy's error, not a client's.
"""

from __future__ import annotations

from typing import Literal, NotRequired, Required, TypedDict

#: A JSON object as parsed, before (or without) any check of its fields.
JsonObject = dict[str, object]

# -- a chat completion request (OpenAI) ------------------------------------------------------


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ImageUrl(TypedDict):
    url: str


class ImagePart(TypedDict):
    """An image as a ``data:`` URL (base64) or a URL."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = TextPart | ImagePart


class FunctionCall(TypedDict):
    """A tool call's function; ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class SystemMessage(TypedDict):
    role: Literal["system"]
    content: str


class UserMessage(TypedDict):
    role: Literal["user"]
    content: str | list[ContentPart]


class AssistantMessage(TypedDict):
    """An assistant's turn: its text (``None`` when it only called tools) and its calls."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[ToolCall]]


class ToolMessage(TypedDict):
    """A tool's result, answering the call ``tool_call_id``."""

    role: Literal["tool"]
    tool_call_id: str
    content: str


ChatMessage = SystemMessage | UserMessage | AssistantMessage | ToolMessage


class FunctionSpec(TypedDict):
    """A function the model may call; ``parameters`` is its JSON Schema."""

    name: str
    parameters: JsonObject
    description: NotRequired[str]
    strict: NotRequired[bool]


class ToolSpec(TypedDict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(TypedDict):
    name: str


class NamedToolChoice(TypedDict):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "required", "none"] | NamedToolChoice


class StreamOptions(TypedDict):
    include_usage: bool


class ChatRequest(TypedDict, total=False):
    """A chat completion request as the translation writes it (``model``, ``max_tokens``
    and ``messages`` always; the rest when the Messages request gave them)."""

    model: Required[str]
    max_tokens: Required[int]
    messages: Required[list[ChatMessage]]
    stop: list[str]
    temperature: float
    top_p: float
    top_k: float
    tools: list[ToolSpec]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    stream: bool
    stream_options: StreamOptions


# -- a Message (Anthropic) ----------------------------------------------------------------


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseBlock(TypedDict):
    """A tool call: ``input`` is its arguments as a JSON object (empty when a stream opens
    it: the arguments follow as ``input_json_delta`` events)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: JsonObject


ContentBlock = TextBlock | ToolUseBlock


class Usage(TypedDict, total=False):
    """A Message's token counts (``output_tokens`` always; the input counts once known)."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: Required[int]


class Message(TypedDict):
    """A whole Message; in ``message_start`` its ``content`` is empty and its stop reason
    and sequence ``None``."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
