"""``berth leader step-down`` with no standby (issue 37): the rule, pure
(``berth.store.leadership.step_down_refusal``), case by case. The refusal through a real
leader daemon, ``--force``, and ``berth doctor`` after it are in ``tests/test_ha_daemons.py``.
"""

from __future__ import annotations

import pytest

from berth.store.leadership import standbys_seen, step_down_refusal
from berth.store.members import LeaderMember

NOW = 1_800_000_000.0
LEASE_S = 5.0
DATABASE = "postgresql+psycopg://berth:***@db.lan/berth"
ME = "host-a:41:ab12cd"


def member(url: str, holder: str, seen_ago: float) -> LeaderMember:
    return LeaderMember(url, holder, NOW - seen_ago)


SELF = member("https://a.lan:11501", ME, 0.5)


@pytest.mark.parametrize(
    ("members", "standbys"),
    [
        ([SELF], []),  # alone
        ([SELF, member("https://b.lan:11501", "b:1:x", 1.2)], ["https://b.lan:11501"]),
        ([SELF, member("https://b.lan:11501", "b:1:x", LEASE_S + 0.1)], []),  # gone quiet
        ([SELF, member("https://b.lan:11501", "b:1:x", -30.0)], []),  # a clock ahead: not seen
        # The same URL noted by this process, after a restart of b on a's host name: not a.
        ([member("https://a.lan:11501", "b:2:y", 0.1)], ["https://a.lan:11501"]),
    ],
)
def test_a_standby_is_another_leader_noted_within_the_lease(
    members: list[LeaderMember], standbys: list[str]
) -> None:
    assert [m.cluster_url for m in standbys_seen(members, ME, NOW, LEASE_S)] == standbys
    refusal = step_down_refusal(members, ME, NOW, LEASE_S, DATABASE)
    assert (refusal is None) is bool(standbys)


def test_the_refusal_names_what_was_checked_and_what_it_found() -> None:
    alone = step_down_refusal([SELF], ME, NOW, LEASE_S, DATABASE)
    assert alone == (
        "refused: no other leader was seen within the lease (5 s) in leader_members of "
        f"{DATABASE} (no other leader at all); stepping down would leave no active leader, "
        "and nothing would be served until one starts. Start a standby first (berth daemon "
        "start with leader_ha on another host), or pass --force to step down anyway"
    )
    stale = [SELF, member("https://b.lan:11501", "b:1:x", 7200), member("https://c.lan:11501",
             "c:1:x", 42)]  # fmt: skip
    refusal = step_down_refusal(stale, ME, NOW, LEASE_S, DATABASE)
    assert refusal is not None
    assert "(https://b.lan:11501 last seen 2h ago; https://c.lan:11501 last seen 42s ago)" in (
        refusal
    )
