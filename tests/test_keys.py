"""API keys: secrets, pepper, hashing, tiers, and their life in the store."""

from __future__ import annotations

import re
import stat
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from berth.admin.app import build_admin_app
from berth.admin.keys import build_key_router
from berth.admission.quotas import KeyUse
from berth.config import Settings
from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.keys import (
    generate_secret,
    hash_secret,
    key_prefix,
    load_or_create_pepper,
    validate_key_name,
    verify_secret,
)
from berth.paths import BerthHome
from berth.store import Store
from berth.vocab.limits import KeyLimits
from berth.vocab.records import ApiKeyRecord
from berth.vocab.roles import Tier, parse_tier

# Every test that uses the store runs on SQLite and on PostgreSQL (conftest.py).
pytestmark = pytest.mark.store_engines


@pytest.fixture
def pepper(tmp_path: Path) -> bytes:
    return load_or_create_pepper(tmp_path / "key_pepper")


def test_secrets_are_prefixed_random_and_distinct() -> None:
    secrets = {generate_secret() for _ in range(50)}

    assert len(secrets) == 50
    for secret in secrets:
        assert re.fullmatch(r"sk-berth-[A-Za-z0-9_-]{32}", secret)


def test_display_prefix_is_a_short_start_of_the_secret() -> None:
    secret = generate_secret()

    prefix = key_prefix(secret)

    assert secret.startswith(prefix)
    assert prefix.startswith("sk-berth-")
    assert len(prefix) <= 16


def test_pepper_is_created_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "home" / "key_pepper"

    first = load_or_create_pepper(path)
    second = load_or_create_pepper(path)

    assert len(first) == 32
    assert first == second
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["key_pepper"]


@pytest.mark.parametrize("content", [b"", b"short", b"x" * 33])
def test_damaged_pepper_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "key_pepper"
    path.write_bytes(content)

    with pytest.raises(ConfigError) as caught:
        load_or_create_pepper(path)
    assert caught.value.path == path


# Known answers for hash_secret(secret, pepper) = HMAC-SHA256(key=pepper, msg=UTF-8 secret).
# The first three are RFC 4231 section 4 test cases 1, 2 and 6 (the ones whose data is text);
# the last two were computed with an independent implementation, OpenSSL:
#   printf '%s' SECRET | openssl dgst -sha256 -mac HMAC -macopt hexkey:000102...1f
# (the secret's UTF-8 bytes, printf '\xc3\xa9' for "é"; the pepper is bytes 0x00..0x1f).
PEPPER_0_TO_31 = bytes(range(32))
KNOWN_ANSWERS = [
    pytest.param(
        "Hi There",
        b"\x0b" * 20,
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
        id="rfc4231-case-1",
    ),
    pytest.param(
        "what do ya want for nothing?",
        b"Jefe",
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
        id="rfc4231-case-2",
    ),
    pytest.param(
        "Test Using Larger Than Block-Size Key - Hash Key First",
        b"\xaa" * 131,
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
        id="rfc4231-case-6-long-key",
    ),
    pytest.param(
        "sk-berth-AAAABBBBCCCCDDDDEEEEFFFFGGGGHHHH",
        PEPPER_0_TO_31,
        "4a9ce33e355b39716b02c02f1f56cdf55e374ffe7cd2e699d4c7d5846719825b",
        id="berth-secret-openssl",
    ),
    pytest.param(
        "sk-berth-été",
        PEPPER_0_TO_31,
        "ec105d60ac6e96f26e7c10ebf8d18ae5fc01d7393925d3800991c2158c5aea3f",
        id="utf8-secret-openssl",
    ),
]


@pytest.mark.parametrize(("secret", "pepper", "expected"), KNOWN_ANSWERS)
def test_hash_is_hmac_sha256_of_the_secret_keyed_by_the_pepper(
    secret: str, pepper: bytes, expected: str
) -> None:
    assert hash_secret(secret, pepper) == expected


def test_hash_depends_on_the_pepper_and_hides_the_secret(pepper: bytes) -> None:
    secret = generate_secret()

    digest = hash_secret(secret, pepper)

    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert hash_secret(secret, bytes(32)) != digest
    assert secret not in digest


@pytest.mark.parametrize(
    ("candidate", "expected"),
    [("right", True), ("wrong", False), ("", False), ("right ", False)],
)
def test_verify_secret(pepper: bytes, candidate: str, expected: bool) -> None:
    stored = hash_secret("right", pepper)

    assert verify_secret(candidate, pepper, stored) is expected


@pytest.mark.parametrize(
    ("text", "tier"),
    [("admin", Tier.ADMIN), ("ADMIN", Tier.ADMIN), (" standard ", Tier.STANDARD)],
)
def test_parse_tier(text: str, tier: Tier) -> None:
    assert parse_tier(text) == tier


@pytest.mark.parametrize("text", ["", "-x", "a b", "x" * 33, "gold!"])
def test_an_invalid_tier_name_is_refused_naming_the_built_in_tiers(text: str) -> None:
    with pytest.raises(ConfigError, match="built-in tiers: admin, standard"):
        parse_tier(text)


def test_key_is_found_by_the_hash_of_its_secret_until_revoked(store: Store, pepper: bytes) -> None:
    secret = generate_secret()
    added = store.add_api_key("ci", "standard", hash_secret(secret, pepper), key_prefix(secret))

    found = store.find_api_key(hash_secret(secret, pepper))
    missing = store.find_api_key(hash_secret(generate_secret(), pepper))
    revoked = store.revoke_api_key(added.id)

    assert re.fullmatch(r"k-[0-9a-f]{8}", added.id)
    assert found == added
    assert (added.name, added.tier, added.prefix) == ("ci", Tier.STANDARD, key_prefix(secret))
    assert missing is None
    assert revoked.is_revoked
    assert store.find_api_key(hash_secret(secret, pepper)) is None
    assert store.list_api_keys() == [revoked]
    assert store.revoke_api_key(added.id) == revoked


def test_the_hashes_of_unrevoked_keys_are_listed(store: Store, pepper: bytes) -> None:
    kept = store.add_api_key("kept", Tier.STANDARD, hash_secret("sk-1", pepper), "sk-1")
    gone = store.add_api_key("gone", Tier.STANDARD, hash_secret("sk-2", pepper), "sk-2")
    store.revoke_api_key(gone.id)

    assert kept.id and store.api_key_hashes() == {hash_secret("sk-1", pepper)}


def test_keys_are_listed_oldest_first(store: Store, pepper: bytes) -> None:
    names = ["a", "b", "c"]
    for name in names:
        secret = generate_secret()
        store.add_api_key(name, Tier.ADMIN, hash_secret(secret, pepper), key_prefix(secret))

    assert [k.name for k in store.list_api_keys()] == names


def test_duplicate_hash_is_a_conflict(store: Store, pepper: bytes) -> None:
    digest = hash_secret("same", pepper)
    store.add_api_key("one", Tier.ADMIN, digest, "sk-berth-xxxx")

    with pytest.raises(ConflictError):
        store.add_api_key("two", Tier.ADMIN, digest, "sk-berth-xxxx")


def test_store_refuses_an_invalid_tier_name(store: Store) -> None:
    # Whether a tier exists is the leader's config; the store only refuses a bad name.
    with pytest.raises(ConfigError, match="invalid tier name"):
        store.add_api_key("x", "no such tier", "0" * 64, "sk-berth-xxxx")


def test_revoking_an_unknown_key_is_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError) as caught:
        store.revoke_api_key("k-00000000")
    assert caught.value.ident == "k-00000000"


@pytest.mark.parametrize("name", ["laptop", "ci runner 2", "équipe-7", "x" * 200, "🚀 deploys"])
def test_printable_key_names_are_kept(name: str) -> None:
    assert validate_key_name(name) == name


@pytest.mark.parametrize(
    ("name", "complaint"),
    [
        ("", "empty"),
        ("x" * 201, "at most 200"),
        ("two\nrows", "U\\+000A"),
        ("cr\rlf", "U\\+000D"),
        ("tab\there", "U\\+0009"),
        ("nul\x00", "U\\+0000"),
        ("esc\x1b[2J", "U\\+001B"),
        ("del\x7f", "U\\+007F"),
        ("bidi\u202eevil", "U\\+202E"),
        ("zero\u200bwidth", "U\\+200B"),
        ("line\u2028sep", "U\\+2028"),
        ("nbsp\u00a0", "U\\+00A0"),
        (" padded", "start or end with a space"),
        ("padded ", "start or end with a space"),
    ],
)
def test_unsafe_key_names_are_refused_saying_why(name: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint):
        validate_key_name(name)


def test_the_store_refuses_a_key_name_with_a_newline(store: Store) -> None:
    with pytest.raises(ConfigError, match="key name"):
        store.add_api_key("two\nrows", Tier.STANDARD, "0" * 64, "sk-berth-abcd")
    assert store.list_api_keys() == []


def test_a_key_name_with_a_slash_is_refused_saying_why() -> None:
    with pytest.raises(ConfigError, match="must not contain '/'"):
        validate_key_name("a b/c")


class _Admission:
    """What the key routes ask of admission: no tiers, no use."""

    def update(self, record: object) -> None:
        pass

    def limits_of(self, record: ApiKeyRecord) -> KeyLimits:
        return record.limits.apply(KeyLimits())

    def use_of(self, key_id: str) -> KeyUse:
        return KeyUse(0, 0, 0, None, None)


async def test_a_key_named_with_a_slash_before_the_rule_is_still_changed_and_revoked(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as before_the_rule:
        before_the_rule.setattr("berth.store.api_keys.validate_key_name", lambda name: name)
        old = store.add_api_key("a b/c", Tier.STANDARD, "1" * 64, "sk-berth-abcd")
    tiers = Settings.load(BerthHome(tmp_path / "home")).tiers
    authenticator = SimpleNamespace(forget=lambda ids: None)
    keys = build_key_router(store, _Admission(), authenticator, b"p" * 32, tiers)  # type: ignore[arg-type]
    app = build_admin_app([keys], tiers=tiers)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://berth") as http:
        changed = await http.patch("/admin/keys/a%20b%2Fc", json={"rpm": 5})
        misspelt = await http.patch("/admin/keys/a%20b%2Fc", json={"rpmm": 7})
        revoked = await http.delete("/admin/keys/a%20b%2Fc")
        unknown = await http.delete("/admin/keys/no%2Fsuch")

    assert changed.status_code == 200, changed.text
    assert changed.json()["limits"]["rpm"] == 5
    # A field the request does not have is refused, not ignored (and nothing changes).
    assert misspelt.status_code == 400, misspelt.text
    assert misspelt.json()["error"]["message"] == "rpmm: no such field in this request"
    assert misspelt.json()["error"]["param"] == "rpmm"
    assert store.lookup_api_key(old.id).limits.rpm == 5
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["id"] == old.id and revoked.json()["revoked_at"] is not None
    assert unknown.status_code == 404
    assert "no/such" in unknown.json()["error"]["message"]
    assert unknown.json()["error"]["code"] == "api_key_not_found"
