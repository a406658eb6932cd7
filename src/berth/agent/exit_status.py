"""How ``berth agent start`` exits, and how a failing agent's restarts are spaced out.

The exit status tells the service manager what to do (the unit of
:mod:`berth.agent.systemd_unit`):

- :data:`EXIT_STOPPED` (0): stopped by SIGTERM or SIGINT; not restarted;
- :data:`EXIT_REENROLL` (78, ``EX_CONFIG`` of sysexits.h, which ``systemctl status`` shows as
  ``78/CONFIG``): the leader refused the node's identity for good (a certificate no node has
  or that expired, a removed node).  Only enrolling it again helps, so the unit does not
  restart it (``RestartPreventExitStatus=78``), and the agent prints the command, last, where
  ``systemctl status`` shows it, and keeps it in its status file for ``berth agent status``;
- :data:`EXIT_FAILED` (1, or what the CLI gives an error): anything else; restarted.

**Paced restarts.**  systemd 254 and newer raise the restart interval itself
(``RestartSteps=``); older ones restart every ``RestartSec=``, for ever.  There the unit runs
``berth agent start --paced-restarts``: each failing exit is noted in
:data:`FAILURES_FILE` in the agent's home (``{"in_a_row": N, "at": epoch seconds}``), a clean
one (:data:`EXIT_STOPPED`, :data:`EXIT_REENROLL`) clears it, and after N failures in a row the
agent waits :func:`paced_wait_s` before it dials: the intervals systemd's ``RestartSteps=``
would give (:func:`restart_interval_s`), less the ``RestartSec=`` systemd already waited.  A
run that lasted the longest interval or more starts the count again.  An agent killed with
SIGKILL (the OOM killer) notes nothing: its next start is not delayed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from berth.atomic import write_atomic
from berth.cluster.protocol.errors import CloseCode

log = logging.getLogger(__name__)

EXIT_STOPPED: Final = 0
EXIT_FAILED: Final = 1
EXIT_REENROLL: Final = 78

#: The leader's final refusals that only a new enrollment cures.
REENROLL_CODES: Final = frozenset(
    {CloseCode.BAD_CERTIFICATE, CloseCode.CERTIFICATE_EXPIRED, CloseCode.NODE_REMOVED}
)

#: Seconds systemd waits before restarting a failed agent (``RestartSec=``).
RESTART_DELAY_S: Final = 5
#: Restarts over which the interval grows to :data:`RESTART_MAX_DELAY_S` (``RestartSteps=``).
RESTART_STEPS: Final = 6
#: The longest restart interval, in seconds (``RestartMaxDelaySec=``).
RESTART_MAX_DELAY_S: Final = 300

#: The file in the agent's home that counts failing exits in a row.
FAILURES_FILE: Final = "agent-failures.json"


def exit_status(final_code: int | None) -> int:
    """The agent's exit status after its dial loop ended on the leader's ``final_code``
    (``None``: it was stopped)."""
    if final_code is None:
        return EXIT_STOPPED
    return EXIT_REENROLL if final_code in REENROLL_CODES else EXIT_FAILED


def restart_interval_s(failures_in_a_row: int) -> float:
    """Seconds between a failed exit and the next start after ``failures_in_a_row``
    failures, as ``RestartSteps=`` makes them: :data:`RESTART_DELAY_S` after the first,
    growing geometrically to :data:`RESTART_MAX_DELAY_S` at the :data:`RESTART_STEPS`-th
    and after (5, 9.9, 19.6, 38.7, 76.6, 151.6, 300 s)."""
    step = min(max(failures_in_a_row - 1, 0), RESTART_STEPS)
    ratio = RESTART_MAX_DELAY_S / RESTART_DELAY_S
    return float(RESTART_DELAY_S * ratio ** (step / RESTART_STEPS))


def paced_wait_s(failures_in_a_row: int) -> float:
    """What a paced agent waits before it dials: the interval less the ``RestartSec=``
    systemd already waited (0 after no failure)."""
    if failures_in_a_row <= 0:
        return 0.0
    return restart_interval_s(failures_in_a_row) - RESTART_DELAY_S


@dataclass(frozen=True)
class Failures:
    """Failing exits in a row (``in_a_row``), the last one at ``at`` (epoch seconds)."""

    in_a_row: int = 0
    at: float = 0.0


def after_exit(previous: Failures, status: int, started_at: float, now: float) -> Failures:
    """The count after a run that began at ``started_at`` ended at ``now`` with ``status``:
    cleared by a clean exit, else one more (or one, after a run as long as the longest
    interval: the failures before it were not in a row)."""
    if status in (EXIT_STOPPED, EXIT_REENROLL):
        return Failures()
    if now - started_at >= RESTART_MAX_DELAY_S:
        return Failures(1, now)
    return Failures(previous.in_a_row + 1, now)


def read_failures(home: Path) -> Failures:
    """The count kept in ``home`` (none when the file is missing or damaged)."""
    path = home / FAILURES_FILE
    try:
        kept = json.loads(path.read_text())
        return Failures(int(kept["in_a_row"]), float(kept["at"]))
    except FileNotFoundError:
        return Failures()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return Failures()


def write_failures(home: Path, failures: Failures) -> None:
    """Keep ``failures`` in ``home`` (the file is removed when there are none)."""
    path = home / FAILURES_FILE
    if failures.in_a_row == 0:
        path.unlink(missing_ok=True)
        return
    write_atomic(path, json.dumps({"in_a_row": failures.in_a_row, "at": failures.at}), mode=0o644)
