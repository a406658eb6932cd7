"""The credential berth presents to an engine: its own API key, as ``Authorization: Bearer``
(RFC 6750 section 2.1), the form llama.cpp, vLLM and SGLang all check.

A client's credentials (its berth key in ``Authorization``, ``x-api-key`` or ``api-key``,
a cookie) never reach an engine: :func:`with_engine_key` drops them from a header list before
adding the engine's own key, wherever the list came from.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Request header names that carry a client's credentials (lower case, as bytes).
CREDENTIAL_HEADERS = frozenset({b"authorization", b"x-api-key", b"api-key", b"cookie",
                                b"proxy-authorization"})  # fmt: skip


def bearer_header(api_key: str) -> tuple[bytes, bytes]:
    """The ``authorization: Bearer <api_key>`` header, as the pool sends headers.

    Raises :class:`ValueError` for a key that cannot be a header value (not ASCII, or with
    CR, LF or a space).
    """
    if not api_key.isascii() or any(c in api_key for c in "\r\n \t"):
        raise ValueError("an engine API key must be ASCII without blanks")
    return b"authorization", b"Bearer " + api_key.encode("ascii")


def with_engine_key(
    headers: Sequence[tuple[bytes, bytes]], auth: tuple[bytes, bytes] | None
) -> list[tuple[bytes, bytes]]:
    """``headers`` without any client credential (:data:`CREDENTIAL_HEADERS`, names
    compared case-insensitively), plus ``auth`` (from :func:`bearer_header`) when given."""
    kept = [(name, value) for name, value in headers if name.lower() not in CREDENTIAL_HEADERS]
    if auth is not None:
        kept.append(auth)
    return kept
