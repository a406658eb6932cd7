"""How ``berth agent start`` exits and how its restarts are spaced (``berth.agent.exit_status``):
an agent the leader refuses for good exits 78 (not restarted by its unit) and says how to
enroll the node again, where ``systemctl status`` and ``berth agent status`` show it; any
other failing exit is counted, and with ``--paced-restarts`` the next start waits as
systemd's ``RestartSteps=`` would (systemd before 254 cannot).

The real agent process is refused by a real cluster listener on loopback mutual TLS
(``support.renewal_leader``) because its certificate expired (4402).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from berth.agent.dialer import AgentDialer, AgentStatus
from berth.agent.exit_status import (
    EXIT_FAILED,
    EXIT_REENROLL,
    EXIT_STOPPED,
    FAILURES_FILE,
    Failures,
    after_exit,
    exit_status,
    paced_wait_s,
    read_failures,
    restart_interval_s,
    write_failures,
)
from berth.agent.renewal import read_certificate
from berth.cluster.protocol.errors import CloseCode
from berth.paths import BerthHome
from support.cluster_harness import clean_env, cli
from support.renewal_leader import enroll, renewing_leader
from support.waiting import EVENT_TIMEOUT_S, wait_for_async
from test_failover import _identity
from test_redial_refusals import HelloOnly


@pytest.mark.parametrize(
    ("final_code", "status"),
    [
        (None, EXIT_STOPPED),
        (CloseCode.CERTIFICATE_EXPIRED, EXIT_REENROLL),
        (CloseCode.BAD_CERTIFICATE, EXIT_REENROLL),
        (CloseCode.NODE_REMOVED, EXIT_REENROLL),
        (CloseCode.SUPERSEDED, EXIT_FAILED),
        (CloseCode.UNSUPPORTED_VERSION, EXIT_FAILED),
    ],
)
def test_only_a_refusal_that_needs_a_new_enrollment_exits_78(
    final_code: int | None, status: int
) -> None:
    assert exit_status(final_code) == status


def test_the_restart_interval_grows_as_restart_steps_makes_it() -> None:
    intervals = [round(restart_interval_s(n), 1) for n in range(1, 10)]
    assert intervals == [5.0, 9.9, 19.6, 38.7, 76.6, 151.6, 300.0, 300.0, 300.0]
    assert paced_wait_s(0) == 0.0 and paced_wait_s(1) == 0.0  # systemd waited RestartSec
    assert paced_wait_s(7) == pytest.approx(295.0)


def test_failing_exits_are_counted_in_a_row_and_a_clean_one_clears_them() -> None:
    none = Failures()
    one = after_exit(none, EXIT_FAILED, started_at=100.0, now=101.0)
    two = after_exit(one, 2, started_at=110.0, now=111.0)  # a CLI error counts too
    assert (one.in_a_row, two.in_a_row) == (1, 2)
    # A run as long as the longest interval: the failures before it were not in a row.
    assert after_exit(two, EXIT_FAILED, started_at=200.0, now=600.0) == Failures(1, 600.0)
    assert after_exit(two, EXIT_STOPPED, started_at=0.0, now=1.0) == none
    assert after_exit(two, EXIT_REENROLL, started_at=0.0, now=1.0) == none


def test_the_count_is_kept_in_the_home(tmp_path: Path) -> None:
    assert read_failures(tmp_path) == Failures()
    write_failures(tmp_path, Failures(3, 12.5))
    assert read_failures(tmp_path) == Failures(3, 12.5)
    (tmp_path / FAILURES_FILE).write_text("{not json")
    assert read_failures(tmp_path) == Failures()  # damaged: no delay, not a crash
    write_failures(tmp_path, Failures())
    assert not (tmp_path / FAILURES_FILE).exists()


def test_a_paced_agent_that_fails_to_start_counts_it(tmp_path: Path) -> None:
    home = tmp_path / "unregistered"
    home.mkdir()
    for expected in (1, 2):
        result = cli(home, "agent", "start", "--paced-restarts", env=clean_env({}), check=False)
        assert result.returncode != 0 and "berth agent register" in result.stderr
        assert read_failures(home).in_a_row == expected
    cli(home, "agent", "start", env=clean_env({}), check=False)  # not paced: not counted
    assert read_failures(home).in_a_row == 2


async def test_a_paced_first_dial_waits_and_a_stop_ends_the_wait(
    tmp_path: Path, home: BerthHome
) -> None:
    url = "https://127.0.0.1:9"  # never dialled: the agent is stopped while it waits
    status = AgentStatus(url, "n-1", "gpu-1", path=home.agent_status_file)
    dialer = AgentDialer(
        _identity(tmp_path, url),
        HelloOnly(),  # type: ignore[arg-type]
        status,
        renew=False,
        first_dial_after_s=3600.0,
    )
    running = asyncio.create_task(dialer.run())
    await wait_for_async(lambda: status.state == "backoff", EVENT_TIMEOUT_S, "the paced wait")
    await dialer.stop()
    assert await asyncio.wait_for(running, EVENT_TIMEOUT_S) == 0
    assert status.last_error == ""  # it never dialled


@pytest.mark.slow
async def test_an_agent_refused_with_4402_exits_78_and_says_how_to_enroll_again(
    tmp_path: Path,
) -> None:
    async with renewing_leader(tmp_path, lifetime_s=10.0) as leader:  # the shortest allowed
        identity = await enroll(leader, tmp_path, "gpu-x")
        facts = read_certificate(identity.cert_path)
        assert facts is not None
        await wait_for_async(lambda: time.time() > facts.not_after + 0.5, EVENT_TIMEOUT_S,
                             "the certificate to expire")  # fmt: skip
        home = identity.cert_path.parent
        env = clean_env({"BERTH_ORPHAN_GRACE_S": "0"})  # no engine warden left behind
        agent = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "berth", "--home", str(home), "agent", "start",
            "--paced-restarts",
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=home,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(agent.communicate(), 120)
    text = output.decode()
    assert agent.returncode == EXIT_REENROLL, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("fix: berth agent register --uri"), text
    assert "berth nodes enroll gpu-x" in last
    assert "code 4402" in text
    assert not (home / FAILURES_FILE).exists(), "a refusal for good was counted as a failure"
    kept = json.loads((home / "agent-status.json").read_text())
    assert kept["fix"].startswith("berth agent register --uri")

    shown = await asyncio.to_thread(cli, home, "agent", "status", env=clean_env({}), check=False)
    assert "fix     berth agent register --uri" in shown.stdout, shown.stdout
