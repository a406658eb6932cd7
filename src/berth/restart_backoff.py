"""A rising delay between the restarts of a service that keeps failing, where its service
manager has none.

systemd 254 added ``RestartSteps=`` and ``RestartMaxDelaySec=`` (systemd.service(5)): the
delay before each automatic restart grows from ``RestartSec=`` to the maximum over that many
steps, and a manual start resets it.  ``RestartSteps=`` is ignored without
``RestartMaxDelaySec=``, and an older systemd warns about both as unknown keys.  The systemd
of Debian 12 is 252, of Ubuntu 22.04 249, of RHEL 9 252: there a failing unit is restarted
every ``RestartSec=`` for ever.

There, the service delays its own start: ``berth daemon start --foreground
--restart-backoff`` keeps one small record in its home (:meth:`BerthHome.restart_record`,
JSON, 0600) of its last start (when, after how many failed runs in a row) and whether that
run ended cleanly.  At the next start :func:`next_run` reads it:

- no record, or the last run ended cleanly (exit 0, or a hand-over that asks to be started
  again): no failure before this run, no delay;
- the last run did not end cleanly (an error, a crash, a kill) and started less than
  :data:`HEALTHY_AFTER_S` ago: one more failure in a row;
- it started longer ago: it ran long enough (whatever the restart's own wait) to count as
  healthy, and this is the first failure of a new run of them.

:func:`start_delay_s` waits, on top of the unit's ``RestartSec=`` (:data:`RESTART_SEC_S`),
so that the whole wait before the n-th failure in a row is ``RestartSec= * 2^(n-1)`` up to
:data:`MAX_DELAY_S`: 5, 10, 20, 40, 80, 160, 300 s.  A manual ``systemctl restart`` of a
running service ends it cleanly (SIGTERM), so it starts at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from berth.atomic import write_atomic
from berth.backoff import capped_delay_s

#: The unit's ``RestartSec=``: systemd's own wait before every restart.
RESTART_SEC_S: Final = 5.0
#: The longest wait before a restart, systemd's and berth's together.
MAX_DELAY_S: Final = 300.0
#: A run that started this long before the next start counts as healthy: the next failure
#: starts a new run of them (it covers the longest wait, so only a run that lasted about
#: ten minutes resets the count).
HEALTHY_AFTER_S: Final = 600.0 + MAX_DELAY_S


@dataclass(frozen=True)
class RunRecord:
    """One start of the service: ``started_at`` (Unix seconds), ``failures`` (runs that
    failed in a row before it) and whether it ended cleanly (``clean_exit``: set when it
    ends; a record still ``False`` is a run that failed, crashed or is running)."""

    started_at: float
    failures: int
    clean_exit: bool = False


def next_run(previous: RunRecord | None, now_s: float) -> RunRecord:
    """The record of a run starting at ``now_s`` after ``previous`` (see the module doc).
    Pure."""
    if previous is None or previous.clean_exit:
        return RunRecord(now_s, 0)
    if now_s - previous.started_at >= HEALTHY_AFTER_S:
        return RunRecord(now_s, 1)
    return RunRecord(now_s, previous.failures + 1)


def start_delay_s(failures: int) -> float:
    """Seconds to wait before starting after ``failures`` failed runs in a row, on top of
    :data:`RESTART_SEC_S`: 0 for none or one, then 5, 15, 35, 75, 155, 295.  Pure."""
    if failures <= 1:
        return 0.0
    total_s = capped_delay_s(failures - 1, first_s=RESTART_SEC_S, cap_s=MAX_DELAY_S)
    return max(total_s - RESTART_SEC_S, 0.0)


def read_record(path: Path) -> RunRecord | None:
    """The record at ``path``; ``None`` when there is none or it cannot be read (a damaged
    record costs one delay, never a start)."""
    try:
        raw = json.loads(path.read_text())
        return RunRecord(
            started_at=float(raw["started_at"]),
            failures=max(int(raw["failures"]), 0),
            clean_exit=bool(raw["clean_exit"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(path: Path, record: RunRecord) -> None:
    """Write ``record`` to ``path`` (atomically, 0600).  Raises :class:`OSError`."""
    write_atomic(path, json.dumps(asdict(record)) + "\n", mode=0o600)
