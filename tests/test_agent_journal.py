"""The agent's engine journal (``agent-engines.json``): journals the current code writes load,
a malformed one is refused naming its file, and a restarted agent core takes back the engine
its journal names and drops one that is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from berth.agent.core import AgentCore
from berth.agent.journal import EngineJournal, JournalEntry, decode_journal
from berth.errors import ConfigError
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import StaticInventory
from berth.runtime.process import ProcessRuntime


def _core(tmp_path: Path, journal: Path) -> AgentCore:
    return AgentCore(
        ProcessRuntime(),
        EngineBinaries(None, None, ""),
        StaticInventory(),
        logs_dir=tmp_path,
        journal_path=journal,
    )


@pytest.fixture
def engine_like() -> Iterator[subprocess.Popen[bytes]]:
    """A process whose command line carries ``--port 41234``, as an engine's does."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--port", "41234"]
    )
    yield child
    child.kill()
    child.wait()


def test_a_journal_as_the_current_code_writes_it_loads(tmp_path: Path) -> None:
    path = tmp_path / "agent-engines.json"
    written = {
        "d-0000aaaa": {"pid": 4242, "port": 41234, "health_path": "/health", "runtime": "process"},
        "d-0000bbbb": {"pid": 0, "port": 0, "health_path": "/health", "runtime": "docker"},
    }
    path.write_text(json.dumps(written, indent=1))
    assert EngineJournal(path).load() == {
        "d-0000aaaa": JournalEntry(4242, 41234, "/health", "process"),
        "d-0000bbbb": JournalEntry(0, 0, "/health", "docker"),
    }


def test_an_entry_without_a_runtime_is_a_process_and_unknown_fields_are_ignored() -> None:
    data = b'{"d-1": {"pid": 7, "port": 8080, "health_path": "/v1/models", "added_later": 1}}'
    assert decode_journal(data, Path("j.json")) == {"d-1": JournalEntry(7, 8080, "/v1/models")}


def test_what_is_saved_reads_back_the_same(tmp_path: Path) -> None:
    journal = EngineJournal(tmp_path / "agent-engines.json")
    entries = {"d-1": JournalEntry(12, 30000, "/health", "docker")}
    journal.save(entries)
    assert journal.load() == entries
    assert json.loads(journal.path.read_text())["d-1"]["runtime"] == "docker"
    assert EngineJournal(tmp_path / "none-yet.json").load() == {}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "malformed engine journal"),
        ("{not json", "malformed engine journal"),
        ("[]", "Expected `object`"),
        ('{"d-1": {"pid": 1, "port": 2}}', "missing required field `health_path`"),
        ('{"d-1": {"pid": "1", "port": 2, "health_path": "/h"}}', "Expected `int`"),
        ('{"d-1": {"pid": 1, "port": 70000, "health_path": "/h"}}', "<= 65535"),
        ('{"d-1": {"pid": 1, "port": 2, "health_path": "/h", "runtime": "podman"}}', "podman"),
    ],
)
async def test_a_malformed_journal_is_refused_naming_its_file(
    tmp_path: Path, text: str, reason: str
) -> None:
    path = tmp_path / "agent-engines.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="malformed engine journal") as refused:
        await _core(tmp_path, path).restore()
    assert str(path) in str(refused.value) and reason in str(refused.value)
    assert path.read_text() == text  # never replaced by an empty journal


async def test_a_restarted_core_takes_back_the_running_engine_and_drops_the_gone_one(
    tmp_path: Path, engine_like: subprocess.Popen[bytes]
) -> None:
    path = tmp_path / "agent-engines.json"
    EngineJournal(path).save(
        {
            "d-0000a11e": JournalEntry(engine_like.pid, 41234, "/health"),
            "d-00000905": JournalEntry(2**22 + 1, 41235, "/health"),  # above any pid in use
        }
    )
    core = _core(tmp_path, path)
    assert await core.restore() == ["d-0000a11e"]
    assert [(e.deployment_id, e.pid, e.port) for e in core.engines()] == [
        ("d-0000a11e", engine_like.pid, 41234)
    ]
    assert EngineJournal(path).load() == {
        "d-0000a11e": JournalEntry(engine_like.pid, 41234, "/health", "process")
    }
