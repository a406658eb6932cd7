"""The agent's list of leaders and which one it dials next (berth.agent.leaders), the
standby's close code and reason, and the enrollment URI's ``leaders``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from berth.agent.leaders import LeaderList, NextDial, next_dial
from berth.cluster.pki.enrollment import EnrollmentURI
from berth.cluster.protocol.errors import (
    CloseCode,
    active_named_in,
    agent_should_redial,
    not_leader_reason,
)
from berth.errors import ConfigError

A, B, C = "https://a.lan:11501", "https://b.lan:11501", "https://c.lan:11501"
FP = "sha256:" + "ab" * 32


def test_a_failed_dial_or_a_dead_link_moves_to_the_next_leader_in_turn() -> None:
    for code in (None, CloseCode.LEADER_SHUTTING_DOWN, CloseCode.HEARTBEAT_TIMEOUT):
        assert next_dial([A, B, C], A, code=code, reason="", jumped_last=False) == NextDial(
            B, at_once=False
        )
    assert next_dial([A, B, C], C, code=None, reason="", jumped_last=False).url == A
    assert next_dial([A], A, code=None, reason="", jumped_last=False).url == A
    assert next_dial([A, B], C, code=None, reason="", jumped_last=False).url == A


def test_a_standbys_refusal_sends_the_agent_to_the_named_active_at_once_once_in_a_row() -> None:
    reason = not_leader_reason(C)
    assert active_named_in(reason) == C
    assert next_dial([A, B], A, code=CloseCode.NOT_LEADER, reason=reason, jumped_last=False) == (
        NextDial(C, at_once=True, refused=True, names_active=True)
    )
    # A second refusal in a row waits a short redial (two stale standbys cannot make it spin).
    assert next_dial([A, B], A, code=CloseCode.NOT_LEADER, reason=reason, jumped_last=True) == (
        NextDial(C, at_once=False, refused=True, names_active=True)
    )
    # A standby that knows no active: the next in turn, after a short redial.
    unknown = not_leader_reason(None)
    assert active_named_in(unknown) is None
    assert next_dial([A, B], A, code=CloseCode.NOT_LEADER, reason=unknown, jumped_last=False) == (
        NextDial(B, at_once=False, refused=True)
    )
    assert agent_should_redial(CloseCode.NOT_LEADER)


def test_only_a_dial_no_leader_answers_is_not_a_refusal() -> None:
    # kill -9 of the active A: the link breaks, standby B names A until its lease runs out,
    # A refuses connections; or a database outage: every leader refuses naming none.
    leaders = LeaderList([A, B], A)
    assert leaders.ended(None, "") == NextDial(B, at_once=False)
    named = not_leader_reason(A)
    for _ in range(40):  # however long the handover or the outage lasts
        assert leaders.ended(CloseCode.NOT_LEADER, named) == NextDial(A, True, True, True)
        assert leaders.ended(None, "") == NextDial(B, at_once=False)
    for _ in range(40):
        refused = leaders.ended(CloseCode.NOT_LEADER, not_leader_reason(None))
        assert (refused.refused, refused.names_active, refused.at_once) == (True, False, False)
    for code in (CloseCode.LEADER_SHUTTING_DOWN, CloseCode.HEARTBEAT_TIMEOUT):
        assert not leaders.ended(code, "").refused


def test_the_list_is_kept_atomically_and_follows_each_welcome(tmp_path: Path) -> None:
    path = tmp_path / "agent-leaders.json"
    LeaderList([A, B], A, path).save()
    leaders = LeaderList.load(path, A)
    assert (leaders.leaders, leaders.current) == ([A, B], A)
    assert leaders.ended(None, "") == NextDial(B, at_once=False)
    assert json.loads(path.read_text())["current"] == B
    leaders.welcomed([A, B, C])  # B welcomed the agent, listing a third leader
    assert LeaderList.load(path, A).leaders == [A, B, C]
    assert LeaderList.load(path, A).current == B
    leaders.welcomed([])  # a lone or older leader lists none: the list stays
    assert leaders.leaders == [A, B, C]
    jumped = leaders.ended(CloseCode.NOT_LEADER, not_leader_reason(A))
    assert jumped == NextDial(A, at_once=True, refused=True, names_active=True)
    assert leaders.current == A


@pytest.mark.parametrize("text", ["not json", '["a list"]', '{"leaders": 3}'])
def test_a_damaged_file_falls_back_to_the_enrolled_leader(tmp_path: Path, text: str) -> None:
    path = tmp_path / "agent-leaders.json"
    path.write_text(text)
    leaders = LeaderList.load(path, A)
    assert (leaders.leaders, leaders.current) == ([A], A)


def test_the_enrollment_uri_carries_the_leaders() -> None:
    uri = EnrollmentURI(A, "tok", FP, (A, B))
    assert "leaders=https://a.lan:11501,https://b.lan:11501" in str(uri)
    assert EnrollmentURI.parse(str(uri)) == uri
    assert EnrollmentURI.parse(str(EnrollmentURI(A, "tok", FP))).leaders == ()
    with pytest.raises(ConfigError, match="https"):
        EnrollmentURI.parse(f"berth://enroll?leader={A}&token=t&ca_fp={FP}&leaders=http://x")
