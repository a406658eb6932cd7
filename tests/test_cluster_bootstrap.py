"""The cluster's CA and key pepper shared through the store, sealed under ``cluster_secret``
(``berth.cluster.pki.bootstrap``, ``berth.store.bootstrap``): two homes on one database, on both
engines, as two leaders have."""

from __future__ import annotations

import logging
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from berth.cluster.pki.bootstrap import (
    WRONG_SECRET,
    BootstrapData,
    seal,
    share_through_store,
    unseal,
)
from berth.cluster.pki.ca import CA_CERT_FILE, CA_KEY_FILE, CertificateAuthority
from berth.config import Settings
from berth.daemon.pieces import share_bootstrap
from berth.errors import ConfigError
from berth.keys import load_or_create_pepper
from berth.paths import BerthHome
from berth.store import Store

pytestmark = pytest.mark.store_engines

SECRET = "a-cluster-secret-of-some-length"


def _home(tmp_path: Path, name: str) -> BerthHome:
    home = BerthHome(tmp_path / name)
    home.ensure()
    return home


@pytest.fixture
def stores(db_url: str) -> Iterator[tuple[Store, Store]]:
    """Two leaders' stores on one migrated database."""
    with Store(db_url) as a, Store(db_url) as b:
        a.migrate()
        yield a, b


def test_the_second_home_gets_the_first_homes_ca_and_pepper(
    stores: tuple[Store, Store], tmp_path: Path
) -> None:
    a, b = stores
    first, second = _home(tmp_path, "a"), _home(tmp_path, "b")
    assert a.cluster_bootstrap() is None
    published = share_through_store(first, a, SECRET)
    ca_a = CertificateAuthority.load_or_create(first.ca_dir)
    assert published.ca_fingerprint == ca_a.fingerprint_sha256
    assert not (second.ca_dir / CA_KEY_FILE).exists() and not second.pepper_file.exists()

    shared = share_through_store(second, b, SECRET)

    ca_b = CertificateAuthority.load_or_create(second.ca_dir)
    assert ca_b.fingerprint_sha256 == ca_a.fingerprint_sha256 == shared.ca_fingerprint
    assert second.pepper_file.read_bytes() == first.pepper_file.read_bytes()
    assert stat.S_IMODE((second.ca_dir / CA_KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE((second.ca_dir / CA_CERT_FILE).stat().st_mode) == 0o644
    assert stat.S_IMODE(second.pepper_file.stat().st_mode) == 0o600
    # A restart of either finds the same data and changes nothing.
    assert share_through_store(first, a, SECRET) == share_through_store(second, b, SECRET)


def test_the_database_holds_no_plaintext(stores: tuple[Store, Store], tmp_path: Path) -> None:
    a, _ = stores
    home = _home(tmp_path, "a")
    data = share_through_store(home, a, SECRET)
    sealed = a.cluster_bootstrap()
    assert sealed is not None
    assert b"-----BEGIN" not in sealed.ciphertext
    assert b"PRIVATE KEY" not in sealed.ciphertext
    assert data.pepper not in sealed.ciphertext
    assert len(sealed.salt) == 16 and len(sealed.nonce) == 12


def test_a_wrong_secret_refuses(stores: tuple[Store, Store], tmp_path: Path) -> None:
    a, b = stores
    share_through_store(_home(tmp_path, "a"), a, SECRET)
    second = _home(tmp_path, "b")
    with pytest.raises(ConfigError) as caught:
        share_through_store(second, b, "another-secret-of-some-length")
    assert str(caught.value).startswith("cluster_secret does not open the database's cluster")
    assert str(caught.value) == WRONG_SECRET and "\n" not in str(caught.value)
    assert not (second.ca_dir / CA_KEY_FILE).exists() and not second.pepper_file.exists()


def test_a_home_with_another_ca_refuses_naming_both(
    stores: tuple[Store, Store], tmp_path: Path
) -> None:
    a, b = stores
    shared = share_through_store(_home(tmp_path, "a"), a, SECRET)
    second = _home(tmp_path, "b")
    own = CertificateAuthority.load_or_create(second.ca_dir)
    with pytest.raises(ConfigError) as caught:
        share_through_store(second, b, SECRET)
    message = str(caught.value)
    assert own.fingerprint_sha256 in message and shared.ca_fingerprint in message
    assert "move" in message and "\n" not in message
    # Nothing of the home was replaced.
    assert CertificateAuthority.load_or_create(second.ca_dir).fingerprint_sha256 == (
        own.fingerprint_sha256
    )


def test_a_home_with_another_pepper_refuses(stores: tuple[Store, Store], tmp_path: Path) -> None:
    a, b = stores
    share_through_store(_home(tmp_path, "a"), a, SECRET)
    second = _home(tmp_path, "b")
    own = load_or_create_pepper(second.pepper_file)
    with pytest.raises(ConfigError, match="key_pepper is not the one in the database"):
        share_through_store(second, b, SECRET)
    assert second.pepper_file.read_bytes() == own


def test_the_first_publish_wins_a_race(stores: tuple[Store, Store]) -> None:
    a, b = stores
    winner = BootstrapData(b"key", b"cert", b"p" * 32)
    stored = a.publish_cluster_bootstrap(seal(winner, SECRET, now_s=1.0))
    assert b.publish_cluster_bootstrap(seal(winner, SECRET, now_s=2.0)) == stored
    assert b.cluster_bootstrap() == stored


def test_a_loser_of_the_first_start_race_takes_the_winners_ca(
    stores: tuple[Store, Store], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both homes empty, both stores see no blob; the second to publish keeps the first's."""
    a, b = stores
    first, second = _home(tmp_path, "a"), _home(tmp_path, "b")
    winner = share_through_store(first, a, SECRET)
    # The second leader read "no blob" before the first published.
    monkeypatch.setattr(b, "cluster_bootstrap", lambda: None)
    shared = share_through_store(second, b, SECRET)
    assert shared == winner
    ca = CertificateAuthority.load_or_create(second.ca_dir)
    assert ca.fingerprint_sha256 == winner.ca_fingerprint
    assert second.pepper_file.read_bytes() == winner.pepper


def test_seal_and_unseal_round_trip(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    data = BootstrapData((tmp_path / "ca" / CA_KEY_FILE).read_bytes(), ca.cert_pem, b"x" * 32)
    sealed = seal(data, SECRET, now_s=5.0)
    assert unseal(sealed, SECRET) == data
    other = seal(data, SECRET, now_s=5.0)
    assert other.salt != sealed.salt and other.nonce != sealed.nonce
    with pytest.raises(ConfigError, match="damaged"):
        unseal(seal(BootstrapData(b"k", b"c", b"x" * 32), SECRET, now_s=5.0), SECRET)


def test_the_secret_is_masked_and_checked(home: BerthHome) -> None:
    settings = Settings.load(home, env={"BERTH_CLUSTER_SECRET": SECRET, "BERTH_LEADER_HA": "1"})
    assert settings.cluster_secret == SECRET
    (row,) = [r for r in settings.rows() if r.name == "cluster_secret"]
    assert (row.value, row.source, row.env_var) == ("***", "env", "BERTH_CLUSTER_SECRET")
    assert settings.as_json()["cluster_secret"]["value"] == "***"
    assert SECRET not in repr(settings.as_json())
    assert Settings.load(home, env={}).cluster_secret is None
    with pytest.raises(ConfigError, match="at least 16 characters"):
        Settings.load(home, env={"BERTH_CLUSTER_SECRET": "short"})


async def test_the_start_step_shares_only_with_leader_ha_and_a_secret(
    stores: tuple[Store, Store], home: BerthHome, caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = stores
    off = Settings.load(home, env={"BERTH_CLUSTER_SECRET": SECRET})
    with caplog.at_level(logging.WARNING, logger="berth.daemon.pieces"):
        await share_bootstrap(home, off, a)
    assert a.cluster_bootstrap() is None  # leader_ha off: the secret is not used, and said so
    assert "cluster_secret is set but leader_ha is off" in caplog.text
    caplog.clear()
    by_hand = Settings.load(home, env={"BERTH_LEADER_HA": "1"})
    with caplog.at_level(logging.INFO, logger="berth.daemon.pieces"):
        await share_bootstrap(home, by_hand, a)
    assert a.cluster_bootstrap() is None
    assert "not shared through the store" in caplog.text
    shared = Settings.load(home, env={"BERTH_LEADER_HA": "1", "BERTH_CLUSTER_SECRET": SECRET})
    await share_bootstrap(home, shared, a)
    assert a.cluster_bootstrap() is not None
    assert SECRET not in caplog.text
