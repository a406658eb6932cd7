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
- while leaders answer but refuse (``NOT_LEADER``, naming an active or not: a handover, or
  no active at all while the database is out), the redial stays short and jittered: 0.5 to
  1 s after a refusal that names an active, 1 to 2 s after one that names none, never
  growing, so the agent reaches a new active within about two seconds of its election.
  The backoff grows only while no leader answers at all (failed dials, links that break
  without a close); a refusal starts it from its first step again.  Before, refusals that
  named no active doubled the backoff, and an agent reached the active elected after a
  database outage up to 12.6 s late (issue 37);
- a Welcome makes the leader that sent it current and replaces the list with the one it
  carries (an empty list, from a lone or older leader, leaves it as it is).

The identity's ``leader_url`` (``agent.yaml``) is always in the list, so an agent whose file
is lost or damaged starts from where it was enrolled.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class NextDial:
    """Where the agent dials after a session ended: ``url``, and whether ``at_once``
    (skipping the backoff) because a standby named the active leader.  ``refused``: a
    leader answered and refused (``NOT_LEADER``), so the redial is short and the backoff
    starts over (see the module doc); ``names_active``: that refusal named an active."""

    url: str
    at_once: bool
    refused: bool = False
    names_active: bool = False


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
    ``leaders`` (wrapping; ``current`` itself when it is the only one), after the backoff
    (a short one after any ``NOT_LEADER``: :attr:`NextDial.refused`).
    """
    refused = code == CloseCode.NOT_LEADER
    named = active_named_in(reason) if refused else None
    if named is not None and named != current:
        return NextDial(named, at_once=not jumped_last, refused=True, names_active=True)
    if current in leaders:
        following = leaders[(leaders.index(current) + 1) % len(leaders)]
    else:
        following = leaders[0] if leaders else current
    return NextDial(following, at_once=False, refused=refused, names_active=named is not None)


class LeaderList:
    """The agent's leaders and its current one (see the module doc); ``path`` ``None``
    keeps it in memory only."""

    def __init__(self, leaders: Sequence[str], current: str, path: Path | None = None) -> None:
        self._leaders = _unique([*leaders, current])
        self._current = current.rstrip("/")
        self._path = path
        self._jumped = False

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
        if leaders:
            self._leaders = _unique([*leaders, self._current])
        self.save()

    def ended(self, code: int | None, reason: str) -> NextDial:
        """The session with the current leader ended (see :func:`next_dial`): move on."""
        decided = next_dial(
            self._leaders, self._current, code=code, reason=reason, jumped_last=self._jumped
        )
        self._jumped = decided.at_once
        if decided.url not in self._leaders:
            self._leaders.append(decided.url)
        if decided.url != self._current:
            self._current = decided.url
            self.save()
        return decided

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
