"""Key limits (`berth.vocab.limits`) and tiers (`[tiers.NAME]` in config.toml): values, overrides,
and bad input refused with its reason (and file and line for the config file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from berth.config import Settings, read_tiers, write_config_values
from berth.config_toml import parse_toml
from berth.errors import ConfigError
from berth.paths import BerthHome
from berth.vocab.limits import (
    INHERIT,
    KeyLimits,
    LimitOverrides,
    parse_limit,
    parse_limit_name,
    parse_models,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("600", 600), ("200k", 200_000), ("2M", 2_000_000), ("1g", 10**9), (" 7 ", 7)],
)
def test_a_limit_is_a_whole_number_with_an_optional_multiplier(text: str, value: int) -> None:
    assert parse_limit("tpm", text) == value


def test_unlimited_is_no_limit() -> None:
    assert parse_limit("rpm", "unlimited") is None
    assert parse_limit("rpm", "UNLIMITED") is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("-1", "must not be negative"),
        ("-5k", "must not be negative"),
        ("ten", "must be a whole number"),
        ("1.5", "must be a whole number"),
        ("", "must be a whole number"),
        ("2000000000000000", "must be at most"),
    ],
)
def test_bad_limits_are_refused_with_the_reason_and_the_flag(text: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as caught:
        parse_limit("daily_tokens", text)
    assert str(caught.value).startswith("--daily-tokens: ")


def test_models_are_a_comma_list_or_any() -> None:
    assert parse_models("a, b,a") == frozenset({"a", "b"})
    assert parse_models("*") is None
    for bad in ("", "a,,b", "a,b\x07"):
        with pytest.raises(ConfigError, match="--models"):
            parse_models(bad)


def test_limit_names_read_flags_and_list_the_names_when_unknown() -> None:
    assert parse_limit_name("max-concurrency") == "max_concurrency"
    with pytest.raises(ConfigError, match="limits: rpm, tpm, max_concurrency"):
        parse_limit_name("burst")


def test_overrides_replace_the_tiers_values_and_none_means_no_limit() -> None:
    tier = KeyLimits(rpm=60, tpm=100_000, daily_tokens=1_000_000, models=frozenset({"a"}))
    own = LimitOverrides(rpm=3, tpm=None)

    assert own.apply(tier) == KeyLimits(
        rpm=3, tpm=None, daily_tokens=1_000_000, models=frozenset({"a"})
    )
    assert own.overridden() == ("rpm", "tpm")
    assert LimitOverrides().apply(tier) is tier


def test_overrides_survive_json_and_an_update_can_clear_one() -> None:
    own = LimitOverrides(rpm=3, tpm=None, models=frozenset({"b", "a"}))
    stored = own.to_json()

    assert stored == {"rpm": 3, "tpm": None, "models": ["a", "b"]}
    assert LimitOverrides.from_json(stored, where="x") == own
    changed = own.updated(LimitOverrides(daily_tokens=5), clear=["rpm"])
    assert changed == LimitOverrides(tpm=None, models=frozenset({"a", "b"}), daily_tokens=5)
    assert changed.rpm is INHERIT


def test_stored_overrides_that_do_not_read_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown limit 'burst'"):
        LimitOverrides.from_json({"burst": 1}, where="key k-1")
    with pytest.raises(ConfigError, match="must not be negative"):
        LimitOverrides.from_json({"rpm": -1}, where="key k-1")


# -- [tiers.NAME] ---------------------------------------------------------------------------


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_tiers_come_from_config_beside_the_built_in_three(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        """
[server]
public_port = 11600

[tiers.free]
priority = 10
rpm = 3
tpm = "20k"
daily_tokens = 100000
models = ["smollm2"]

[tiers.admin]
priority = 200
""",
    )
    tiers = read_tiers(path)

    assert list(tiers) == ["admin", "standard", "desk", "free"]  # by priority, highest first
    assert tiers["free"].limits == KeyLimits(
        rpm=3, tpm=20_000, daily_tokens=100_000, models=frozenset({"smollm2"})
    )
    assert (tiers["admin"].priority, tiers["standard"].priority) == (200, 50)
    assert tiers["desk"].priority == 40  # desk jobs: below standard keys
    assert tiers["standard"].limits.unlimited
    assert tiers.require(" FREE ").name == "free"


def test_an_unknown_tier_is_refused_listing_the_tiers(tmp_path: Path) -> None:
    tiers = read_tiers(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=r"unknown tier 'gold'; tiers: admin, standard, desk"):
        tiers.require("gold")


@pytest.mark.parametrize(
    ("body", "line", "reason"),
    [
        ("[tiers.free]\nrpm = -1\n", 2, "rpm must not be negative"),
        ("[tiers.free]\nrpm = 1.5\n", 2, "rpm must be a whole number"),
        ("[tiers.free]\ntpm = 'lots'\n", 2, "tpm must be a whole number"),
        ("[tiers.free]\npriority = 5000\n", 2, "priority must be a whole number from 0 to"),
        ("[tiers.free]\nburst = 3\n", 2, "unknown key 'burst'; valid keys: priority, rpm"),
        ("[tiers.free]\nmodels = 'a'\n", 2, "models must be a list"),
        ("\n[tiers]\nfree = 3\n", 3, "tiers.free must be a table"),
        ("[tiers.Free]\nrpm = 3\n", 1, "tier names are lower case"),
        ("[tiers.free]\nrpm = \n", 2, "invalid TOML"),
    ],
)
def test_a_malformed_tier_names_the_file_and_line(
    tmp_path: Path, body: str, line: int, reason: str
) -> None:
    path = _config(tmp_path, body)
    with pytest.raises(ConfigError, match=reason) as caught:
        read_tiers(path)
    assert caught.value.path == path
    assert caught.value.line == line
    assert str(caught.value).startswith(f"{path}:{line}: ")


def test_settings_refuse_a_malformed_tier_and_carry_good_ones(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "home")
    home.root.mkdir()
    home.config_file.write_text("[tiers.free]\nrpm = 3\n")
    assert Settings.load(home, env={}).tiers["free"].limits.rpm == 3

    home.config_file.write_text("[tiers.free]\nrpm = -3\n")
    with pytest.raises(ConfigError, match=r"config.toml:2: \[tiers.free\]: rpm must not be"):
        Settings.load(home, env={})


def test_the_desk_tier_setting_names_a_tier_that_exists(tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "home")
    home.root.mkdir()
    assert Settings.load(home, env={}).desk_tier == "desk"  # built in
    home.config_file.write_text('[desk]\ndesk_tier = "market"\n\n[tiers.market]\npriority = 5\n')
    assert Settings.load(home, env={}).desk_tier == "market"
    with pytest.raises(ConfigError, match=r"desk_tier \(env\): unknown tier 'gold'; tiers: "):
        Settings.load(home, env={"BERTH_DESK_TIER": "gold"})


def test_changing_a_setting_keeps_the_tiers(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        '[server]\npublic_port = 11600\n\n[tiers.free]\nrpm = 3\nmodels = ["a", "b"]\n',
    )
    write_config_values(path, {"public_port": 11700})

    document, _ = parse_toml(path)
    assert document["server"] == {"public_port": 11700}
    assert document["tiers"] == {"free": {"rpm": 3, "models": ["a", "b"]}}
    assert read_tiers(path)["free"].limits.models == frozenset({"a", "b"})
