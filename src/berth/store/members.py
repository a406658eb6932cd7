"""The leaders sharing a database: each one's cluster URL, for agents that fail over.

With ``leader_ha`` every leader notes its cluster URL (the one its enrollment URIs and
Welcome name) in ``leader_members`` at each look at the lease
(:meth:`MemberMethods.note_leader_member`), keyed by that URL, so a restarted leader (a new
process id) replaces its own row.  Agents get the list (:meth:`leader_members`) in their
enrollment URI and in every Welcome, and the active's URL in a standby's refusal.  A leader
taken out of the cluster for good stays listed until its row is deleted by hand (agents
dialling it only lose a dial).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from berth.store.tables import LeaderMemberRow


@dataclass(frozen=True)
class LeaderMember:
    """One leader: its ``cluster_url``, the ``holder`` id of the process that last noted it
    (compare with the lease's holder to find the active's URL) and ``seen_at`` (Unix s)."""

    cluster_url: str
    holder: str
    seen_at: float


class MemberMethods:
    """Store methods for ``leader_members`` (see the module doc)."""

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def note_leader_member(self, cluster_url: str, holder: str, now_s: float) -> None:
        """Record that leader ``holder`` is reached at ``cluster_url`` (seen ``now_s``).
        Not fenced: a standby notes itself too."""
        with self._write() as session:
            row = session.get(LeaderMemberRow, cluster_url)
            if row is None:
                session.add(LeaderMemberRow(cluster_url=cluster_url, holder=holder, seen_at=now_s))
            else:
                row.holder = holder
                row.seen_at = now_s

    def leader_members(self) -> list[LeaderMember]:
        """Every leader ever noted, by cluster URL."""
        with self._read() as session:
            rows = session.scalars(select(LeaderMemberRow).order_by(LeaderMemberRow.cluster_url))
            return [LeaderMember(r.cluster_url, r.holder, r.seen_at) for r in rows]
