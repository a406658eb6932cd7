"""Reading and writing the TOML text of ``config.toml``, with file and line in every error.

Only what berth's config file needs: a parse that reports the line of a syntax error, a way
to find the line of a ``[section]`` (or ``[section.sub]``) or key, and a writer for sections
of str, int, float and bool values, lists of them, and sub-tables of those (``tomllib``
reads TOML but does not write it).
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from berth.errors import ConfigError

_TOML_POSITION = re.compile(r"\s*\(at line (?P<line>\d+), column (?P<column>\d+)\)\s*$")
_TOML_AT_END = re.compile(r"\s*\(at end of document\)\s*$")
# A table header; a dotted one (``[tiers.free]``) is read with the spaces around dots removed.
_SECTION_LINE = re.compile(
    r"^\s*\[\s*(?P<name>[A-Za-z0-9_-]+(?:\s*\.\s*[A-Za-z0-9_-]+)*)\s*\]\s*(#.*)?$"
)
_AROUND_DOTS = re.compile(r"\s*\.\s*")
_KEY_LINE = re.compile(r"^\s*(?P<key>[A-Za-z0-9_-]+)\s*=")


def parse_toml(path: Path) -> tuple[dict[str, Any], str]:
    """Read and parse ``path``; a missing file is empty.  Errors carry the file and line."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", path=path) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad_line = data[: exc.start].count(b"\n") + 1
        raise ConfigError("config file is not valid UTF-8", path=path, line=bad_line) from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        line: int | None = None
        found = _TOML_POSITION.search(message)
        if found is not None:
            line = int(found["line"])
            message = f"{message[: found.start()]} (column {found['column']})"
        elif (end := _TOML_AT_END.search(message)) is not None:
            line = max(1, len(text.splitlines()))
            message = f"{message[: end.start()]} (at end of file)"
        raise ConfigError(f"invalid TOML: {message}", path=path, line=line) from None


def locate_line(text: str, section: str | None, key: str | None) -> int | None:
    """The 1-based line of ``[section]`` (``key`` None) or of ``key`` inside it, if found.

    ``section`` may be dotted, for a sub-table: ``tiers.free`` finds ``[tiers.free]``.
    """
    current: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        header = _SECTION_LINE.match(line)
        if header is not None:
            current = _AROUND_DOTS.sub(".", header["name"])
            if key is None and current == section:
                return number
            continue
        assignment = _KEY_LINE.match(line)
        if key is not None and current == section and assignment and assignment["key"] == key:
            return number
    return None


def render_toml(document: Mapping[str, Mapping[str, object]], section_order: list[str]) -> str:
    """Render ``{section: {key: value}}`` as TOML, sections in ``section_order`` first.

    A value that is itself a mapping is a sub-table, written after its section's own keys
    as ``[section.key]`` (its values flat); lists hold str, int, float or bool values.
    """
    order = {name: i for i, name in enumerate(section_order)}
    blocks = []
    for section in sorted(document, key=lambda name: order.get(name, len(order))):
        table = document[section]
        flat = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
        if flat:
            lines = [f"[{section}]"]
            lines.extend(f"{key} = {_render_value(value)}" for key, value in flat.items())
            blocks.append("\n".join(lines))
        for key, value in table.items():
            if isinstance(value, Mapping):
                lines = [f"[{section}.{key}]"]
                lines.extend(f"{k} = {_render_value(v)}" for k, v in value.items())
                blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else ""


def _render_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _render_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_render_value(item) for item in value) + "]"
    raise ConfigError(
        f"cannot write {value!r} to config.toml: only str, int, float, bool and lists of them"
    )


def _render_string(text: str) -> str:
    escaped = []
    for char in text:
        if char == "\\":
            escaped.append("\\\\")
        elif char == '"':
            escaped.append('\\"')
        elif char == "\n":
            escaped.append("\\n")
        elif char == "\t":
            escaped.append("\\t")
        elif char == "\r":
            escaped.append("\\r")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'
