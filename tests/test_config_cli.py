"""``berth config show|set-public|set-cluster|set-public-tls`` and the leader-only mode.

Pure parts (pair parsing, setting conversion) are tested in-process; the commands run as a
user runs them (``python -m berth``), on a fresh home, and bad input must fail with one
``error:`` line and leave ``config.toml`` as it was.  The slow test starts a real
``berth daemon start --leader-only`` with a real agent and a fake engine behind it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner, Result

from berth.cli.config_cmd import CLUSTER_KEYS, PUBLIC_KEYS, TLS_KEYS, parse_pairs
from berth.cli.main import app
from berth.cluster.pki.ca import CertificateAuthority
from berth.config import Settings, convert_setting
from berth.daemon.pieces import refuse_local_leftovers
from berth.errors import ConfigError, DaemonError
from berth.paths import BerthHome
from berth.store import Store
from support.cluster_harness import Cluster, clean_env, fake_engine_wrapper
from support.fake_llama_server import ANSWER

#: Exit code of ``ConfigError`` / ``ConflictError`` (bad input), and of ``DaemonError``.
EXIT_CONFIG = 2
EXIT_DAEMON = 3

OTHER_SECTIONS = '[daemon]\nlog_level = "debug"\n\n[cluster]\ncluster_port = 12000\n'


# -- pure parts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pairs", "keys", "message"),
    [
        ([], PUBLIC_KEYS, "nothing to set: give one or more of host=, port=, bind="),
        (["hots=a"], PUBLIC_KEYS, "unknown key 'hots'; valid keys: host=, port=, bind="),
        (["cert=/a"], CLUSTER_KEYS, "unknown key 'cert'; valid keys: host=, port=, bind="),
        (["host=a"], TLS_KEYS, "unknown key 'host'; valid keys: cert=, key="),
        (["host"], PUBLIC_KEYS, "malformed argument 'host': expected KEY=VALUE"),
        (["=a"], PUBLIC_KEYS, "malformed argument '=a'"),
        (["host="], PUBLIC_KEYS, "host= needs a value"),
        (["port=  "], PUBLIC_KEYS, "port= needs a value"),
        (["host=a", "host=b"], PUBLIC_KEYS, "host= is given twice"),
        (
            ["port=https"],
            PUBLIC_KEYS,
            "port=https: invalid public_port 'https': expected an integer",
        ),
        (["port=65536"], CLUSTER_KEYS, "invalid cluster_port '65536': must be at most 65535"),
        (["port=-1"], PUBLIC_KEYS, "must be at least 0"),
        (["port=1.5"], PUBLIC_KEYS, "expected an integer"),
        (["host=https://api.example.com"], PUBLIC_KEYS, "without scheme, port or path"),
        (["host=api.example.com:443"], PUBLIC_KEYS, "without scheme, port or path"),
        (["bind=0.0.0.0/24"], CLUSTER_KEYS, "expected a host name or IP address"),
        (["host=my host"], PUBLIC_KEYS, "expected a host name or IP address"),
    ],
)
def test_bad_pairs_are_refused_with_the_reason(
    pairs: list[str], keys: Mapping[str, str], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_pairs(pairs, keys, relative_to=tmp_path)

    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_good_pairs_convert_to_typed_settings(tmp_path: Path) -> None:
    public = parse_pairs(["host=api.example.com", "port=443", "bind=::"], PUBLIC_KEYS,
                         relative_to=tmp_path)  # fmt: skip
    tls = parse_pairs(["cert=tls/cert.pem", "key=/etc/k.pem"], TLS_KEYS, relative_to=tmp_path)

    assert public == {"public_host": "api.example.com", "public_port": 443, "public_bind": "::"}
    assert tls == {"public_cert": tmp_path / "tls" / "cert.pem", "public_key": Path("/etc/k.pem")}


@pytest.mark.parametrize("host", ["api.example.com", "10.0.0.5", "::1", "[::1]", "gpu_box", "h."])
def test_host_settings_take_names_and_addresses(host: str, tmp_path: Path) -> None:
    assert convert_setting("cluster_host", host, where="test", relative_to=tmp_path) == host


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("YES", True), (" on ", True), ("0", False), ("off", False)],
)
def test_leader_only_reads_from_the_environment(raw: str, expected: bool, tmp_path: Path) -> None:
    settings = Settings.load(BerthHome(tmp_path), env={"BERTH_LEADER_ONLY": raw})

    assert settings.leader_only is expected
    assert settings.source("leader_only") == "env"


@pytest.mark.parametrize("raw", ["maybe", "2", ""])
def test_a_bad_leader_only_value_names_the_variable(raw: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"BERTH_LEADER_ONLY.*expected true or false"):
        Settings.load(BerthHome(tmp_path), env={"BERTH_LEADER_ONLY": raw})


def test_leader_only_in_the_file_must_be_a_toml_boolean(tmp_path: Path) -> None:
    home = BerthHome(tmp_path)
    home.config_file.write_text("[server]\nleader_only = 1\n")

    with pytest.raises(ConfigError) as caught:
        Settings.load(home, env={})

    assert str(caught.value).startswith(f"{home.config_file}:2: ")
    assert "expected true or false" in str(caught.value)
    home.config_file.write_text("[server]\nleader_only = true\n")
    assert Settings.load(home, env={}).leader_only is True


def test_a_leader_only_start_is_refused_while_local_deployments_are_active(
    tmp_path: Path,
) -> None:
    with Store(f"sqlite:///{tmp_path / 'berth.db'}") as store:
        store.migrate()
        store.ensure_local_node()
        store.add_model("tiny", tmp_path / "tiny.gguf")
        refuse_local_leftovers(store)  # nothing active: fine
        record = store.create_deployment("tiny", "llamacpp", "process", "local")

        with pytest.raises(DaemonError) as caught:
            refuse_local_leftovers(store)

    assert record.id in str(caught.value)
    assert "start once without --leader-only" in str(caught.value)


# -- the commands --------------------------------------------------------------------------------


def berth(
    populated_home: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real CLI, as a user runs it, from the home's parent folder."""
    return subprocess.run(
        [sys.executable, "-m", "berth", "--home", str(populated_home), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(env or {}),
        cwd=populated_home.parent,
    )


def invoke(populated_home: Path, *args: str, env: Mapping[str, str] | None = None) -> Result:
    """The same commands in-process (no interpreter start-up), from the home's parent folder,
    with no ``BERTH_*`` variable but those in ``env``."""
    environ: dict[str, str | None] = {k: None for k in os.environ if k.startswith("BERTH_")}
    environ.update(env or {})
    with contextlib.chdir(populated_home.parent):
        return CliRunner().invoke(app, ["--home", str(populated_home), *args], env=environ)


def refused(result: Result) -> str:
    """The message of the ``ConfigError`` an in-process command stopped with."""
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    assert result.stdout == ""
    message = str(result.exception)
    assert "\n" not in message
    return message


@pytest.fixture
def populated_home(tmp_path: Path) -> Path:
    """A home with a config file that has other sections, which every write must keep."""
    root = tmp_path / "home"
    root.mkdir(mode=0o700)
    (root / "config.toml").write_text(OTHER_SECTIONS)
    return root


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["set-public", "hots=a"], "error: unknown key 'hots'; valid keys: host=, port=, bind="),
        (["set-cluster", "host"], "error: malformed argument 'host': expected KEY=VALUE"),
        (["set-public", "port=eleven"], "invalid public_port 'eleven': expected an integer"),
    ],
)
def test_the_real_cli_refuses_bad_input_with_one_line(
    populated_home: Path, args: list[str], message: str
) -> None:
    result = berth(populated_home, "config", *args)

    assert result.returncode == EXIT_CONFIG
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert (populated_home / "config.toml").read_text() == OTHER_SECTIONS


def test_the_real_cli_writes_what_config_show_then_reads(populated_home: Path) -> None:
    done = berth(
        populated_home, "config", "set-public", "host=api.example.com", "port=8443", "bind=0.0.0.0"
    )
    shown = json.loads(berth(populated_home, "config", "show", "--json").stdout)

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0] == f"updated {populated_home / 'config.toml'}"
    assert "  public_host   127.0.0.1 (default) → api.example.com" in lines
    assert "  public_port   11500 (default) → 8443" in lines
    assert "  public_bind   127.0.0.1 (default) → 0.0.0.0" in lines
    assert "public URL:  https://api.example.com:8443" in lines
    assert "takes effect at the next `berth daemon start`" in lines
    assert shown["public_url"] == "https://api.example.com:8443"
    assert shown["settings"]["public_bind"] == {"value": "0.0.0.0", "source": "file"}
    settings = Settings.load(BerthHome(populated_home), env={})
    assert (settings.log_level, settings.cluster_port) == ("debug", 12000)  # other sections kept
    assert (populated_home / "config.toml").stat().st_mode & 0o777 == 0o600


def test_setting_the_same_value_again_changes_nothing(populated_home: Path) -> None:
    invoke(populated_home, "config", "set-public", "port=8443")
    before = (populated_home / "config.toml").stat().st_mtime_ns

    again = invoke(populated_home, "config", "set-public", "port=8443")

    assert again.exit_code == 0
    assert f"{populated_home / 'config.toml'} already has these values" in again.stdout
    assert "  public_port   8443 (unchanged)" in again.stdout
    assert "takes effect" not in again.stdout
    assert (populated_home / "config.toml").stat().st_mtime_ns == before


def test_a_default_value_written_to_the_file_says_so(populated_home: Path) -> None:
    done = invoke(populated_home, "config", "set-public", "port=11500")

    assert done.exit_code == 0, done.output
    assert "  public_port   11500 (default, now set in the file)" in done.stdout
    assert Settings.load(BerthHome(populated_home), env={}).source("public_port") == "file"


def test_set_cluster_changes_the_url_agents_dial(populated_home: Path) -> None:
    done = invoke(populated_home, "config", "set-cluster", "host=cluster.example.com", "bind=::")

    assert done.exit_code == 0, done.output
    assert "cluster URL: https://cluster.example.com:12000" in done.stdout
    settings = Settings.load(BerthHome(populated_home), env={})
    assert settings.cluster_url() == "https://cluster.example.com:12000"
    assert (settings.cluster_bind, settings.source("cluster_bind")) == ("::", "file")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["set-public", "public_port=1"], "unknown key 'public_port'; valid keys: host=, port="),
        (["set-public", "host=a", "host=b"], "host= is given twice"),
        (["set-cluster", "port="], "port= needs a value"),
        (["set-cluster", "port=99999"], "invalid cluster_port '99999': must be at most 65535"),
        (["set-public", "host=https://x.example"], "without scheme, port or path"),
        (["set-public-tls", "cert=/a", "chain=/b"], "unknown key 'chain'; valid keys: cert=, key="),
        (["set-public-tls", "cert=/etc/cert.pem"], "cert= needs its pair: give both cert= and"),
        (["set-public-tls", "key=/etc/key.pem"], "key= needs its pair: give both cert= and"),
    ],
)
def test_bad_input_is_refused_and_leaves_the_file(
    populated_home: Path, args: list[str], message: str
) -> None:
    assert message in refused(invoke(populated_home, "config", *args))
    assert (populated_home / "config.toml").read_text() == OTHER_SECTIONS


def test_a_value_overridden_by_the_environment_is_written_with_a_warning(
    populated_home: Path,
) -> None:
    done = invoke(
        populated_home, "config", "set-public", "port=8443", env={"BERTH_PUBLIC_PORT": "9000"}
    )

    assert done.exit_code == 0, done.output
    assert "  public_port   9000 (env) → 8443" in done.stdout
    assert "public URL:  https://127.0.0.1:9000" in done.stdout
    assert "warning: BERTH_PUBLIC_PORT is set in the environment and overrides the file" in (
        done.stderr
    )


@pytest.mark.parametrize(
    ("args", "warning"),
    [
        (["set-cluster", "host=gpu-box.lan"], "cluster_bind is 127.0.0.1: only this host can"),
        (["set-public", "port=0"], "public_port = 0 picks a free port at each start"),
    ],
)
def test_settings_that_will_not_work_for_others_get_a_warning(
    populated_home: Path, args: list[str], warning: str
) -> None:
    done = invoke(populated_home, "config", *args)

    assert done.exit_code == 0, done.output
    assert f"warning: {warning}" in done.stderr


def test_set_public_tls_warns_about_missing_files_but_writes_them(populated_home: Path) -> None:
    done = invoke(
        populated_home, "config", "set-public-tls", "cert=tls/cert.pem", "key=/nowhere/key.pem"
    )

    assert done.exit_code == 0, done.output
    cert = populated_home.parent / "tls" / "cert.pem"  # relative to where the command ran
    assert done.stderr.splitlines() == [
        f"warning: the certificate {cert} does not exist yet; the daemon will not start until "
        "it does",
        "warning: the key /nowhere/key.pem does not exist yet; the daemon will not start until "
        "it does",
    ]
    settings = Settings.load(BerthHome(populated_home), env={})
    assert (settings.public_cert, settings.public_key) == (cert, Path("/nowhere/key.pem"))


@pytest.fixture
def server_pairs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A certificate, its key, and another certificate's key (issued by a throwaway CA)."""
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    ca.issue_server_certificate(["api.example.com"], tmp_path / "a.pem", tmp_path / "a.key")
    ca.issue_server_certificate(["other.example.com"], tmp_path / "b.pem", tmp_path / "b.key")
    return tmp_path / "a.pem", tmp_path / "a.key", tmp_path / "b.key"


def test_set_public_tls_accepts_a_matching_pair(
    populated_home: Path, server_pairs: tuple[Path, Path, Path]
) -> None:
    cert, key, _ = server_pairs

    done = invoke(populated_home, "config", "set-public-tls", f"cert={cert}", f"key={key}")

    assert done.exit_code == 0, done.output
    assert done.stderr == ""
    assert f"  public_cert   unset (default) → {cert}" in done.stdout
    assert Settings.load(BerthHome(populated_home), env={}).public_key == key


@pytest.mark.parametrize("wrong", ["other key", "folder", "not pem"])
def test_set_public_tls_refuses_files_that_do_not_load(
    populated_home: Path, server_pairs: tuple[Path, Path, Path], wrong: str
) -> None:
    cert, key, other_key = server_pairs
    if wrong == "other key":
        key = other_key
    elif wrong == "folder":
        key = key.parent
    else:
        cert.write_text("not a certificate\n")

    message = refused(
        invoke(populated_home, "config", "set-public-tls", f"cert={cert}", f"key={key}")
    )

    expected = "is a folder, not a PEM file" if wrong == "folder" else "do not load as a"
    assert expected in message
    assert (populated_home / "config.toml").read_text() == OTHER_SECTIONS


def test_config_show_gives_the_urls_and_the_file(populated_home: Path) -> None:
    env = {"BERTH_PUBLIC_HOST": "api.example.com", "BERTH_LEADER_URL": "https://lb.example:443"}

    table = invoke(populated_home, "config", "show", env=env).stdout
    shown = json.loads(invoke(populated_home, "config", "show", "--json", env=env).stdout)

    assert table.splitlines()[:3] == [
        f"config file: {populated_home / 'config.toml'}",
        "public URL:  https://api.example.com:11500",
        "cluster URL: https://lb.example:443",
    ]
    (row,) = [line for line in table.splitlines() if " leader_only " in line]
    assert row.replace("│", " ").split() == ["leader_only", "false", "default"]
    assert shown["config_file"] == str(populated_home / "config.toml")
    assert shown["config_file_exists"] is True
    assert shown["public_url"] == "https://api.example.com:11500"
    assert shown["cluster_url"] == "https://lb.example:443"
    assert shown["settings"]["public_host"] == {"value": "api.example.com", "source": "env"}
    assert shown["settings"]["leader_only"] == {"value": False, "source": "default"}


def test_a_cluster_port_in_use_fails_the_start_naming_the_listener(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        result = berth(home, "daemon", "start", "--public-port", "0", "--cluster-port", str(port))

    assert result.returncode == EXIT_DAEMON
    assert result.stderr.startswith(
        f"error: the daemon failed to start: cluster listener 127.0.0.1:{port}: "
        "address already in use"
    )
    assert not (home / "daemon.pid").exists()
    assert not (home / "berth.sock").exists()


# -- a real leader-only daemon -------------------------------------------------------------------


@pytest.fixture
def leader_only(tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    """``berth daemon start --leader-only`` (through the CLI, in the background) and one
    agent with the fake engine; yields the cluster and the start's output."""
    wrapper = fake_engine_wrapper(tmp_path)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF" + bytes(60))
    env = clean_env({"BERTH_LLAMA_SERVER_BIN": str(wrapper), "BERTH_STOP_GRACE_S": "5"})
    cluster = Cluster(tmp_path, env)
    cluster.leader_home.mkdir()
    try:
        started = cluster.berth("daemon", "start", "--leader-only", "--public-port",
                                str(cluster.public_port), "--cluster-port",
                                str(cluster.cluster_port))  # fmt: skip
        created = cluster.berth("key", "create", "tests")
        found = re.search(r"sk-berth-\S+", created.stdout)
        assert found, created.stdout
        cluster.api_key = found.group(0)
        yield cluster, started.stdout
    finally:
        cluster.close()


@pytest.mark.slow
def test_a_leader_only_daemon_runs_engines_on_agents_only(
    leader_only: tuple[Cluster, str], tmp_path: Path
) -> None:
    cluster, banner = leader_only
    assert "leader-only: no engines on this host" in banner
    assert "runtime process" not in banner
    info = cluster.admin("GET", "/admin/info")
    assert info["leader_only"] is True and info["runtimes"] == []
    assert "leader-only" in cluster.berth("daemon", "status").stdout

    # Nothing runs on the leader's host: a run without --node is refused, and says why.
    cluster.berth("models", "add", "tiny", str(tmp_path / "tiny.gguf"))
    refused = cluster.berth("run", "tiny", check=False)
    assert refused.returncode == EXIT_CONFIG
    assert refused.stderr.strip() == (
        "error: no connected node reports GPUs, and this leader runs no engines (leader_only "
        "is set): name a node with --node LABEL (`berth nodes ls` lists them)"
    )
    assert cluster.admin("GET", "/admin/deployments") == []

    # An agent enrolls, connects and serves; traffic goes through the leader to it.
    agent = cluster.add_agent("gpu-a")
    cluster.deploy("tiny-a", tmp_path / "tiny.gguf", agent)
    with cluster.http() as http:
        answer = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == ANSWER
        models = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert models == ["tiny-a"]
    # Only the agents are nodes: the leader's host is not one.
    assert [n["label"] for n in cluster.admin("GET", "/admin/nodes")] == ["gpu-a"]

    # Changing a setting while it runs says that the daemon keeps its settings until restarted.
    changed = cluster.berth("config", "set-public", "host=localhost")
    assert re.search(r"note: the running daemon \(pid \d+\) keeps its current settings",
                     changed.stdout), changed.stdout  # fmt: skip


@pytest.mark.slow
def test_leader_only_in_the_file_reaches_admin_info_over_the_socket(tmp_path: Path) -> None:
    """``[server] leader_only = true`` starts a leader-only daemon without the flag, and
    ``--no-leader-only`` overrides the file for one start."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text("[server]\nleader_only = true\n")
    ports = ["--public-port", "0", "--cluster-port", "0"]

    def info() -> dict[str, object]:
        transport = httpx.HTTPTransport(uds=str(home / "berth.sock"))
        with httpx.Client(transport=transport, base_url="http://berth") as api:
            found: dict[str, object] = api.get("/admin/info").json()
        return found

    try:
        assert berth(home, "daemon", "start", *ports).returncode == 0
        assert info()["leader_only"] is True
        assert berth(home, "daemon", "stop").returncode == 0
        started = berth(home, "daemon", "start", "--no-leader-only", *ports)
        assert started.returncode == 0, started.stderr
        assert info()["leader_only"] is False
    finally:
        berth(home, "daemon", "stop")


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """``berth daemon start`` must refuse before it spawns a daemon."""

    def spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("a daemon was spawned")

    monkeypatch.setattr("berth.cli.daemon_cmd.subprocess.Popen", spawn)


def _start_refused(home: Path, cert: str, key: str) -> str:
    started = invoke(home, "daemon", "start", "--public-cert", cert, "--public-key", key)
    return refused(started)


def test_daemon_start_with_a_missing_public_cert_or_key_names_the_setting_and_path(
    populated_home: Path, server_pairs: tuple[Path, Path, Path], no_spawn: None
) -> None:
    cert, key, _ = server_pairs

    no_cert = _start_refused(populated_home, "/nonexist", str(key))
    no_key = _start_refused(populated_home, str(cert), "/nonexist2")

    assert no_cert.startswith("public_cert /nonexist: No such file or directory")
    assert no_key.startswith("public_key /nonexist2: No such file or directory")


def test_daemon_start_with_a_broken_or_mismatched_pair_names_both_files(
    populated_home: Path, server_pairs: tuple[Path, Path, Path], tmp_path: Path, no_spawn: None
) -> None:
    cert, key, other_key = server_pairs
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")

    not_pem = _start_refused(populated_home, str(junk), str(key))
    mismatched = _start_refused(populated_home, str(cert), str(other_key))

    assert not_pem.startswith(f"public_cert {junk} and public_key {key} are not a PEM")
    assert mismatched.startswith(f"public_cert {cert} and public_key {other_key} are not a PEM")
