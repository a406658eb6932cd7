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

import difflib
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


def _sections() -> list[str]:
    """The sections ``config.toml`` may hold, in the table's order, the tiers' last."""
    return [*dict.fromkeys(d.section for d in SETTINGS), TIERS_SECTION]


def _closest(word: str, choices: list[str]) -> str:
    """``" (did you mean 'X'?)"`` for the choice closest to a mistyped ``word``, or ``""``."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_section(section: str) -> str:
    sections = _sections()
    shown = ", ".join(f"[{s}]" for s in sections[:-1]) + f", [{TIERS_SECTION}.NAME]"
    return f"unknown section {section!r}{_closest(section, sections)}; sections: {shown}"


def _unknown_key(key: str, section: str | None) -> str:
    """What to say of ``key`` in ``section`` (``None``: outside any section): where it
    belongs if it is another section's setting, else the closest key and the section's keys."""
    defn = SETTINGS_BY_NAME.get(key)
    unknown = f"unknown key {key!r} in [{section}]" if section else f"unknown top-level key {key!r}"
    if defn is not None:
        return f"{unknown}; it is a setting of [{defn.section}]: move it under that header"
    if section is None:
        return f"{unknown}; settings go in sections: {', '.join(_sections())}"
    keys = [d.name for d in SETTINGS if d.section == section]
    return f"{unknown}{_closest(key, keys)}; valid keys in [{section}]: {', '.join(keys)}"


def read_config_file(path: Path) -> dict[str, FileValue]:
    """Read ``config.toml`` into ``{setting name: raw value with its line}``.

    A missing file is empty.  Raises :class:`ConfigError` with ``path`` and ``line`` for a
    TOML syntax error, a key outside a section, an unknown section, or an unknown key (the
    message names the closest valid one and lists the section's keys, or the sections).
    Values are converted later, by :meth:`Settings.load`.  The ``[tiers.*]`` tables are left to
    :func:`berth.config.tiers.read_tiers`.
    """
    document, text = parse_toml(path)
    sections = {d.section for d in SETTINGS}
    found: dict[str, FileValue] = {}
    for section, table in document.items():
        if section == TIERS_SECTION:
            continue
        if not isinstance(table, dict):
            line = locate_line(text, None, section)
            raise ConfigError(_unknown_key(section, None), path=path, line=line)
        if section not in sections:
            line = locate_line(text, section, None) or locate_line(text, None, section)
            raise ConfigError(_unknown_section(section), path=path, line=line)
        for key, raw in table.items():
            defn = SETTINGS_BY_NAME.get(key)
            if defn is None or defn.section != section:
                raise ConfigError(
                    _unknown_key(key, section), path=path, line=locate_line(text, section, key)
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
