"""``berth agent install-service``: the systemd unit that runs the agent, and the command.

The unit text is rendered in-process and checked line by line; ``systemd-analyze verify``
(the real one) must accept both scopes.  The command runs as a user would run it
(``python -m berth --home H agent install-service ...``) with ``HOME`` pointed at a temporary
folder, so a user unit lands there, and ``--unit-dir`` for system units: nothing is written
to the real ``~/.config/systemd`` or ``/etc/systemd``, and no test runs ``systemctl`` (each
passes ``--no-start`` or takes systemctl off ``PATH``, or is skipped where systemd runs).
One slow test enrolls a real agent with a real leader and runs the unit's ``ExecStart=``.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path

import pytest

from berth.agent.identity import save_agent_identity
from berth.agent.systemd_unit import (
    UNIT_NAME,
    AgentUnit,
    default_unit_dir,
    parse_systemd_version,
    render_unit,
    search_path_for,
    service_user_name,
)
from berth.errors import ConfigError
from berth.paths import BerthHome
from berth.unit_files import systemctl_commands
from support.cluster_harness import Cluster, clean_env

#: The interpreter berth runs in: a real executable, as ``systemd-analyze verify`` requires.
PYTHON = Path(sys.executable).absolute()
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
#: Skipped where missing (units not verified); a failure under CI=true.
needs_systemd_analyze = pytest.mark.needs("systemd-analyze")
#: Exit code of ``ConfigError`` and ``ConflictError`` in the CLI.
EXIT_CONFIG = 2
#: Whether systemd is this machine's init (sd_booted(3)): then systemctl would really run.
SYSTEMD_RUNNING = Path("/run/systemd/system").is_dir()


def unit(scope: str = "user", **overrides: object) -> AgentUnit:
    fields: dict[str, object] = {
        "scope": scope,
        "python": PYTHON,
        "home": Path("/srv/berth-agent"),
        "label": "gpu-a",
        "leader_url": "wss://leader.example:11501",
        "user_name": "berthsvc" if scope == "system" else None,
        "search_path": (PYTHON.parent, Path("/usr/bin")),
    }
    fields.update(overrides)
    return AgentUnit(**fields)  # type: ignore[arg-type]


def settings(text: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit, in order, whatever its section."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def verify(path: Path, scope: str) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze [--user] verify PATH``.

    The user manager that ``--user verify`` builds needs ``$XDG_RUNTIME_DIR`` to exist (in a
    container without a login session it is unset): a private one is made, directly under the
    system's temporary folder rather than under ``tmp_path``. The user units the manager loads
    name sockets below it (``gnupg/S.gpg-agent.browser``), and a socket's path holds at most
    107 bytes: under a pytest-xdist worker's ``tmp_path`` it no longer fits.
    """
    assert SYSTEMD_ANALYZE is not None
    env = dict(os.environ)
    args = [SYSTEMD_ANALYZE, "verify", str(path)]
    if scope != "user":
        return subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    with tempfile.TemporaryDirectory(prefix="xdg-") as runtime:
        os.chmod(runtime, 0o700)
        env["XDG_RUNTIME_DIR"] = runtime
        args.insert(1, "--user")
        return subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)


def assert_verified(result: subprocess.CompletedProcess[str]) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Unknown" not in output and "ignoring" not in output, output


# -- rendering --------------------------------------------------------------------------


def test_the_user_unit_runs_the_agent_for_its_home_with_absolute_paths() -> None:
    text = render_unit(unit("user"))
    found = settings(text)
    assert found["ExecStart"] == [
        f"{PYTHON} -m berth --home /srv/berth-agent agent start --paced-restarts"
    ]
    assert "Environment" in found
    assert "BERTH_HOME=/srv/berth-agent" in found["Environment"]
    assert f"PATH={PYTHON.parent}:/usr/bin" in found["Environment"]
    assert found["Restart"] == ["on-failure"]
    assert found["RestartSec"] == ["5s"]
    assert found["RestartPreventExitStatus"] == ["78"]  # enroll the node again first
    assert found["KillMode"] == ["process"]  # engines outlive an agent restart
    assert found["WantedBy"] == ["default.target"]
    assert "User" not in found
    assert "After" not in found  # the user manager has no network-online.target
    assert "NoNewPrivileges" not in found
    assert text.endswith("\n")


def test_the_system_unit_runs_as_its_user_after_the_network_with_sandboxing() -> None:
    found = settings(render_unit(unit("system")))
    assert found["User"] == ["berthsvc"]
    assert found["Wants"] == ["network-online.target"]
    assert found["After"] == ["network-online.target docker.service"]
    assert found["ProtectSystem"] == ["full"]
    assert found["ReadWritePaths"] == ["/srv/berth-agent"]
    assert found["ProtectControlGroups"] == ["yes"]
    assert found["WantedBy"] == ["multi-user.target"]
    # Each of these implies NoNewPrivileges=yes with User=, which would stop CUDA's setuid
    # nvidia-modprobe; PrivateDevices/PrivateTmp would hide the GPUs or engines' /tmp.
    for breaking in (
        "NoNewPrivileges", "PrivateDevices", "PrivateTmp", "ProtectHome", "ProtectKernelModules",
        "ProtectKernelTunables", "ProtectClock", "SystemCallFilter", "RestrictAddressFamilies",
    ):  # fmt: skip
        assert breaking not in found


@pytest.mark.parametrize(
    ("version", "backoff"), [(None, False), (252, False), (253, False), (254, True), (257, True)]
)
def test_the_restart_delay_grows_on_every_systemd_version(
    version: int | None, backoff: bool
) -> None:
    """systemd raises it itself from 254 on; before, the agent paces its own restarts."""
    found = settings(render_unit(unit("system", systemd_version=version)))
    assert ("RestartSteps" in found) is backoff
    assert ("RestartMaxDelaySec" in found) is backoff
    assert found["ExecStart"][0].endswith("agent start --paced-restarts") is not backoff
    assert found["RestartSec"] == ["5s"]
    assert found["RestartPreventExitStatus"] == ["78"]


def test_paths_with_spaces_percent_dollar_and_quotes_are_escaped() -> None:
    home = Path('/srv/my agent/100%$HOME"x\\y')
    found = settings(render_unit(unit("system", home=home)))
    quoted = '"/srv/my agent/100%%$$HOME\\"x\\\\y"'
    assert found["ExecStart"] == [f"{PYTHON} -m berth --home {quoted} agent start --paced-restarts"]
    # Environment= and ReadWritePaths= take "$" literally; "%" is still a specifier.
    assert '"BERTH_HOME=/srv/my agent/100%%$HOME\\"x\\\\y"' in found["Environment"]
    assert found["ReadWritePaths"] == ['"/srv/my agent/100%%$HOME\\"x\\\\y"']


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"python": Path("bin/python")}, "absolute path"),
        ({"home": Path("relative/home")}, "absolute path"),
        ({"home": Path("/srv/a\nb")}, "control character"),
        ({"user_name": None}, "needs the user"),
        ({"user_name": "root"}, "as root"),
        ({"user_name": "two words"}, "not a usable user name"),
        ({"search_path": (Path("opt/bin"),)}, "PATH entries"),
    ],
)
def test_a_system_unit_refuses_what_systemd_could_not_run(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        render_unit(unit("system", **overrides))


def test_a_user_unit_takes_no_user_name() -> None:
    with pytest.raises(ConfigError, match="runs as its owner"):
        render_unit(unit("user", user_name="alice"))


@pytest.mark.parametrize(
    ("sudo_user", "user_name", "expected"),
    [
        ("alice", None, "alice"),
        ("alice", "bob", "bob"),
        (None, "bob", "bob"),
        ("", "bob", "bob"),
        (None, None, "SUDO_USER is not set"),
        ("", None, "SUDO_USER is not set"),
        ("root", None, "as root"),
        ("alice", "root", "as root"),
    ],
)
def test_the_system_unit_user_comes_from_the_flag_or_sudo_and_is_never_root(
    sudo_user: str | None, user_name: str | None, expected: str
) -> None:
    if expected in ("alice", "bob"):
        assert service_user_name(sudo_user=sudo_user, user_name=user_name) == expected
    else:
        with pytest.raises(ConfigError, match=expected) as raised:
            service_user_name(sudo_user=sudo_user, user_name=user_name)
        assert "--user-name NAME" in str(raised.value)


@pytest.mark.parametrize(
    ("scope", "xdg", "expected"),
    [
        ("user", None, "/home/alice/.config/systemd/user"),
        ("user", "/xdg/config", "/xdg/config/systemd/user"),
        ("user", "relative/ignored", "/home/alice/.config/systemd/user"),
        ("system", "/xdg/config", "/etc/systemd/system"),
    ],
)
def test_the_unit_goes_where_systemd_looks(scope: str, xdg: str | None, expected: str) -> None:
    found = default_unit_dir(
        scope,  # type: ignore[arg-type]
        user_home=Path("/home/alice"),
        xdg_config_home=xdg,
    )
    assert found == Path(expected)


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("systemd 252 (252.39-1~deb12u2)\n+PAM +AUDIT\n", 252),
        ("systemd 256 (256.7-1)", 256),
        ("", None),
        ("not systemd", None),
    ],
)
def test_the_systemd_version_is_read_from_systemctl(text: str, version: int | None) -> None:
    assert parse_systemd_version(text) == version


def test_a_replaced_unit_is_restarted_a_new_one_enabled_now() -> None:
    assert systemctl_commands("user", UNIT_NAME, restart=False) == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", UNIT_NAME],
    ]
    assert systemctl_commands("system", UNIT_NAME, restart=True) == [
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", UNIT_NAME],
        ["systemctl", "restart", UNIT_NAME],
    ]


def test_the_service_path_puts_berths_own_bin_first_then_the_installers() -> None:
    python = Path("/opt/venv/bin/python")
    found = search_path_for(python, "/usr/bin:relative:/opt/venv/bin::/usr/bin:/snap/bin")
    assert found == (Path("/opt/venv/bin"), Path("/usr/bin"), Path("/snap/bin"))
    assert search_path_for(python, None) == (Path("/opt/venv/bin"),)


# -- systemd-analyze verify ---------------------------------------------------------------


@needs_systemd_analyze
@pytest.mark.parametrize("scope", ["user", "system"])
@pytest.mark.parametrize("home_name", ["agent-home", "my agent 100% $HOME"])
def test_systemd_analyze_verify_accepts_the_units(
    tmp_path: Path, scope: str, home_name: str
) -> None:
    home = tmp_path / home_name
    home.mkdir()
    path = tmp_path / scope / UNIT_NAME
    path.parent.mkdir()
    text = render_unit(unit(scope, home=home, search_path=search_path_for(PYTHON, "/usr/bin")))
    path.write_text(text)
    assert_verified(verify(path, scope))


@needs_systemd_analyze
def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above is not vacuous: a unit whose program is missing is refused."""
    path = tmp_path / UNIT_NAME
    text = render_unit(unit("system", python=tmp_path / "no-such-python"))
    path.write_text(text)
    result = verify(path, "system")
    assert result.returncode != 0
    assert "no-such-python" in result.stdout + result.stderr


# -- the command --------------------------------------------------------------------------


def register(home: Path, label: str = "gpu-a") -> None:
    """Give ``home`` an agent identity as ``berth agent register`` writes it (the certificate
    files hold placeholders: install-service only checks they exist)."""
    save_agent_identity(
        BerthHome(home),
        leader_url="wss://leader.example:11501",
        node_id="node-0123",
        label=label,
        ca_fingerprint="sha256:" + "0" * 64,
        key_pem=b"placeholder\n",
        cert_pem=b"placeholder\n",
        ca_pem=b"placeholder\n",
        enrolled_at=datetime(2025, 1, 1, tzinfo=UTC),
    )


@pytest.fixture
def user_home(tmp_path: Path) -> Path:
    """The ``$HOME`` the command sees: a user unit goes under it."""
    path = tmp_path / "user-home"
    path.mkdir()
    return path


def install(
    home: Path | None,
    *args: str,
    user_home: Path,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m berth [--home HOME] agent install-service ARGS`` with ``HOME=user_home``,
    no ``SUDO_USER`` and no ``XDG_CONFIG_HOME`` unless ``env`` sets them."""
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BERTH_", "SUDO_", "XDG_")) and k != "HOME"
    }
    full_env.update({"HOME": str(user_home), "COLUMNS": "200"})
    full_env.update(env or {})
    home_args = ["--home", str(home)] if home is not None else []
    return subprocess.run(
        [str(PYTHON), "-m", "berth", *home_args, "agent", "install-service", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=user_home,
        timeout=60,
    )


def user_unit_path(user_home: Path) -> Path:
    return user_home / ".config" / "systemd" / "user" / UNIT_NAME


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_an_unregistered_home_is_refused_with_the_register_hint(
    tmp_path: Path, user_home: Path
) -> None:
    home = tmp_path / "agent"
    result = install(home, "--no-start", user_home=user_home)
    assert result.returncode == EXIT_CONFIG, result.stderr
    line = error_line(result)
    assert str(home) in line and "berth agent register --uri" in line
    assert not user_unit_path(user_home).exists()


@pytest.mark.parametrize(
    ("sudo_user", "extra", "message"),
    [
        (None, [], "$SUDO_USER is not set"),
        ("root", [], "runs the agent as root"),
        ("alice", ["--user-name", "root"], "runs the agent as root"),
    ],
)
def test_a_system_unit_is_refused_without_a_user_or_as_root(
    tmp_path: Path, user_home: Path, sudo_user: str | None, extra: list[str], message: str
) -> None:
    home = tmp_path / "agent"
    register(home)
    unit_dir = tmp_path / "system-units"
    env = {"SUDO_USER": sudo_user} if sudo_user is not None else {}
    result = install(
        home, "--system", "--unit-dir", str(unit_dir), "--no-start", *extra,
        user_home=user_home, env=env,
    )  # fmt: skip
    assert result.returncode == EXIT_CONFIG, result.stderr
    line = error_line(result)
    assert message in line
    assert "via sudo" in line and "--user-name NAME" in line
    assert not unit_dir.exists()


def test_user_name_is_refused_for_a_user_unit(tmp_path: Path, user_home: Path) -> None:
    home = tmp_path / "agent"
    register(home)
    result = install(home, "--user-name", "alice", "--no-start", user_home=user_home)
    assert result.returncode == EXIT_CONFIG
    assert "--system only" in error_line(result)


def test_an_unknown_service_user_is_refused(tmp_path: Path, user_home: Path) -> None:
    home = tmp_path / "agent"
    register(home)
    result = install(
        home, "--system", "--user-name", "no-such-user-berth", "--unit-dir", str(tmp_path),
        "--no-start", user_home=user_home,
    )  # fmt: skip
    assert result.returncode == EXIT_CONFIG
    assert "no user 'no-such-user-berth'" in error_line(result)


@needs_systemd_analyze
def test_a_user_unit_is_written_under_home_and_verified(tmp_path: Path, user_home: Path) -> None:
    home = tmp_path / "agent"
    register(home)
    result = install(home, "--no-start", user_home=user_home)
    assert result.returncode == 0, result.stderr
    path = user_unit_path(user_home)
    assert f"wrote {path}" in result.stdout
    assert "systemctl --user daemon-reload" in result.stdout
    assert "systemctl --user enable --now berth-agent.service" in result.stdout
    found = settings(path.read_text())
    start = f"{PYTHON} -m berth --home {home} agent start"
    # --paced-restarts where this host's systemd is older than 254 (or unknown)
    assert found["ExecStart"][0] in (start, f"{start} --paced-restarts")
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert_verified(verify(path, "user"))


def test_xdg_config_home_is_where_a_user_unit_goes(tmp_path: Path, user_home: Path) -> None:
    home = tmp_path / "agent"
    register(home)
    config = tmp_path / "xdg-config"
    result = install(home, "--no-start", user_home=user_home, env={"XDG_CONFIG_HOME": str(config)})
    assert result.returncode == 0, result.stderr
    assert (config / "systemd" / "user" / UNIT_NAME).is_file()
    assert not user_unit_path(user_home).exists()


def test_dry_run_prints_the_unit_and_writes_nothing(tmp_path: Path, user_home: Path) -> None:
    home = tmp_path / "agent"
    register(home)
    for flag in ("--dry-run", "--print"):
        result = install(home, flag, user_home=user_home)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("# Written by `berth agent install-service`")
        assert f"ExecStart={PYTHON} -m berth --home {home} agent start" in result.stdout
    assert not (user_home / ".config").exists()


def test_a_different_unit_is_replaced_only_with_force(tmp_path: Path, user_home: Path) -> None:
    home = tmp_path / "agent"
    register(home)
    path = user_unit_path(user_home)
    path.parent.mkdir(parents=True)
    path.write_text("[Service]\nExecStart=/usr/bin/true\n")

    refused = install(home, "--no-start", user_home=user_home)
    assert refused.returncode == EXIT_CONFIG
    line = error_line(refused)
    assert str(path) in line and "--force" in line
    assert path.read_text() == "[Service]\nExecStart=/usr/bin/true\n"

    replaced = install(home, "--no-start", "--force", user_home=user_home)
    assert replaced.returncode == 0, replaced.stderr
    assert "agent start" in path.read_text()
    # The running agent must pick the new unit up: restart, not just enable --now.
    assert "systemctl --user restart berth-agent.service" in replaced.stdout

    again = install(home, "--no-start", user_home=user_home)
    assert again.returncode == 0, again.stderr
    assert f"{path} is up to date" in again.stdout


def test_without_systemctl_the_commands_are_printed(tmp_path: Path, user_home: Path) -> None:
    home = tmp_path / "agent"
    register(home)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    result = install(home, user_home=user_home, env={"PATH": str(empty)})
    assert result.returncode == 0, result.stderr
    assert "systemctl is not installed here" in result.stdout
    assert "systemctl --user enable --now berth-agent.service" in result.stdout
    assert user_unit_path(user_home).is_file()


@pytest.mark.skipif(SYSTEMD_RUNNING, reason="systemd runs here: systemctl would really run")
@pytest.mark.needs("systemctl")
def test_where_systemd_does_not_run_the_commands_are_printed(
    tmp_path: Path, user_home: Path
) -> None:
    home = tmp_path / "agent"
    register(home)
    result = install(home, user_home=user_home)
    assert result.returncode == 0, result.stderr
    assert "systemd is not running on this host" in result.stdout
    assert "systemctl --user daemon-reload" in result.stdout


@pytest.fixture
def service_account(tmp_path: Path) -> Iterator[str]:
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
def test_a_system_unit_runs_as_sudo_user_and_is_verified(
    tmp_path: Path, user_home: Path, service_account: str
) -> None:
    home = tmp_path / "agent"
    register(home)
    account = pwd.getpwnam(service_account)
    os.chown(home, account.pw_uid, -1)  # a no-op when not root: it is ours already
    unit_dir = tmp_path / "system-units"
    result = install(
        home, "--system", "--unit-dir", str(unit_dir), "--no-start",
        user_home=user_home, env={"SUDO_USER": service_account},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"runs as {service_account}" in result.stdout
    assert "  systemctl daemon-reload" in result.stdout
    path = unit_dir / UNIT_NAME
    found = settings(path.read_text())
    assert found["User"] == [service_account]
    assert found["ReadWritePaths"] == [str(home)]
    check = verify(path, "system")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "Unknown" not in check.stderr


def test_a_system_unit_refuses_a_home_its_user_does_not_own(
    tmp_path: Path, user_home: Path, service_account: str
) -> None:
    home = tmp_path / "agent"
    register(home)
    if pwd.getpwnam(service_account).pw_uid == home.stat().st_uid:
        pytest.skip("not root: every home this test can make belongs to the service user")
    result = install(
        home, "--system", "--unit-dir", str(tmp_path / "units"), "--no-start",
        user_home=user_home, env={"SUDO_USER": service_account},
    )  # fmt: skip
    assert result.returncode == EXIT_CONFIG
    line = error_line(result)
    assert f"not {service_account}" in line and "chown" in line


def test_a_system_unit_defaults_to_the_service_users_home(
    tmp_path: Path, user_home: Path, service_account: str
) -> None:
    """Under sudo, ``HOME`` is root's: the default agent home is the service user's."""
    result = install(
        None, "--system", "--unit-dir", str(tmp_path / "units"), "--no-start",
        user_home=user_home, env={"SUDO_USER": service_account},
    )  # fmt: skip
    expected = Path(pwd.getpwnam(service_account).pw_dir).expanduser().resolve() / ".berth"
    if (expected / "agent.yaml").exists():
        pytest.skip(f"{expected} is a registered agent home on this machine")
    assert result.returncode == EXIT_CONFIG
    assert f"{expected} has no agent identity" in error_line(result)


# -- a real agent -------------------------------------------------------------------------


@pytest.mark.slow
def test_the_units_command_runs_a_really_enrolled_agent(tmp_path: Path) -> None:
    """Enroll a node with a real leader, install its unit, then run the unit's ``ExecStart=``
    with its ``Environment=`` (as systemd would, minus systemd): the node comes up ready."""
    cluster = Cluster(tmp_path / "cluster", clean_env({}))
    cluster.start()
    try:
        agent = cluster.enroll("svc")
        user_home = tmp_path / "user-home"
        user_home.mkdir()
        result = install(agent.home, "--no-start", user_home=user_home)
        assert result.returncode == 0, result.stderr
        found = settings(user_unit_path(user_home).read_text())
        argv = shlex.split(found["ExecStart"][0])
        assert argv[0] == str(PYTHON)
        env = {"HOME": str(user_home)}
        for assignment in found["Environment"]:
            name, _, value = assignment.partition("=")
            env[name] = value
        with (agent.home / "agent.out").open("ab") as log:
            agent.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd="/", start_new_session=True,
            )  # fmt: skip
        cluster.wait_node(agent.node_id, "ready")
    finally:
        cluster.close()
