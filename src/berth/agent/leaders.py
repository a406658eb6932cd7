"""The leaders an agent may dial, and which one it dials next (docs/ha.md, Agents fail over).

Leaders that share one database (``leader_ha``) each have a cluster URL; the enrollment URI
and every Welcome list them all.  The agent keeps that list in ``agent-leaders.json`` in its
home (``{"leaders": [URL, ...], "current": URL}``, rewritten atomically whenever it
changes) and dials its *current* leader:

- a link that ends or a dial that fails moves it to the next leader in the list (in turn,
  wrapping), after the usual backoff;
- a standby's refusal (close code ``NOT_LEADER``) names the active leader: the agent dials
  that one next, at once (once in a row; a second refusal in a row waits the backoff, so two
  leaders with stale views cannot make it spin);
- once a standby has named an active, the leaders are handing over (the named one is dead or
  about to be replaced): until the next Welcome, for at most :data:`HANDOVER_REFUSALS`
  refusals, the backoff stays at its first step (0.5 to 1 s) instead of doubling, so the
  agent reaches the new active within a second of its takeover rather than several seconds
  after it (the kill -9 benchmark, ``scripts/bench_failover_agents.py``, saw 11.7 s with the
  doubling backoff and a 5 s lease);
- a Welcome makes the leader that sent it current and replaces the list with the one it
  carries (an empty list, from a lone or older leader, leaves it as it is).

The identity's ``leader_url`` (``agent.yaml``) is always in the list, so an agent whose file
is lost or damaged starts from where it was enrolled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from berth.atomic import write_atomic
from berth.cluster.protocol.errors import CloseCode, active_named_in

log = logging.getLogger(__name__)

#: The file in the agent's home that keeps the list.
LEADERS_FILE = "agent-leaders.json"
#: Refusals naming an active, since the last Welcome, for which the backoff is held at its
#: first step: about 8 to 16 s of redials, past the default lease and its look; longer
#: leases fall back to the doubling backoff.
HANDOVER_REFUSALS = 16


@dataclass(frozen=True)
class NextDial:
    """Where the agent dials after a session ended: ``url``, and whether ``at_once``
    (skipping the backoff) because a standby named the active leader; ``handing_over``:
    the backoff stays at its first step (see the module doc)."""

    url: str
    at_once: bool
    handing_over: bool = False


def next_dial(
    leaders: Sequence[str],
    current: str,
    *,
    code: int | None,
    reason: str,
    jumped_last: bool,
) -> NextDial:
    """The dial after a session with ``current`` ended with close ``code`` and ``reason``
    (``code`` ``None``: the dial failed or the link broke without a close).

    ``NOT_LEADER`` naming an active leader: that one, at once unless ``jumped_last`` (the
    last dial was already such a jump).  Anything else: the leader after ``current`` in
    ``leaders`` (wrapping; ``current`` itself when it is the only one), after the backoff.
    """
    if code == CloseCode.NOT_LEADER:
        named = active_named_in(reason)
        if named is not None and named != current:
            return NextDial(named, at_once=not jumped_last)
    if current in leaders:
        following = leaders[(leaders.index(current) + 1) % len(leaders)]
    else:
        following = leaders[0] if leaders else current
    return NextDial(following, at_once=False)


class LeaderList:
    """The agent's leaders and its current one (see the module doc); ``path`` ``None``
    keeps it in memory only."""

    def __init__(self, leaders: Sequence[str], current: str, path: Path | None = None) -> None:
        self._leaders = _unique([*leaders, current])
        self._current = current.rstrip("/")
        self._path = path
        self._jumped = False
        #: refusals naming an active since the last Welcome
        self._named_refusals = 0

    @classmethod
    def load(cls, path: Path, enrolled_at: str) -> LeaderList:
        """The list kept at ``path``, with ``enrolled_at`` (the identity's leader URL)
        added; a missing or unreadable file gives ``[enrolled_at]``."""
        leaders: list[str] = []
        current = enrolled_at
        try:
            kept = json.loads(path.read_text())
            leaders = [str(u) for u in kept.get("leaders", []) if isinstance(u, str)]
            if isinstance(kept.get("current"), str) and kept["current"]:
                current = kept["current"]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            log.warning("ignoring %s (%s); dialling %s", path, exc, enrolled_at)
        return cls([*leaders, enrolled_at], current, path)

    @property
    def current(self) -> str:
        """The cluster URL dialled next."""
        return self._current

    @property
    def leaders(self) -> list[str]:
        """Every leader known, in the order they are tried."""
        return list(self._leaders)

    def welcomed(self, leaders: Sequence[str]) -> None:
        """The current leader welcomed the agent with ``leaders`` (maybe empty)."""
        self._jumped = False
        self._named_refusals = 0
        if leaders:
            self._leaders = _unique([*leaders, self._current])
        self.save()

    def ended(self, code: int | None, reason: str) -> NextDial:
        """The session with the current leader ended (see :func:`next_dial`): move on."""
        decided = next_dial(
            self._leaders, self._current, code=code, reason=reason, jumped_last=self._jumped
        )
        self._jumped = decided.at_once
        if code == CloseCode.NOT_LEADER and active_named_in(reason) is not None:
            self._named_refusals += 1
        if decided.url not in self._leaders:
            self._leaders.append(decided.url)
        if decided.url != self._current:
            self._current = decided.url
            self.save()
        handing_over = 0 < self._named_refusals <= HANDOVER_REFUSALS
        return dataclasses.replace(decided, handing_over=handing_over)

    def save(self) -> None:
        if self._path is None:
            return
        text = json.dumps({"leaders": self._leaders, "current": self._current}, indent=1)
        write_atomic(self._path, text, mode=0o644)


def _unique(urls: Sequence[str]) -> list[str]:
    seen: list[str] = []
    for url in urls:
        url = url.rstrip("/")
        if url and url not in seen:
            seen.append(url)
    return seen
