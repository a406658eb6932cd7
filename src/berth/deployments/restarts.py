"""Whether an ended engine is started again, and when: the restart policy, decided from
plain values.

:func:`decide_restart` is pure: it takes the deployment's policy, how its engine ended
(:class:`Ending`), its restart history (:class:`RestartHistory`), the current time and the
backoff settings (:class:`Backoff`), and returns a :class:`Restart` (after ``delay_s``) or a
:class:`GiveUp`, each with the sentence ``berth ps`` and the log print.  The supervisor
(:mod:`berth.deployments.supervisor`) gathers the values and carries the decision out.  The rules,
in the order they are looked at:

1. **never**: the policy ``never`` gives up (the deployment fails, as before restart
   policies);
2. **first start**: an engine that ended while a deployment's first start was under way
   gives up: the user who ran it is shown why at once (``berth run`` waits), and restarting
   a deployment that never served would hide a mistake in its settings;
3. **clean exit**: exit code 0 under ``on-failure`` gives up (the engine chose to end);
   ``always`` restarts it;
4. otherwise restart: a non-zero exit, a kill by a signal, an engine found gone with no
   status known, one stopped after its failed health probes, or a restart whose start failed.

The delay is exponential (Kubernetes' and systemd's shape): ``initial_s`` before the first
restart, doubling with each restart in a row, capped at ``max_s``.  A deployment that stayed
ready for ``reset_after_s`` before its engine ended starts again from the first delay
(``streak`` 0).  It is in **crashloop** once ``crashloop_restarts`` restarts in a row have not
stayed ready for ``reset_after_s``: it keeps restarting at the growing (then capped) delay,
shown as ``crashloop`` rather than ``restarting`` while it waits.

Times are seconds on one clock (the supervisor's monotonic one); only differences matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from berth.backoff import capped_delay_s
from berth.humanize import duration
from berth.vocab.policies import RestartPolicy

#: Why an engine ended, the ``reason`` label of ``berth_deployment_restarts_total``:
#: ``exit`` (an exit code), ``signal`` (killed by one), ``unhealthy`` (stopped after its
#: failed health probes), ``gone`` (not running, how it ended unknown), ``start_failed`` (a
#: restart's start did not reach ready).
EndCause = Literal["exit", "signal", "unhealthy", "gone", "start_failed"]

#: Seconds before the first restart (the ``restart_backoff_s`` setting).
RESTART_BACKOFF_S = 1.0
#: The longest delay between restarts (``restart_backoff_max_s``): 5 minutes.
RESTART_BACKOFF_MAX_S = 300.0
#: Seconds ready after which the next restart starts from the first delay again
#: (``restart_reset_after_s``): 10 minutes.
RESTART_RESET_AFTER_S = 600.0
#: Restarts in a row without a healthy period after which a deployment is in crashloop
#: (``crashloop_restarts``).
CRASHLOOP_RESTARTS = 3


@dataclass(frozen=True)
class Backoff:
    """The restart backoff settings (see the module docstring)."""

    initial_s: float = RESTART_BACKOFF_S
    max_s: float = RESTART_BACKOFF_MAX_S
    reset_after_s: float = RESTART_RESET_AFTER_S
    crashloop_restarts: int = CRASHLOOP_RESTARTS

    def delay_s(self, streak: int) -> float:
        """The delay before the restart that follows ``streak`` restarts in a row: the
        first delay doubled ``streak`` times, at most ``max_s`` (no jitter: one leader
        decides every restart); 0 when ``initial_s`` is 0."""
        if self.initial_s <= 0:
            return 0.0
        return capped_delay_s(streak, first_s=self.initial_s, cap_s=self.max_s)


@dataclass(frozen=True)
class Ending:
    """How an engine ended: its ``cause``, the one-line ``detail`` shown as the deployment's
    last exit (``exit code 1``, ``killed by SIGKILL``, ``3 failed health probes``), and its
    exit ``code`` when it exited with one."""

    cause: EndCause
    detail: str
    code: int | None = None


@dataclass(frozen=True)
class RestartHistory:
    """What the supervisor remembers of a deployment: ``streak`` restarts in a row without
    staying ready for the reset time, when it last became ready (``ready_since``; ``None``:
    it was not ready when its engine ended, e.g. a restart's start failed), and whether it
    was ever ready (``ever_ready``: its first start had finished)."""

    streak: int = 0
    ready_since: float | None = None
    ever_ready: bool = False


@dataclass(frozen=True)
class Restart:
    """Start the engine again after ``delay_s`` seconds; it is restart number ``streak`` in a
    row (from 1), in ``crashloop`` when that many have not held."""

    delay_s: float
    streak: int
    crashloop: bool
    reason: str


@dataclass(frozen=True)
class GiveUp:
    """Do not restart: the deployment fails; ``reason`` says why it is not restarted
    (``first_start``: rule 2, the start's own error says it all)."""

    reason: str
    first_start: bool = False


def decide_restart(
    policy: RestartPolicy,
    ending: Ending,
    history: RestartHistory,
    now: float,
    backoff: Backoff = Backoff(),
) -> Restart | GiveUp:
    """The restart policy's answer for an engine that ended ``now`` (rules: module
    docstring)."""
    if policy == "never":
        return GiveUp("not restarted (restart policy never)")
    if not history.ever_ready:
        return GiveUp("not restarted: its first start failed", first_start=True)
    if ending.cause == "exit" and ending.code == 0 and policy == "on-failure":
        return GiveUp("not restarted: it exited with code 0 (restart policy on-failure)")
    held = history.ready_since is not None and now - history.ready_since >= backoff.reset_after_s
    streak = 0 if held else history.streak
    delay_s = backoff.delay_s(streak)
    crashloop = streak >= backoff.crashloop_restarts
    what = "crashloop" if crashloop else "restarting"
    ordinal = f"restart {streak + 1} in a row"
    reason = f"{ending.detail}; {what}: {ordinal}, in {duration(delay_s)}"
    return Restart(delay_s=delay_s, streak=streak + 1, crashloop=crashloop, reason=reason)
