"""The root command loads a command's module only when that command runs (``cli/main.py``):
``berth --help`` imports none of them, a command imports its own, and the summaries the root
lists are each command's own first paragraph."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from berth.cli.main import COMMANDS, LazyCommand, load_command

#: Runs the CLI with the arguments given and prints the berth.cli modules and the heavy
#: libraries it imported, as JSON, whatever the command exits with.
PROBE = """
import json, sys
from berth.cli.main import main
sys.argv = ["berth", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
loaded = sorted(m for m in sys.modules if m.startswith("berth.cli.") or m in HEAVY)
print("\\n" + json.dumps(loaded))
"""
HEAVY = ("sqlalchemy", "pydantic", "aiohttp", "docker", "psycopg", "cryptography", "pynvml")


def _loaded(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{PROBE}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded: list[str] = json.loads(done.stdout.rsplit("\n", 2)[-2])
    return loaded


def _first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


@pytest.mark.parametrize("entry", COMMANDS, ids=lambda entry: entry.name)
def test_each_summary_is_the_first_paragraph_of_its_commands_help(entry: LazyCommand) -> None:
    command = load_command(entry)
    assert command.name == entry.name
    assert _first_paragraph(command.help or "") == entry.summary


def test_the_root_help_imports_no_command() -> None:
    assert _loaded("--help") == ["berth.cli.context", "berth.cli.main"]


def test_a_command_imports_its_own_module_only() -> None:
    loaded = _loaded("key", "--help")
    assert "berth.cli.keys_cmd" in loaded
    assert not {f"berth.cli.{e.module}" for e in COMMANDS if e.module != "keys_cmd"} & set(loaded)
