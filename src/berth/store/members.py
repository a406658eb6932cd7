"""The leaders sharing a database: each one's cluster URL, for agents that fail over.

With ``leader_ha`` every leader notes its cluster URL (the one its enrollment URIs and
Welcome name) in ``leader_members`` at each look at the lease
(:meth:`MemberMethods.note_leader_member`), keyed by that URL, so a restarted leader (a new
process id) replaces its own row.  Agents get the list (:meth:`leader_members`) in their
enrollment URI and in every Welcome, and the active's URL in a standby's refusal.  A leader
taken out of the cluster for good is forgotten once no leader has seen it noted for
:data:`FORGET_AFTER_S` (:meth:`MemberMethods.forget_leader_members`, run by every leader's
roster; until then agents dialling it only lose a dial); one that starts again notes itself
again.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from berth.store.tables import LeaderMemberRow

#: A leader not noted for this long (seconds: 7 days) is dropped from ``leader_members``: a
#: standby down that long is taken for one removed; it is listed again when it starts.
FORGET_AFTER_S = 7 * 24 * 3600.0


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

    def forget_leader_members(self, seen_before_s: float) -> int:
        """Delete the leaders last noted before ``seen_before_s`` (Unix s); how many."""
        with self._write() as session:
            done = session.execute(
                delete(LeaderMemberRow).where(LeaderMemberRow.seen_at < seen_before_s)
            )
            return int(getattr(done, "rowcount", 0) or 0)

    def leader_members(self) -> list[LeaderMember]:
        """Every leader ever noted, by cluster URL."""
        with self._read() as session:
            rows = session.scalars(select(LeaderMemberRow).order_by(LeaderMemberRow.cluster_url))
            return [LeaderMember(r.cluster_url, r.holder, r.seen_at) for r in rows]
