"""The CORS policy of the public listener (pure): which origins are allowed and the headers
that say so; a wildcard never comes with credentials."""

from __future__ import annotations

import pytest

from berth.errors import ConfigError
from berth.http_server.cors import CorsPolicy, cors_origins_problem, parse_origins


@pytest.mark.parametrize(
    ("text", "origins"),
    [
        (None, ()),
        ("", ()),
        ("https://Chat.Example.com/", ("https://chat.example.com",)),
        (
            " https://a.example , http://localhost:3000 ,",
            ("https://a.example", "http://localhost:3000"),
        ),
        ("*", ("*",)),
    ],
)
def test_origins_are_parsed(text: str | None, origins: tuple[str, ...]) -> None:
    assert parse_origins(text) == origins


@pytest.mark.parametrize("text", ["chat.example.com", "https://a.example/path", "https://a b"])
def test_what_is_not_an_origin_is_refused_with_the_reason(text: str) -> None:
    with pytest.raises(ConfigError, match="is not an origin"):
        parse_origins(text)
    assert cors_origins_problem(text) is not None


def test_nothing_is_allowed_by_default() -> None:
    policy = CorsPolicy.from_setting(None)
    assert not policy.enabled
    assert policy.preflight(b"https://a.example", b"POST", None) is None
    assert policy.answer_headers(b"https://a.example") == []


def test_a_listed_origin_is_echoed_with_credentials() -> None:
    policy = CorsPolicy.from_setting("https://a.example")
    headers = dict(policy.preflight(b"https://a.example", b"POST", b"authorization") or [])
    assert headers[b"access-control-allow-origin"] == b"https://a.example"
    assert headers[b"access-control-allow-credentials"] == b"true"
    assert headers[b"access-control-allow-headers"] == b"authorization"
    assert headers[b"vary"] == b"Origin"
    assert policy.preflight(b"https://b.example", b"POST", None) is None
    assert policy.preflight(b"https://a.example", None, None) is None  # not a preflight
    assert policy.answer_headers(b"https://b.example") == []


def test_a_wildcard_never_allows_credentials() -> None:
    policy = CorsPolicy.from_setting("*")
    for headers in (
        policy.preflight(b"https://any.example", b"GET", None) or [],
        policy.answer_headers(b"https://any.example"),
    ):
        values = dict(headers)
        assert values[b"access-control-allow-origin"] == b"*"
        assert b"access-control-allow-credentials" not in values


def test_requested_headers_that_are_not_a_header_list_are_not_echoed() -> None:
    policy = CorsPolicy.from_setting("https://a.example")
    headers = dict(policy.preflight(b"https://a.example", b"POST", b"x\r\ninjected: 1") or [])
    assert b"access-control-allow-headers" not in headers
