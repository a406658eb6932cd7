"""``berth.atomic``: files replaced whole with their mode, nothing left behind by a failure, and
concurrent writers of one file never sharing a temporary file."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from berth.atomic import atomic_writer, create_atomic, write_atomic


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _leftovers(folder: Path, keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


def test_the_file_gets_exactly_its_mode_whatever_the_umask(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    previous = os.umask(0o077)
    try:
        write_atomic(target, "{}", mode=0o644)
        assert _mode(target) == 0o644
        write_atomic(target, b"{}", mode=0o600)  # a replaced file takes the new mode
        assert _mode(target) == 0o600
    finally:
        os.umask(previous)
    assert target.read_text() == "{}"
    assert _leftovers(tmp_path, "state.json") == []


def test_a_failed_rename_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "config.toml"
    write_atomic(target, "old\n", mode=0o600)

    def refuse(source: object, destination: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, "new\n", mode=0o600)
    assert target.read_text() == "old\n"
    assert _leftovers(tmp_path, "config.toml") == []


def test_a_failed_sync_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ca.key"
    write_atomic(target, b"old", mode=0o600)

    def fail(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output error"):
        write_atomic(target, b"new", mode=0o600)
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path, "ca.key") == []


def test_an_error_while_streaming_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "backup.tar.gz"
    target.write_bytes(b"the previous backup")
    with (
        pytest.raises(RuntimeError, match="source vanished"),
        atomic_writer(target, mode=0o600) as sink,
    ):
        sink.write(b"half of an archive")
        raise RuntimeError("source vanished")
    assert target.read_bytes() == b"the previous backup"
    assert _leftovers(tmp_path, "backup.tar.gz") == []


def test_durable_syncs_the_file_and_its_folder_and_not_durable_syncs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def record(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    write_atomic(tmp_path / "journal.json", "{}", mode=0o644)
    assert synced == ["file", "folder"]
    synced.clear()
    write_atomic(tmp_path / "status.json", "{}", mode=0o644, durable=False)
    assert synced == []


def test_two_writers_at_once_do_not_clobber_each_others_temporary(tmp_path: Path) -> None:
    target = tmp_path / "agent-engines.json"
    first_payload, second_payload = b"a" * 100_000, b"b" * 100_000
    with atomic_writer(target, mode=0o644) as first:
        first.write(first_payload[:50_000])
        with atomic_writer(target, mode=0o644) as second:  # starts while the first is open
            second.write(second_payload)
        assert target.read_bytes() == second_payload
        first.write(first_payload[50_000:])
    assert target.read_bytes() == first_payload  # whole: its temporary was its own
    assert _leftovers(tmp_path, "agent-engines.json") == []


def test_many_threads_replacing_one_file_leave_one_whole_version(tmp_path: Path) -> None:
    target = tmp_path / "adopted.yaml"
    payloads = [bytes([65 + n]) * 20_000 for n in range(8)]
    start = threading.Barrier(len(payloads))

    def writer(payload: bytes) -> None:
        start.wait()
        for _ in range(20):
            write_atomic(target, payload, mode=0o644, durable=False)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert target.read_bytes() in payloads
    assert _leftovers(tmp_path, "adopted.yaml") == []


def test_create_atomic_creates_once_and_keeps_the_winners_content(tmp_path: Path) -> None:
    target = tmp_path / "key_pepper"
    assert create_atomic(target, b"first", mode=0o600)
    assert not create_atomic(target, b"second", mode=0o600)
    assert target.read_bytes() == b"first" and _mode(target) == 0o600
    assert _leftovers(tmp_path, "key_pepper") == []
