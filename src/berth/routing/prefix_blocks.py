"""A request's prompt as chained block hashes: what the prefix policy matches (pure).

A chat request (``/v1/chat/completions``) is read as its messages in order: each message is
its role and its content (text parts joined; any other part, such as an image, by its JSON
text), its UTF-8 cut into blocks of at most :data:`BLOCK_BYTES` bytes; a message starts a
new block. A completion request (``/v1/completions``) is its ``prompt`` string cut the same way
(a prompt of token ids: :data:`BLOCK_TOKENS` ids a block). The tools a chat request declares
come first, as one more message: engines render them into the system turn; so does an
Anthropic Messages request's ``system``.

Block ``i``'s hash covers block ``i`` and the hash of block ``i - 1``, so two requests share
their first ``n`` hashes exactly when they share their first ``n`` blocks: a match of ``n``
blocks means the engine that served one has (had) the other's prefix in its cache. The
hashes depend only on the messages, never on a chat template, so they are the same for every
engine. English text is about :data:`CHARS_PER_TOKEN` bytes a token; the policy reports
matches in blocks and in that estimate of tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Bytes (of UTF-8) a block holds: 256 characters of English text, about 64 tokens.
BLOCK_BYTES = 256
#: Token ids a block holds, for a prompt given as token ids.
BLOCK_TOKENS = 64
#: The rough bytes per token used to report a match in tokens.
CHARS_PER_TOKEN = 4
#: Blocks hashed per request at most: a match longer than this counts as this long
#: (4,096 blocks: about a million characters).
MAX_BLOCKS = 4096
_DIGEST_BYTES = 8


@dataclass(frozen=True)
class PromptBlocks:
    """The chained hashes of a prompt's blocks, first block first (64-bit ints), and where
    each block ends, in bytes from the prompt's start (``ends``; for token ids, in ids x
    :data:`CHARS_PER_TOKEN`): ``approx_tokens`` turns a block count into a rough number of
    tokens."""

    hashes: tuple[int, ...]
    ends: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.hashes)

    def approx_tokens(self, blocks: int) -> int:
        """The rough tokens the first ``blocks`` blocks hold."""
        if not self.ends or blocks <= 0:
            return 0
        return self.ends[min(blocks, len(self.ends)) - 1] // CHARS_PER_TOKEN


EMPTY = PromptBlocks(())


def prompt_blocks(payload: Mapping[str, object]) -> PromptBlocks:
    """The blocks of a parsed request body: its ``messages`` (chat), else its ``prompt``
    (completions); :data:`EMPTY` for a body with neither, or one of a shape this does not
    read (the policy then sees no match, and routes by load). Never raises."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts: list[tuple[str, str]] = []
        tools = payload.get("tools")
        if tools:
            parts.append(("tools", _text(tools)))
        system = payload.get("system")  # Anthropic's Messages API keeps it apart
        if system:
            parts.append(("system", _text(system)))
        for message in messages:
            if isinstance(message, Mapping):
                role = message.get("role")
                parts.append((role if isinstance(role, str) else "", _text(message.get("content"))))
        return _chain(parts)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return _chain([("prompt", prompt)])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return _chain_tokens(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return _chain([("prompt", prompt[0])])
    return EMPTY


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                text = part.get("text")
                pieces.append(text if isinstance(text, str) else "")
            else:
                pieces.append(json.dumps(part, sort_keys=True, default=str))
        return "".join(pieces)
    return json.dumps(content, sort_keys=True, default=str)


def _chain(parts: Sequence[tuple[str, str]]) -> PromptBlocks:
    hashes: list[int] = []
    ends: list[int] = []
    previous = b""
    done = 0
    blake2b = hashlib.blake2b
    for role, text in parts:
        data = text.encode("utf-8", "surrogatepass")
        head = role.encode("utf-8", "surrogatepass") + b"\x00"
        # An empty message still takes a block: its role is part of the prefix.
        for start in range(0, max(len(data), 1), BLOCK_BYTES):
            if len(hashes) == MAX_BLOCKS:
                return PromptBlocks(tuple(hashes), tuple(ends))
            block = data[start : start + BLOCK_BYTES]
            done += len(block)
            previous = blake2b(previous + head + block, digest_size=_DIGEST_BYTES).digest()
            hashes.append(int.from_bytes(previous, "big"))
            ends.append(done)
            head = b"\x01"  # a later block of the same message
    return PromptBlocks(tuple(hashes), tuple(ends))


def _chain_tokens(tokens: Sequence[int]) -> PromptBlocks:
    hashes: list[int] = []
    ends: list[int] = []
    previous = b""
    for start in range(0, min(len(tokens), MAX_BLOCKS * BLOCK_TOKENS), BLOCK_TOKENS):
        chunk = tokens[start : start + BLOCK_TOKENS]
        block = ",".join(str(t) for t in chunk).encode()
        digest = hashlib.blake2b(previous + b"tokens\x00" + block, digest_size=_DIGEST_BYTES)
        previous = digest.digest()
        hashes.append(int.from_bytes(previous, "big"))
        ends.append((start + len(chunk)) * CHARS_PER_TOKEN)  # one id is one token
    return PromptBlocks(tuple(hashes), tuple(ends))
