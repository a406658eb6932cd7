"""``berth daemon install-service``: the leader's systemd unit (``berth.daemon.systemd_unit``),
its restart delay where systemd has none (``berth.restart_backoff``), the command, and the
leader's exit status that the unit restarts on (issue 37: nothing restarted a leader).

The unit text is rendered in-process and checked line by line; the real
``systemd-analyze verify`` must accept it in both scopes, for the systemd installed here
(Debian 12's 252 has no ``RestartSteps=``: the unit then runs the leader with
``--restart-backoff``). The command runs as a user would run it, with ``HOME`` pointed at a
temporary folder and ``--no-start`` (no test runs ``systemctl``). Two slow tests run the
unit's ``ExecStart=`` as systemd would: a real leader that steps down exits 75 (restarted as a
standby), one stopped exits 0 (not restarted), and a leader that keeps failing waits longer
before each start.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from berth.agent.systemd_unit import parse_systemd_version
from berth.daemon.systemd_unit import UNIT_NAME, LeaderUnit, render_unit
from berth.errors import STANDBY_RESTART_EXIT, ConfigError
from berth.restart_backoff import (
    HEALTHY_AFTER_S,
    RunRecord,
    next_run,
    read_record,
    start_delay_s,
    write_record,
)
from berth.runtime.engines import find_free_port
from support.cluster_harness import clean_env, cli
from support.waiting import wait_for

PYTHON = Path(sys.executable).absolute()
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.needs("systemd-analyze")
EXIT_CONFIG = 2


def installed_systemd() -> int | None:
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        return None
    found = subprocess.run([systemctl, "--version"], capture_output=True, text=True, check=False)
    return parse_systemd_version(found.stdout)


def unit(scope: str = "user", **overrides: object) -> LeaderUnit:
    fields: dict[str, object] = {
        "scope": scope,
        "python": PYTHON,
        "home": Path("/srv/berth-leader"),
        "public_url": "https://leader.lan:11500",
        "user_name": "berthsvc" if scope == "system" else None,
        "search_path": (PYTHON.parent, Path("/usr/bin")),
        "ports": (11500, 11501),
        "systemd_version": 252,
    }
    fields.update(overrides)
    return LeaderUnit(**fields)  # type: ignore[arg-type]


def settings(text: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit, in order, whatever its section."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def verify(path: Path, scope: str) -> None:
    """``systemd-analyze [--user] verify PATH`` passes, with no unknown or ignored key.

    ``--user`` needs ``$XDG_RUNTIME_DIR``: a private one directly under the system's
    temporary folder (the user units the manager loads name sockets below it, and a
    socket's path holds at most 107 bytes, which an xdist worker's ``tmp_path`` outgrows).
    """
    assert SYSTEMD_ANALYZE is not None
    env = dict(os.environ)
    args = [SYSTEMD_ANALYZE, "verify", str(path)]
    with tempfile.TemporaryDirectory(prefix="xdg-") as runtime:
        os.chmod(runtime, 0o700)
        if scope == "user":
            env["XDG_RUNTIME_DIR"] = runtime
            args.insert(1, "--user")
        result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Unknown" not in output and "ignoring" not in output, output


# -- the unit -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "systemd_steps"),
    [(None, False), (249, False), (252, False), (254, True), (257, True)],
)
def test_the_restart_delay_rises_on_every_systemd(version: int | None, systemd_steps: bool) -> None:
    found = settings(render_unit(unit(systemd_version=version)))
    argv = shlex.split(found["ExecStart"][0])
    assert argv[:7] == [str(PYTHON), "-m", "berth", "--home", "/srv/berth-leader", "daemon",
                        "start"]  # fmt: skip
    assert "--foreground" in argv  # systemd supervises the process itself: no fork
    assert found["Restart"] == ["on-failure"] and found["RestartSec"] == ["5s"]
    # RestartSteps= needs RestartMaxDelaySec= and systemd 254; before, the leader waits.
    assert ("RestartSteps" in found) is systemd_steps
    assert ("RestartMaxDelaySec" in found) is systemd_steps
    assert ("--restart-backoff" in argv) is not systemd_steps
    if systemd_steps:
        assert (found["RestartSteps"], found["RestartMaxDelaySec"]) == (["6"], ["300s"])


def test_a_hand_over_is_restarted_and_no_failure_and_a_stop_is_not_restarted() -> None:
    found = settings(render_unit(unit()))
    assert found["SuccessExitStatus"] == [str(STANDBY_RESTART_EXIT)]
    assert found["RestartForceExitStatus"] == [str(STANDBY_RESTART_EXIT)]
    assert found["StartLimitIntervalSec"] == ["0"]
    assert found["KillMode"] == ["process"]  # node local's engines outlive a crash
    assert found["Type"] == ["simple"] and found["WantedBy"] == ["default.target"]
    assert "User" not in found and "NoNewPrivileges" not in found


def test_the_system_unit_runs_as_its_user_sandboxed_and_may_bind_low_ports() -> None:
    found = settings(render_unit(unit("system", ports=(443, 11501))))
    assert found["User"] == ["berthsvc"]
    assert found["After"] == ["network-online.target docker.service postgresql.service"]
    assert found["ProtectSystem"] == ["full"]
    assert found["ReadWritePaths"] == ["/srv/berth-leader"]
    assert found["LimitNOFILE"] == ["65536"]
    assert found["AmbientCapabilities"] == ["CAP_NET_BIND_SERVICE"]
    assert "AmbientCapabilities" not in settings(render_unit(unit("system")))


def test_no_setting_goes_into_the_unit_only_an_environment_file() -> None:
    found = settings(render_unit(unit(environment_file=Path("/etc/berth/leader env"))))
    assert found["EnvironmentFile"] == ['"/etc/berth/leader env"']
    assert [e.split("=")[0].strip('"') for e in found["Environment"]] == [
        "BERTH_HOME", "PATH", "PYTHONUNBUFFERED",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("scope", "overrides", "message"),
    [
        ("system", {"user_name": "root"}, "runs the leader as root"),
        ("system", {"user_name": None}, "needs the user to run the leader"),
        ("user", {"user_name": "alice"}, "takes no user name"),
        ("user", {"ports": (443, 11501)}, "cannot bind port 443"),
        ("user", {"home": Path("relative")}, "absolute path"),
        ("user", {"environment_file": Path("leader.env")}, "absolute path"),
    ],
)
def test_a_unit_systemd_could_not_run_is_refused(
    scope: str, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        render_unit(unit(scope, **overrides))


@needs_systemd_analyze
@pytest.mark.parametrize("scope", ["user", "system"])
@pytest.mark.parametrize("home_name", ["leader-home", "my leader 100% $HOME"])
def test_systemd_analyze_verify_accepts_the_units(
    tmp_path: Path, scope: str, home_name: str
) -> None:
    home = tmp_path / home_name
    home.mkdir()
    env_file = tmp_path / "leader.env"
    env_file.write_text("BERTH_LOG_LEVEL=info\n")
    path = tmp_path / scope / UNIT_NAME
    path.parent.mkdir()
    path.write_text(
        render_unit(
            unit(scope, home=home, systemd_version=installed_systemd(), environment_file=env_file)
        )
    )
    verify(path, scope)


# -- the restart delay where systemd has none ----------------------------------------------


@pytest.mark.parametrize(
    ("previous", "failures"),
    [
        (None, 0),
        (RunRecord(1000.0, 4, clean_exit=True), 0),  # stopped on request, or handed over
        (RunRecord(1000.0, 0), 1),  # failed after a short run
        (RunRecord(1000.0, 3), 4),
        (RunRecord(1000.0 - HEALTHY_AFTER_S, 5), 1),  # failed after a long, healthy run
    ],
)
def test_failures_in_a_row_are_counted_until_a_run_ends_cleanly_or_lasts(
    previous: RunRecord | None, failures: int
) -> None:
    assert next_run(previous, 1010.0) == RunRecord(1010.0, failures)


def test_the_wait_doubles_from_restart_sec_up_to_five_minutes() -> None:
    waits = [5.0 + start_delay_s(n) for n in range(1, 9)]  # systemd's 5 s plus berth's
    assert waits == [5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0]
    assert start_delay_s(0) == 0.0


def test_a_damaged_record_costs_nothing(tmp_path: Path) -> None:
    path = tmp_path / "restarts-leader.json"
    assert read_record(path) is None
    for text in ("{", "[]", '{"started_at": "x", "failures": 1, "clean_exit": false}'):
        path.write_text(text)
        assert read_record(path) is None
    write_record(path, RunRecord(12.5, 2))
    assert read_record(path) == RunRecord(12.5, 2) and path.stat().st_mode & 0o777 == 0o600


# -- the command ----------------------------------------------------------------------------


@pytest.fixture
def user_home(tmp_path: Path) -> Path:
    path = tmp_path / "user-home"
    path.mkdir()
    return path


def install(
    home: Path | None, *args: str, user_home: Path, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m berth [--home HOME] daemon install-service ARGS`` with ``HOME=user_home``
    and no ``BERTH_*``, ``SUDO_*`` or ``XDG_*`` unless ``env`` sets them."""
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BERTH_", "SUDO_", "XDG_")) and k != "HOME"
    }
    full_env.update({"HOME": str(user_home), "COLUMNS": "200"})
    full_env.update(env or {})
    home_args = ["--home", str(home)] if home is not None else []
    return subprocess.run(
        [str(PYTHON), "-m", "berth", *home_args, "daemon", "install-service", *args],
        capture_output=True, text=True, env=full_env, cwd=user_home, timeout=60,
    )  # fmt: skip


def user_unit_path(user_home: Path) -> Path:
    return user_home / ".config" / "systemd" / "user" / UNIT_NAME


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@needs_systemd_analyze
def test_a_user_unit_is_written_for_a_new_home_and_verified(
    tmp_path: Path, user_home: Path
) -> None:
    home = tmp_path / "leader"
    result = install(home, "--no-start", user_home=user_home)
    assert result.returncode == 0, result.stderr
    path = user_unit_path(user_home)
    assert f"wrote {path} (user unit; runs as you, home {home}; restart delay rising" in (
        result.stdout
    )
    assert "systemctl --user enable --now berth-leader.service" in result.stdout
    assert home.is_dir() and home.stat().st_mode & 0o777 == 0o700
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    verify(path, "user")
    again = install(home, "--no-start", user_home=user_home)
    assert again.returncode == 0 and f"{path} is up to date" in again.stdout


def test_settings_the_service_could_not_use_are_refused_at_install(
    tmp_path: Path, user_home: Path
) -> None:
    home = tmp_path / "leader"
    home.mkdir()
    (home / "config.toml").write_text('[server]\npublic_port = "not a port"\n')
    result = install(home, "--no-start", user_home=user_home)
    assert result.returncode == EXIT_CONFIG
    assert f"{home / 'config.toml'}:2" in error_line(result)
    assert not user_unit_path(user_home).exists()


def test_shell_settings_the_service_would_miss_are_named_never_shown(
    tmp_path: Path, user_home: Path
) -> None:
    url = "postgresql+psycopg://berth:pw-not-for-the-unit@db.lan/berth"
    result = install(tmp_path / "leader", "--no-start", user_home=user_home,
                     env={"BERTH_DATABASE_URL": url})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "BERTH_DATABASE_URL is set in this shell but the service will not see it" in (
        result.stderr
    )
    assert "pw-not-for-the-unit" not in result.stdout + result.stderr
    assert "pw-not-for-the-unit" not in user_unit_path(user_home).read_text()


def test_an_environment_file_others_may_read_is_refused(tmp_path: Path, user_home: Path) -> None:
    env_file = tmp_path / "leader.env"
    env_file.write_text("BERTH_CLUSTER_SECRET=a-secret-of-more-than-16\n")
    env_file.chmod(0o644)
    refused = install(tmp_path / "leader", "--env-file", str(env_file), "--no-start",
                      user_home=user_home)  # fmt: skip
    assert refused.returncode == EXIT_CONFIG
    assert "readable by others" in error_line(refused) and "chmod 600" in error_line(refused)
    env_file.chmod(0o600)
    taken = install(tmp_path / "leader", "--env-file", str(env_file), "--no-start",
                    user_home=user_home)  # fmt: skip
    assert taken.returncode == 0, taken.stderr
    assert f"EnvironmentFile={env_file}" in user_unit_path(user_home).read_text()
    assert "a-secret-of-more-than-16" not in user_unit_path(user_home).read_text()


def test_an_agents_home_is_refused(tmp_path: Path, user_home: Path) -> None:
    home = tmp_path / "agent"
    home.mkdir()
    (home / "agent.yaml").write_text("node_id: n\n")
    result = install(home, "--no-start", user_home=user_home)
    assert result.returncode == EXIT_CONFIG
    assert "berth agent install-service" in error_line(result)


def test_a_different_unit_is_replaced_only_with_force(tmp_path: Path, user_home: Path) -> None:
    path = user_unit_path(user_home)
    path.parent.mkdir(parents=True)
    path.write_text("[Service]\nExecStart=/usr/bin/true\n")
    refused = install(tmp_path / "leader", "--no-start", user_home=user_home)
    assert refused.returncode == EXIT_CONFIG and "--force" in error_line(refused)
    replaced = install(tmp_path / "leader", "--no-start", "--force", user_home=user_home)
    assert replaced.returncode == 0, replaced.stderr
    assert "systemctl --user restart berth-leader.service" in replaced.stdout


@pytest.fixture
def service_account() -> Iterator[str]:
    """A non-root account for a system unit: this one when not root, else ``nobody``."""
    if os.geteuid() != 0:
        yield pwd.getpwuid(os.geteuid()).pw_name
        return
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root and there is no 'nobody' account to run a unit as")
    yield "nobody"


@needs_systemd_analyze
def test_a_system_unit_runs_as_sudo_user_in_a_home_made_for_it(
    tmp_path: Path, user_home: Path, service_account: str
) -> None:
    home = tmp_path / "leader"
    unit_dir = tmp_path / "system-units"
    result = install(home, "--system", "--unit-dir", str(unit_dir), "--no-start",
                     user_home=user_home, env={"SUDO_USER": service_account})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"runs as {service_account}" in result.stdout
    assert home.stat().st_uid == pwd.getpwnam(service_account).pw_uid
    path = unit_dir / UNIT_NAME
    assert settings(path.read_text())["User"] == [service_account]
    verify(path, "system")
    as_root = install(home, "--system", "--user-name", "root", "--unit-dir", str(unit_dir),
                      "--no-start", user_home=user_home)  # fmt: skip
    assert as_root.returncode == EXIT_CONFIG and "as root" in error_line(as_root)


# -- the unit's ExecStart, run as systemd would ----------------------------------------------


def service(home: Path, user_home: Path) -> tuple[list[str], dict[str, str]]:
    """The ``ExecStart=`` argv of the leader's user unit for ``home``, and the environment
    systemd gives it (the unit's ``Environment=`` lines; the installed systemd's version
    decides ``--restart-backoff``)."""
    result = install(home, "--no-start", user_home=user_home)
    assert result.returncode == 0, result.stderr
    found = settings(user_unit_path(user_home).read_text())
    env = {"HOME": str(user_home)}
    for assignment in found["Environment"]:
        name, _, value = assignment.strip('"').partition("=")
        env[name] = value
    return shlex.split(found["ExecStart"][0]), env


@pytest.mark.slow
def test_a_leader_run_by_its_unit_exits_75_after_a_step_down_and_0_when_stopped(
    tmp_path: Path, user_home: Path
) -> None:
    home = tmp_path / "leader"
    home.mkdir()
    database = tmp_path / "shared.db"
    (home / "config.toml").write_text(
        f'[store]\ndatabase_url = "sqlite:///{database}"\nleader_ha = true\n'
        f"leader_lease_s = 2.0\n[server]\npublic_port = {find_free_port()}\n"
        f"leader_only = true\n[cluster]\ncluster_port = {find_free_port()}\n"
    )
    argv, env = service(home, user_home)
    assert "--restart-backoff" in argv or (installed_systemd() or 0) >= 254
    statuses = []
    for ending in (["leader", "step-down", "--force"], ["daemon", "stop"]):
        with (tmp_path / "leader.out").open("ab") as out:
            leader = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                      cwd="/", start_new_session=True)  # fmt: skip
        try:
            wait_for(lambda: cli(home, "daemon", "status", env=env, check=False).returncode == 0,
                     60.0, "the leader to answer")  # fmt: skip
            cli(home, *ending, env=env)
            statuses.append(leader.wait(timeout=60))
        finally:
            if leader.poll() is None:
                leader.kill()
                leader.wait()
    print("exit statuses: after a step-down, after a stop:", statuses)
    assert statuses == [STANDBY_RESTART_EXIT, 0]
    record = read_record(home / "restarts-leader.json")
    if "--restart-backoff" in argv:  # both ended cleanly: the next start waits for nothing
        assert record is not None and record.clean_exit and record.failures == 0


@pytest.mark.slow
def test_a_leader_that_keeps_failing_waits_longer_before_each_start(tmp_path: Path) -> None:
    """The record says the last run (itself after a failure) did not end cleanly: two
    failed runs in a row. The start waits 5 s more than systemd's own 5 s and says so; its
    port is taken, so it fails too, and the record counts two failures before it."""
    home = tmp_path / "leader"
    home.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (home / "config.toml").write_text(f"[server]\npublic_port = {port}\n")
        write_record(home / "restarts-leader.json", RunRecord(time.time() - 6, 1))
        began = time.monotonic()
        result = subprocess.run(
            [str(PYTHON), "-m", "berth", "--home", str(home), "daemon", "start", "--foreground",
             "--restart-backoff"],
            capture_output=True, text=True, env=clean_env({}), timeout=120,
        )  # fmt: skip
        took_s = time.monotonic() - began
    print(f"third start: exit {result.returncode} after {took_s:.1f} s")
    assert result.returncode != 0
    assert "2 failed runs in a row" in result.stderr and "waiting 5 s more" in result.stderr
    assert took_s >= 5.0
    record = read_record(home / "restarts-leader.json")
    assert record is not None and (record.failures, record.clean_exit) == (2, False)
    assert json.loads((home / "restarts-leader.json").read_text())["failures"] == 2
