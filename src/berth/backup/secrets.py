"""The secrets a backup carries, named for the warning ``berth backup create`` prints and
for its manifest (``secrets``).

A backup is a whole leader: whoever reads it can act as that leader.  It carries the CA key
(``ca/ca.key``: it signs agents' certificates), the listeners' private keys, the key pepper
(API keys are HMACs under it), and, when ``config.toml`` holds them, the settings marked
secret (:attr:`berth.config.table.SettingDef.secret`): the database password in
``database_url``, the ``cluster_secret`` (it opens the CA sealed in the database) and the
values of ``tracing_headers``.  Each is named; none is ever shown.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Final

from berth.backup.manifest import PEPPER_NAME
from berth.cluster.pki.ca import CA_KEY_FILE
from berth.config import read_config_file
from berth.config.table import SETTINGS
from berth.errors import ConfigError

_CONFIG_NAME: Final = "config.toml"
_CA_KEY_MEMBER: Final = f"ca/{CA_KEY_FILE}"
#: How each secret setting is named in the warning (a URL holds its password; the others
#: are secret whole).
_SECRET_NAMES: Final = {
    "database_url": "the database password",
    "cluster_secret": "cluster_secret",
    "tracing_headers": "the values of tracing_headers",
}


def carried_secrets(member_names: Iterable[str], config_file: Path) -> tuple[str, ...]:
    """What is secret among ``member_names`` (an archive's members), each as a phrase
    naming where it is (``the CA key (ca/ca.key)``, ``cluster_secret (config.toml [store]
    cluster_secret)``), in a fixed order.  ``config_file`` is the ``config.toml`` the
    archive copies; one that cannot be read is named as possibly holding secrets."""
    names = set(member_names)
    found: list[str] = []
    if _CA_KEY_MEMBER in names:
        found.append(f"the CA key ({_CA_KEY_MEMBER})")
    other_keys = sorted(n for n in names if n.startswith("ca/") and n.endswith(".key"))
    other_keys = [n for n in other_keys if n != _CA_KEY_MEMBER]
    if other_keys:
        found.append(f"the private keys {', '.join(other_keys)}")
    if PEPPER_NAME in names:
        found.append(f"the key pepper ({PEPPER_NAME})")
    if _CONFIG_NAME in names:
        found.extend(_config_secrets(config_file))
    return tuple(found)


def _config_secrets(config_file: Path) -> list[str]:
    try:
        values = read_config_file(config_file)
    except ConfigError:
        return [
            f"{_CONFIG_NAME}, which this berth cannot read (it may hold the database "
            "password or cluster_secret)"
        ]
    found: list[str] = []
    for defn in SETTINGS:
        entry = values.get(defn.name)
        if entry is None or not defn.secret:
            continue
        raw = entry.raw
        if isinstance(raw, str) and defn.shown(raw) == raw:
            continue  # e.g. a database URL without a password
        what = _SECRET_NAMES.get(defn.name, defn.name)
        found.append(f"{what} ({_CONFIG_NAME} {defn.toml_location})")
    return found
