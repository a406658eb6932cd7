"""Engine log files: the tail an engine error carries, and following a log as it grows."""

from __future__ import annotations

import asyncio
from pathlib import Path

from berth.runtime.engine_log import follow_log, read_log_tail


def test_read_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("".join(f"line {n} {'x' * 300}\n" for n in range(1000)))

    tail = read_log_tail(log, 3)

    assert [line.split()[:2] for line in tail.splitlines()] == [
        ["line", "997"],
        ["line", "998"],
        ["line", "999"],
    ]
    assert read_log_tail(tmp_path / "missing.log") == ""
    log.write_bytes(b"first\nsecond \xff\nno newline at end")
    assert read_log_tail(log, 2) == "second \ufffd\nno newline at end"


async def test_follow_log_yields_the_tail_then_new_output(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"one\ntwo\nthree\n")
    follower = follow_log(log, from_start_lines=2, poll_interval_s=0.02)
    try:
        assert await asyncio.wait_for(anext(follower), 5) == b"two\nthree\n"

        with log.open("ab") as out:
            out.write(b"four\n")
        assert await asyncio.wait_for(anext(follower), 5) == b"four\n"

        log.write_bytes(b"after truncation\n")
        assert await asyncio.wait_for(anext(follower), 5) == b"after truncation\n"
    finally:
        await follower.aclose()


async def test_follow_log_waits_for_the_file(tmp_path: Path) -> None:
    log = tmp_path / "later.log"
    follower = follow_log(log, from_start_lines=10, poll_interval_s=0.02)
    try:
        pending = asyncio.ensure_future(anext(follower))
        await asyncio.sleep(0.1)
        assert not pending.done()
        log.write_bytes(b"engine starting\n")
        assert await asyncio.wait_for(pending, 5) == b"engine starting\n"
    finally:
        await follower.aclose()
