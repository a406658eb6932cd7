"""Settings resolution: precedence, sources, validation and config.toml errors."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from berth.config import SETTINGS, Settings, write_config_values
from berth.errors import ConfigError
from berth.paths import BerthHome


def write_config(home: BerthHome, text: str) -> Path:
    home.config_file.write_text(text, encoding="utf-8")
    return home.config_file


def fake_executable(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    program = folder / name
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    return program


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("public_host", "127.0.0.1"),
        ("public_bind", "127.0.0.1"),
        ("public_port", 11500),
        ("public_cert", None),
        ("public_key", None),
        ("max_body_bytes", 16 * 1024 * 1024),
        ("log_level", "info"),
        ("health_timeout_s", 600.0),
        ("stop_grace_s", 10.0),
        ("default_runtime", "process"),
        ("vllm_bin", None),
        ("cluster_host", "127.0.0.1"),
        ("cluster_bind", "127.0.0.1"),
        ("cluster_port", 11501),
    ],
)
def test_defaults_without_any_source(home: BerthHome, name: str, expected: object) -> None:
    settings = Settings.load(home, env={"PATH": ""})

    assert getattr(settings, name) == expected
    assert settings.source(name) == "default"


def test_database_defaults_to_sqlite_under_home(home: BerthHome) -> None:
    settings = Settings.load(home, env={})

    assert settings.database_url == f"sqlite:///{home.db_file}"


@pytest.mark.parametrize("winner", ["flag", "env", "file", "autodetect", "default"])
def test_precedence_flag_env_file_autodetect_default(
    home: BerthHome, tmp_path: Path, winner: str
) -> None:
    # Every source at or below the winner supplies a value; the winner's must be chosen.
    levels = ["flag", "env", "file", "autodetect", "default"]
    present = levels[levels.index(winner) :]
    flags: dict[str, object] = {"vllm_bin": "/from/flag/vllm"} if "flag" in present else {}
    env = {"BERTH_VLLM_BIN": "/from/env/vllm"} if "env" in present else {}
    if "file" in present:
        write_config(home, '[engines]\nvllm_bin = "/from/file/vllm"\n')
    detected = fake_executable(tmp_path / "bin", "vllm")
    env["PATH"] = str(detected.parent) if "autodetect" in present else ""

    settings = Settings.load(home, flags=flags, env=env)

    expected = {
        "flag": Path("/from/flag/vllm"),
        "env": Path("/from/env/vllm"),
        "file": Path("/from/file/vllm"),
        "autodetect": detected,
        "default": None,
    }[winner]
    assert settings.vllm_bin == expected
    assert settings.source("vllm_bin") == winner


def test_llama_server_on_path_is_autodetected(home: BerthHome, tmp_path: Path) -> None:
    program = fake_executable(tmp_path / "bin", "llama-server")

    settings = Settings.load(home, env={"PATH": str(program.parent)})

    assert settings.llama_server_bin == program
    assert settings.source("llama_server_bin") == "autodetect"


@pytest.mark.parametrize(
    ("flags", "env", "file_port", "expected", "source"),
    [
        ({"public_port": 1000}, {"BERTH_PUBLIC_PORT": "2000"}, 3000, 1000, "flag"),
        ({"public_port": "1001"}, {}, 3000, 1001, "flag"),
        ({"public_port": None}, {"BERTH_PUBLIC_PORT": "2000"}, 3000, 2000, "env"),
        ({}, {"BERTH_PUBLIC_PORT": " 2001 "}, None, 2001, "env"),
        ({}, {}, 3000, 3000, "file"),
        ({}, {}, None, 11500, "default"),
    ],
)
def test_integer_setting_precedence_and_conversion(
    home: BerthHome,
    flags: dict[str, object],
    env: dict[str, str],
    file_port: int | None,
    expected: int,
    source: str,
) -> None:
    if file_port is not None:
        write_config(home, f"[server]\npublic_port = {file_port}\n")

    settings = Settings.load(home, flags=flags, env=env)

    assert settings.public_port == expected
    assert settings.source("public_port") == source


def test_environment_defaults_to_process_environment(
    home: BerthHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BERTH_LOG_LEVEL", "debug")

    settings = Settings.load(home)

    assert (settings.log_level, settings.source("log_level")) == ("debug", "env")


@pytest.mark.parametrize(
    ("variable", "value", "reason"),
    [
        ("BERTH_PUBLIC_PORT", "eleven", "expected an integer"),
        ("BERTH_PUBLIC_PORT", "70000", "at most 65535"),
        ("BERTH_MAX_BODY_BYTES", "0", "at least 1"),
        ("BERTH_HEALTH_TIMEOUT_S", "-1", "at least 0"),
        ("BERTH_STOP_GRACE_S", "nan", "finite"),
        ("BERTH_LOG_LEVEL", "loud", "debug, info, warning, error, critical"),
        ("BERTH_DEFAULT_RUNTIME", "kubernetes", "expected one of"),
        ("BERTH_PUBLIC_HOST", "  ", "a value is required"),
    ],
)
def test_bad_environment_value_names_the_variable(
    home: BerthHome, variable: str, value: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.load(home, env={variable: value})

    assert variable in str(caught.value)
    assert reason in str(caught.value)


def test_bad_flag_value_names_the_flag(home: BerthHome) -> None:
    with pytest.raises(ConfigError, match="--cluster-port"):
        Settings.load(home, flags={"cluster_port": "x"}, env={})


def test_unknown_flag_is_refused(home: BerthHome) -> None:
    with pytest.raises(ConfigError, match="unknown setting 'public_prot'"):
        Settings.load(home, flags={"public_prot": 1}, env={})


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("[server]\npublic_port = \n", 2),
        ('[server]\npublic_host = "a"\npublic_host = "b"\n', 3),
        ("[server\npublic_port = 1\n", 1),
        ('\n\n[daemon]\nlog_level = "info\n', 4),
        ("[server]\n[server]\n", 2),
    ],
)
def test_malformed_toml_reports_file_and_line(home: BerthHome, text: str, line: int) -> None:
    path = write_config(home, text)

    with pytest.raises(ConfigError) as caught:
        Settings.load(home, env={})

    assert caught.value.path == path
    assert caught.value.line == line
    assert str(caught.value).startswith(f"{path}:{line}: invalid TOML")


@pytest.mark.parametrize(
    ("text", "line", "what", "listed"),
    [
        (
            "[server]\npublic_port = 1\n\n[sever]\nx = 1\n",
            4,
            "unknown section 'sever' (did you mean 'server'?); sections: [store], [server], ",
            "[tiers.NAME]",
        ),
        (
            "[server]\npublic_prot = 1\n",
            2,
            "unknown key 'public_prot' in [server] (did you mean 'public_port'?); "
            "valid keys in [server]: ",
            "public_bind",
        ),
        (
            '[server]\nlog_level = "info"\n',
            2,
            "unknown key 'log_level' in [server]; it is a setting of [daemon]",
            "move it under that header",
        ),
        (
            "public_port = 1\n",
            1,
            "unknown top-level key 'public_port'; it is a setting of [server]",
            "move it under that header",
        ),
    ],
)
def test_unknown_section_or_key_is_refused_naming_the_closest_and_the_sections_keys(
    home: BerthHome, text: str, line: int, what: str, listed: str
) -> None:
    path = write_config(home, text)

    with pytest.raises(ConfigError) as caught:
        Settings.load(home, env={})

    assert (caught.value.path, caught.value.line) == (path, line)
    assert what in str(caught.value)
    assert listed in str(caught.value)
    assert "llama_server_bin" not in str(caught.value)  # no other section's keys


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('[server]\npublic_port = "http"\n', 2),
        ("[daemon]\nlog_level = 3\n", 2),
        ("[daemon]\n# comment\n\nstop_grace_s = true\n", 4),
        ("[cluster]\ncluster_port = 1.5\n", 2),
    ],
)
def test_bad_file_value_names_file_and_line(home: BerthHome, text: str, line: int) -> None:
    path = write_config(home, text)

    with pytest.raises(ConfigError) as caught:
        Settings.load(home, env={})

    assert (caught.value.path, caught.value.line) == (path, line)


def test_relative_path_in_file_is_relative_to_the_config_folder(home: BerthHome) -> None:
    write_config(home, '[server]\npublic_cert = "tls/cert.pem"\npublic_key = "tls/key.pem"\n')

    settings = Settings.load(home, env={})

    assert settings.public_cert == home.root / "tls" / "cert.pem"
    assert settings.public_key == home.root / "tls" / "key.pem"


def test_certificate_without_key_is_refused(home: BerthHome) -> None:
    with pytest.raises(ConfigError, match="public_cert"):
        Settings.load(home, env={"BERTH_PUBLIC_CERT": "/etc/cert.pem"})


def test_rows_and_json_cover_every_setting_with_its_source(home: BerthHome) -> None:
    settings = Settings.load(
        home,
        flags={"public_port": 8443},
        env={"BERTH_DATABASE_URL": "postgresql://berth:hunter2@db/berth", "PATH": ""},
    )

    rows = {row.name: row for row in settings.rows()}
    document = json.loads(json.dumps(settings.as_json()))

    assert [row.name for row in settings.rows()] == [d.name for d in SETTINGS]
    assert (rows["public_port"].value, rows["public_port"].source) == ("8443", "flag")
    assert rows["public_port"].env_var == "BERTH_PUBLIC_PORT"
    assert rows["public_port"].toml_location == "[server] public_port"
    assert rows["public_cert"].value == ""
    assert document["public_port"] == {"value": 8443, "source": "flag"}
    assert document["database_url"]["value"] == "postgresql://berth:***@db/berth"
    assert "hunter2" not in rows["database_url"].value
    assert settings.database_url == "postgresql://berth:hunter2@db/berth"


def test_write_config_values_round_trips(home: BerthHome) -> None:
    write_config(home, '[daemon]\nlog_level = "debug"\n')
    tricky = 'C:\\models\\"quoted"\tname é'

    write_config_values(
        home.config_file,
        {
            "public_port": 8443,
            "stop_grace_s": 2.5,
            "llamacpp_image": tricky,
            "vllm_bin": Path("/opt/vllm"),
        },
    )
    settings = Settings.load(home, env={})

    assert settings.public_port == 8443
    assert settings.stop_grace_s == 2.5
    assert settings.llamacpp_image == tricky.strip()
    assert settings.vllm_bin == Path("/opt/vllm")
    assert settings.log_level == "debug"
    assert stat.S_IMODE(home.config_file.stat().st_mode) == 0o600


def test_write_config_values_none_removes_the_key(home: BerthHome) -> None:
    write_config_values(home.config_file, {"public_port": 8443, "log_level": "error"})

    write_config_values(home.config_file, {"public_port": None})
    settings = Settings.load(home, env={})

    assert settings.source("public_port") == "default"
    assert settings.log_level == "error"


@pytest.mark.parametrize(
    ("updates", "message"),
    [
        ({"public_prot": 1}, "unknown setting"),
        ({"public_port": "http"}, "expected an integer"),
        ({"log_level": "loud"}, "expected one of"),
        ({"public_port": 70000}, "at most 65535"),
    ],
)
def test_write_config_values_refuses_bad_input_and_leaves_the_file(
    home: BerthHome, updates: dict[str, object], message: str
) -> None:
    path = write_config(home, "[server]\npublic_port = 1234\n")

    with pytest.raises(ConfigError, match=message):
        write_config_values(path, updates)

    assert path.read_text() == "[server]\npublic_port = 1234\n"


def _detected() -> str:
    return "10.1.2.3"


@pytest.mark.parametrize(
    ("env", "public_host", "cluster_host", "public_source"),
    [
        ({}, "127.0.0.1", "127.0.0.1", "default"),
        ({"BERTH_PUBLIC_BIND": "0.0.0.0"}, "10.1.2.3", "127.0.0.1", "autodetect"),
        ({"BERTH_CLUSTER_BIND": "::"}, "127.0.0.1", "10.1.2.3", "default"),
        (
            {"BERTH_PUBLIC_BIND": "0.0.0.0", "BERTH_PUBLIC_HOST": "api.example"},
            "api.example",
            "127.0.0.1",
            "env",
        ),
    ],
)
def test_hosts_are_autodetected_only_for_a_wildcard_bind_nobody_named(
    home: BerthHome, env: dict[str, str], public_host: str, cluster_host: str, public_source: str
) -> None:
    settings = Settings.load(home, env=env, detect_address=_detected)

    assert (settings.public_host, settings.cluster_host) == (public_host, cluster_host)
    assert settings.source("public_host") == public_source


def test_leader_url_overrides_only_the_advertised_cluster_url(home: BerthHome) -> None:
    plain = Settings.load(home, env={"BERTH_CLUSTER_HOST": "::1"})
    overridden = Settings.load(home, env={"BERTH_LEADER_URL": "https://lb.example:443/"})

    assert plain.cluster_url(4242) == "https://[::1]:4242"
    assert overridden.cluster_url(4242) == "https://lb.example:443"
    assert overridden.cluster_port == plain.cluster_port
    with pytest.raises(ConfigError, match="must be an https:// URL"):
        Settings.load(home, env={"BERTH_LEADER_URL": "http://lb.example"})


def test_a_node_timeout_shorter_than_two_heartbeats_is_refused(tmp_path: Path) -> None:
    home = BerthHome(tmp_path)
    env = {"BERTH_HEARTBEAT_INTERVAL_S": "10", "BERTH_NODE_TIMEOUT_S": "15"}
    with pytest.raises(ConfigError, match=r"node_timeout_s .* at least twice"):
        Settings.load(home, env=env)


def test_docker_settings_choose_the_runtime_and_each_engines_image(home: BerthHome) -> None:
    home.config_file.parent.mkdir(parents=True, exist_ok=True)
    home.config_file.write_text(
        '[daemon]\ndefault_runtime = "docker"\n\n[docker]\nvllm_image = "vllm/vllm-openai:v0.9.2"\n'
    )
    settings = Settings.load(home, env={"BERTH_DOCKER_SHM_SIZE": "32g"})
    assert settings.default_runtime == "docker"
    assert settings.docker_images() == {
        "llamacpp": "ghcr.io/ggml-org/llama.cpp:server",
        "vllm": "vllm/vllm-openai:v0.9.2",
        "sglang": "lmsysorg/sglang:latest",
    }
    assert (settings.docker_shm_size, settings.docker_host) == ("32g", None)
    with pytest.raises(ConfigError, match="default_runtime"):
        Settings.load(home, env={"BERTH_DEFAULT_RUNTIME": "podman"})
