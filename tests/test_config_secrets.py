"""Settings marked secret never reach an error, a log line or ``berth config show``.

The marked ones (``SettingDef.mask``): ``database_url`` (its password), ``cluster_secret``
and ``tracing_headers`` (the values). Each is given a value that is refused (a
``cluster_secret`` of 15 characters, a malformed URL, a header pair without ``=``) through
a flag-like call, the environment and ``config.toml``; the error names the setting and why,
and holds nothing of the secret. ``tests/test_secrets_run.py`` greps a whole run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from berth.config import Settings, convert_setting
from berth.config.table import SETTINGS
from berth.errors import ConfigError, StoreError
from berth.paths import BerthHome
from berth.redact import mask_url_password, quoted_url
from berth.store import Store

#: 15 characters: one short of the shortest cluster_secret.
SHORT_SECRET = "Zq8-short-15chr"
PASSWORD = "pw-Hunter2/x@y:z"


def test_the_secret_settings_are_marked() -> None:
    assert {d.name for d in SETTINGS if d.secret} == {
        "database_url",
        "cluster_secret",
        "tracing_headers",
    }


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql+psycopg://berth:hunter2@db.lan/berth", "postgresql+psycopg://berth:***@db.lan/berth"),
        # SQLAlchemy reads a password up to the last "@": all of it is masked.
        (f"postgresql+psycopg://berth:{PASSWORD}@db.lan:5432/berth",
         "postgresql+psycopg://berth:***@db.lan:5432/berth"),
        ("error for 'postgresql://u:p@h/db': refused",
         "error for 'postgresql://u:***@h/db': refused"),
        ("sqlite:////srv/berth/berth.db", "sqlite:////srv/berth/berth.db"),
        ("postgresql+psycopg://berth@db.lan/berth", "postgresql+psycopg://berth@db.lan/berth"),
    ],
)  # fmt: skip
def test_a_urls_password_is_masked(text: str, shown: str) -> None:
    assert mask_url_password(text) == shown


def test_a_url_too_malformed_to_mask_is_not_quoted() -> None:
    assert "hunter2" not in quoted_url("postgresql+psycopg:berth:hunter2@db/berth")
    assert quoted_url("sqlite:///x.db") == "'sqlite:///x.db'"


@pytest.mark.parametrize(
    ("name", "raw", "secret"),
    [
        ("cluster_secret", SHORT_SECRET, SHORT_SECRET),
        ("tracing_headers", "authorization=Bearer%20tok-123,broken", "tok-123"),
    ],
)
def test_a_refused_secret_is_not_echoed_in_its_error(name: str, raw: str, secret: str) -> None:
    with pytest.raises(ConfigError) as refused:
        convert_setting(name, raw, where=f"environment variable BERTH_{name.upper()}",
                        relative_to=Path.cwd())  # fmt: skip
    message = str(refused.value)
    assert name in message and "***" in message
    assert secret not in message


def test_a_short_cluster_secret_in_config_toml_names_file_and_line_not_the_secret(
    tmp_path: Path,
) -> None:
    home = BerthHome(tmp_path / "home")
    home.root.mkdir()
    home.config_file.write_text(f'[store]\nleader_ha = true\ncluster_secret = "{SHORT_SECRET}"\n')
    with pytest.raises(ConfigError) as refused:
        Settings.load(home, env={})
    message = str(refused.value)
    assert str(home.config_file) in message and ":3" in message
    assert "at least 16 characters" in message
    assert SHORT_SECRET not in message


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg:berth:{PASSWORD}@db/berth",  # no "//": not a URL SQLAlchemy reads
        f"nosuchdriver://berth:{PASSWORD}@db/berth",  # no such dialect
    ],
)
def test_the_store_does_not_repeat_a_database_password_in_its_errors(url: str) -> None:
    with pytest.raises(StoreError) as refused:
        Store(url)
    assert PASSWORD not in str(refused.value)
    assert "hunter2" not in str(refused.value).lower()


def _berth(home: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    full.update(env, COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "berth", "--home", str(home), *args],
        capture_output=True, text=True, env=full, timeout=60, check=False,
    )  # fmt: skip


def test_config_show_masks_every_secret_setting(tmp_path: Path) -> None:
    home = tmp_path / "home"
    secret = "a-cluster-secret-of-32-characters"
    env = {
        "BERTH_DATABASE_URL": f"postgresql+psycopg://berth:{PASSWORD}@db.lan/berth",
        "BERTH_CLUSTER_SECRET": secret,
        "BERTH_TRACING_HEADERS": "authorization=Bearer%20tok-123",
    }
    table = _berth(home, "config", "show", env=env)
    as_json = _berth(home, "config", "show", "--json", env=env)
    assert table.returncode == 0 and as_json.returncode == 0, table.stderr + as_json.stderr
    for output in (table.stdout + table.stderr, as_json.stdout + as_json.stderr):
        for leaked in (PASSWORD, secret, "tok-123"):
            assert leaked not in output
    shown = json.loads(as_json.stdout)["settings"]
    assert shown["cluster_secret"]["value"] == "***"
    assert shown["database_url"]["value"] == "postgresql+psycopg://berth:***@db.lan/berth"
    assert shown["tracing_headers"]["value"] == "authorization=***"


def test_a_short_secret_is_refused_by_config_show_without_showing_it(tmp_path: Path) -> None:
    result = _berth(tmp_path / "home", "config", "show", env={"BERTH_CLUSTER_SECRET": SHORT_SECRET})
    assert result.returncode != 0
    assert "BERTH_CLUSTER_SECRET" in result.stderr and "at least 16" in result.stderr
    assert SHORT_SECRET not in result.stdout + result.stderr
