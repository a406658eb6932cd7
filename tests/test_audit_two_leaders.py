"""The audit log with two writers (issue 25): two leaders' ``AuditLog`` objects appending to
one file at once (leaders on one host pointed at one log) lose no line and never interleave
two: each line is one ``write`` on an ``O_APPEND`` descriptor, which the kernel keeps whole
whoever else writes, so two objects (each with its own lock, as in two processes) in two
threads show it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from berth.cluster.pki.enrollment import AuditLog

LINES = 500


def test_two_writers_append_to_one_audit_log_without_losing_or_mixing_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "logs" / "audit.log"
    start = threading.Barrier(2)

    def write_lines(writer: str) -> None:
        log = AuditLog(path)
        start.wait()
        for index in range(LINES):
            log.append({"event": "test.line", "writer": writer, "index": index, "pad": "x" * 300})

    threads = [threading.Thread(target=write_lines, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(events) == 2 * LINES
    for name in ("a", "b"):
        assert [e["index"] for e in events if e["writer"] == name] == list(range(LINES))
