"""``config.toml``: reading it into raw values with their lines, and editing it.

The file has flat sections; every key is a setting name::

    [server]
    public_port = 11500

    [engines]
    llama_server_bin = "/opt/llama.cpp/bin/llama-server"

The key tiers (``[tiers.NAME]``) are read by :mod:`berth.config.tiers`; editing the settings
keeps them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from berth.atomic import write_atomic
from berth.config.convert import convert_value
from berth.config.table import SETTINGS, SETTINGS_BY_NAME, setting_definition
from berth.config.tiers import TIERS_SECTION
from berth.config_toml import locate_line, parse_toml, render_toml
from berth.errors import ConfigError


@dataclass(frozen=True)
class FileValue:
    """A setting's raw value as ``config.toml`` holds it, with the file and line."""

    raw: object
    path: Path
    line: int | None


def _valid_keys() -> str:
    return ", ".join(f"{d.section}.{d.name}" for d in SETTINGS)


def read_config_file(path: Path) -> dict[str, FileValue]:
    """Read ``config.toml`` into ``{setting name: raw value with its line}``.

    A missing file is empty.  Raises :class:`ConfigError` with ``path`` and ``line`` for a
    TOML syntax error, a key outside a section, an unknown section, or an unknown key (the
    message lists the valid ``section.key`` pairs).  Values are converted later, by
    :meth:`Settings.load`.  The ``[tiers.*]`` tables are left to
    :func:`berth.config.tiers.read_tiers`.
    """
    document, text = parse_toml(path)
    sections = {d.section for d in SETTINGS}
    found: dict[str, FileValue] = {}
    for section, table in document.items():
        if section == TIERS_SECTION:
            continue
        if section not in sections or not isinstance(table, dict):
            line = locate_line(text, section, None) if isinstance(table, dict) else None
            if line is None:
                line = locate_line(text, None, section)
            what = "section" if isinstance(table, dict) else "top-level key"
            raise ConfigError(
                f"unknown {what} {section!r}; valid keys: {_valid_keys()}", path=path, line=line
            )
        for key, raw in table.items():
            defn = SETTINGS_BY_NAME.get(key)
            if defn is None or defn.section != section:
                raise ConfigError(
                    f"unknown key {key!r} in [{section}]; valid keys: {_valid_keys()}",
                    path=path,
                    line=locate_line(text, section, key),
                )
            found[key] = FileValue(raw=raw, path=path, line=locate_line(text, section, key))
    return found


def write_config_values(path: Path, updates: Mapping[str, object]) -> None:
    """Set (or, for a ``None`` value, remove) settings in ``config.toml`` at ``path``.

    Each value is validated as :meth:`Settings.load` would read it back; paths are written
    as given, so relative paths stay relative to the file's folder.  The existing file is
    parsed and re-rendered (comments are not kept) and replaced atomically, mode 0600.
    Raises :class:`ConfigError` for an unknown name, an invalid value, or an existing file
    that does not parse or validate.  The ``[tiers.*]`` tables are written back as they were.
    """
    current = read_config_file(path)
    document: dict[str, dict[str, object]] = {}
    tiers = parse_toml(path)[0].get(TIERS_SECTION)
    if isinstance(tiers, dict) and tiers:
        document[TIERS_SECTION] = tiers
    for name, file_value in current.items():
        document.setdefault(SETTINGS_BY_NAME[name].section, {})[name] = file_value.raw
    for name, value in updates.items():
        defn = setting_definition(name)
        table = document.setdefault(defn.section, {})
        if value is None:
            table.pop(name, None)
            continue
        stored: object = str(value) if isinstance(value, os.PathLike) else value
        convert_value(defn, stored, defn.toml_location, path.parent)
        table[name] = stored
    path.parent.mkdir(parents=True, exist_ok=True)
    order = [d.section for d in SETTINGS] + [TIERS_SECTION]
    write_atomic(path, render_toml(document, order), mode=0o600)
