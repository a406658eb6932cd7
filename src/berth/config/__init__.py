"""berth's settings: declared once, resolved from flag > environment (``BERTH_*``) >
``config.toml`` > autodetect > default, each value with the source it came from.

- :mod:`berth.config.table`: the settings table (:data:`SETTINGS`, :class:`SettingDef`);
- :mod:`berth.config.convert`: a raw value to its type, with its checks;
- :mod:`berth.config.settings`: resolution (:class:`Settings`) and the listeners'
  advertised hosts;
- :mod:`berth.config.file`: reading and editing ``config.toml``;
- :mod:`berth.config.tiers`: the key tiers (``[tiers.NAME]``).

The names callers use are importable from here.
"""

from berth.config.convert import convert_setting
from berth.config.file import FileValue, read_config_file, write_config_values
from berth.config.settings import (
    WILDCARD_BINDS,
    SettingRow,
    Settings,
    advertised_host,
    primary_address,
    url_host,
)
from berth.config.table import (
    ENV_PREFIX,
    SETTINGS,
    SETTINGS_BY_NAME,
    SettingDef,
    SettingKind,
    host_problem,
    setting_definition,
)
from berth.config.tiers import TierDef, TierTable, read_tiers

__all__ = [
    "ENV_PREFIX",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "WILDCARD_BINDS",
    "FileValue",
    "SettingDef",
    "SettingKind",
    "SettingRow",
    "Settings",
    "TierDef",
    "TierTable",
    "advertised_host",
    "convert_setting",
    "host_problem",
    "primary_address",
    "read_config_file",
    "read_tiers",
    "setting_definition",
    "url_host",
    "write_config_values",
]
