"""Process helpers shared by the tests that run real daemons and engines."""

from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        # ProcessLookupError: the process was reaped between the open and the read
        return False


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for ``pid`` to be gone; whether it went."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False
