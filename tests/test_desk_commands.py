"""Which pool, which nodes, and the desk's files: refused early, with the file or flag named."""

from __future__ import annotations

import json
import re

import pytest

from berth.desk.commands import pick_nodes, resolve_pool_url
from berth.desk.sealing import HostKeyPair, b64url_encode
from berth.desk.state import (
    DeskFiles,
    NodeBook,
    RegisteredNode,
    load_key_pair,
    load_nodes,
    load_or_create_key_pair,
    save_nodes,
)
from berth.errors import ConfigError, NotFoundError
from berth.paths import BerthHome

SECRET = "sk-node-" + "b" * 32


@pytest.fixture(autouse=True)
def no_pool_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool URL comes from what each test sets, never from the caller's environment."""
    monkeypatch.delenv("BERTH_DESK_POOL_URL", raising=False)


def registered(home: BerthHome, pool_url: str, *models: str) -> None:
    nodes = [RegisteredNode(model=m, secret=SECRET, code=f"N{i}") for i, m in enumerate(models)]
    save_nodes(DeskFiles(home), NodeBook(pool_url=pool_url, nodes=nodes))


def test_the_pool_is_the_setting_else_the_registered_one(
    home: BerthHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_pool_url(home, None) == "https://owterminal.com"
    assert resolve_pool_url(home, "https://desk.example/") == "https://desk.example"
    registered(home, "https://desk.example", "smollm2")
    assert resolve_pool_url(home, None) == "https://desk.example"
    monkeypatch.setenv("BERTH_DESK_POOL_URL", "https://desk.example")
    assert resolve_pool_url(home, None) == "https://desk.example"


def test_another_pool_than_the_registered_one_is_refused(
    home: BerthHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered(home, "https://desk.example", "smollm2")
    monkeypatch.setenv("BERTH_DESK_POOL_URL", "https://owterminal.com")
    expected = "registered with https://desk.example, not https://owterminal.com (desk_pool_url, "
    with pytest.raises(ConfigError, match=re.escape(expected + "from env)")):
        resolve_pool_url(home, None)


@pytest.mark.parametrize("url", ["ftp://desk.example", "desk.example", "https://"])
def test_a_pool_url_that_is_not_http_is_refused_naming_the_flag(home: BerthHome, url: str) -> None:
    with pytest.raises(ConfigError, match=f"flag --desk-pool-url: invalid desk_pool_url '{url}'"):
        resolve_pool_url(home, url)


def test_nodes_are_picked_by_model(home: BerthHome) -> None:
    files = DeskFiles(home)
    with pytest.raises(ConfigError, match="no model is registered with the desk yet"):
        pick_nodes(load_nodes(files), [])
    registered(home, "https://desk.example", "a", "b")
    book = load_nodes(files)
    assert [n.model for n in pick_nodes(book, [])] == ["a", "b"]
    assert [n.model for n in pick_nodes(book, ["b"])] == ["b"]
    with pytest.raises(NotFoundError, match="registered desk model 'c' not found"):
        pick_nodes(book, ["c"])


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "malformed node file"),
        ('{"nodes": [{"model": "m"}]}', "malformed node file"),
        ('{"nodes": [{"model": "m", "secret": "sk-nope", "code": "N1"}]}',
         "the secret of 'm' is not a node secret"),
    ],
)  # fmt: skip
def test_a_malformed_nodes_file_is_named(home: BerthHome, content: str, problem: str) -> None:
    files = DeskFiles(home)
    files.folder.mkdir(parents=True)
    files.nodes_file.write_text(content)
    with pytest.raises(ConfigError, match=problem) as caught:
        load_nodes(files)
    assert str(files.nodes_file) in str(caught.value)


def test_the_key_file_is_created_once_and_checked(home: BerthHome) -> None:
    files = DeskFiles(home)
    keys = load_or_create_key_pair(files)
    assert load_or_create_key_pair(files) == keys
    stored = json.loads(files.key_file.read_text())
    assert stored == {"private_key": b64url_encode(keys.private_raw),
                      "public_key": keys.public_b64}  # fmt: skip
    stored["public_key"] = HostKeyPair.generate().public_b64
    files.key_file.write_text(json.dumps(stored))
    with pytest.raises(ConfigError, match="the public key does not match the private key"):
        load_key_pair(files)
    files.key_file.write_text('{"private_key": "short", "public_key": "x"}')
    with pytest.raises(ConfigError, match="malformed key file"):
        load_key_pair(files)
