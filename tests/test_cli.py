"""The real ``berth`` CLI against a real daemon, fed bad input.

Every command runs as a subprocess (``python -m berth --home HOME ...``), as a user would run
it.  One leader daemon serves the whole module; its llama.cpp engine is
``tests/support/fake_llama_server.py`` behind a shell wrapper named ``llama-server``
(``BERTH_LLAMA_SERVER_BIN``), and ``berth pull`` talks to the hub stand-in
(``HF_ENDPOINT``).  Bad input must fail with a clear ``error:`` line on stderr and a non-zero
exit, and must leave what was there untouched.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from berth.runtime.engines import find_free_port
from support.berth_cli import Berth, running_daemon
from support.cluster_harness import FAKE_ENGINE, clean_env, fake_engine_wrapper
from support.fake_llama_server import ANSWER, FAIL_LINE, LISTENING, USAGE
from support.hub_standin import TINY_FILES, HubStandin
from support.processes import alive, wait_gone

HUB_REPO = "org/tiny"  # published by the shared hub fixture (conftest.py)
HUB_FILES = TINY_FILES
#: Exit code of ``DaemonError`` (no daemon, or it could not start).
EXIT_DAEMON = 3
#: Exit code of ``ConfigError`` raised by the CLI itself.
EXIT_CONFIG = 2


def _https(home: Path, port: int) -> httpx.Client:
    """A client for the leader's public listener that trusts only the berth CA."""
    tls = ssl.create_default_context(cafile=str(home / "ca" / "ca.pem"))
    return httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=tls, timeout=10.0)


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the module's shared files: the engine wrapper, models, the hub cache."""
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def llama_server_bin(workdir: Path) -> Path:
    """An executable named ``llama-server`` that runs the fake engine with this interpreter."""
    return fake_engine_wrapper(workdir)


@pytest.fixture
def fresh(tmp_path: Path) -> Berth:
    """The CLI on a home that does not exist yet, with no daemon."""
    return Berth(tmp_path / "home", env=clean_env({}), cwd=tmp_path)


@pytest.fixture(scope="module")
def cli_leader(
    workdir: Path, llama_server_bin: Path, hub: HubStandin
) -> Iterator[tuple[Berth, int]]:
    """One daemon for the module, started and stopped through the CLI."""
    env = clean_env(
        {
            "BERTH_LLAMA_SERVER_BIN": str(llama_server_bin),
            "BERTH_HEALTH_TIMEOUT_S": "30",
            "BERTH_STOP_GRACE_S": "5",
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(workdir / "hf"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
    )
    daemon_cwd = workdir / "daemon-cwd"
    daemon_cwd.mkdir()
    berth = Berth(workdir / "home", env=env, cwd=daemon_cwd)
    with running_daemon(berth) as port:
        yield berth, port


# -- no daemon -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["ps"], ["models", "ls"]])
def test_without_a_daemon_commands_say_how_to_start_it(fresh: Berth, command: list[str]) -> None:
    line = fresh.fails(*command, exit_code=EXIT_DAEMON)

    assert "berth daemon is not running" in line
    assert str(fresh.home / "berth.sock") in line
    assert f"berth --home {fresh.home} daemon start" in line
    assert not fresh.home.exists(), "asking a missing daemon must not create the home"


# -- settings ------------------------------------------------------------------------------------


def test_malformed_config_names_file_and_line(fresh: Berth) -> None:
    fresh.home.mkdir()
    config = fresh.home / "config.toml"
    text = '[server]\npublic_port = 11600\npublic_host = "unterminated\n'
    config.write_text(text)

    for command in (["config", "show"], ["daemon", "start"]):
        line = fresh.fails(*command, exit_code=EXIT_CONFIG)
        assert f"{config}:3: invalid TOML" in line

    assert config.read_text() == text
    assert sorted(p.name for p in fresh.home.iterdir()) == ["config.toml"]


def test_unknown_config_key_is_refused_listing_valid_keys(fresh: Berth) -> None:
    fresh.home.mkdir()
    config = fresh.home / "config.toml"
    config.write_text("[server]\npublic_bind = '127.0.0.1'\npublic_prot = 1\n")

    line = fresh.fails("config", "show", exit_code=EXIT_CONFIG)

    assert f"{config}:3: unknown key 'public_prot' in [server]" in line
    assert "(did you mean 'public_port'?)" in line
    assert "valid keys in [server]: " in line and "public_port" in line
    assert "llama_server_bin" not in line  # another section's key


def test_a_bad_environment_value_is_refused_naming_the_variable(fresh: Berth) -> None:
    line = fresh.fails(
        "daemon", "start", exit_code=EXIT_CONFIG, env={"BERTH_PUBLIC_PORT": "notanumber"}
    )

    assert "BERTH_PUBLIC_PORT" in line and "'notanumber'" in line and "integer" in line
    assert not (fresh.home / "daemon.pid").exists()


def test_config_show_says_where_each_value_comes_from(fresh: Berth, llama_server_bin: Path) -> None:
    fresh.home.mkdir()
    config = fresh.home / "config.toml"
    config.write_text('[server]\npublic_port = 12345\n\n[daemon]\nlog_level = "error"\n')
    env = {
        "BERTH_LOG_LEVEL": "debug",  # env beats the file
        "PATH": f"{llama_server_bin.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }

    document = json.loads(fresh("config", "show", "--json", env=env).stdout)
    shown = document["settings"]
    table = fresh("config", "show", env=env).stdout

    assert shown["public_port"] == {"value": 12345, "source": "file"}
    assert shown["log_level"] == {"value": "debug", "source": "env"}
    assert shown["public_bind"] == {"value": "127.0.0.1", "source": "default"}
    assert shown["llama_server_bin"] == {"value": str(llama_server_bin), "source": "autodetect"}
    assert f"config file: {config}" in table
    assert (document["config_file"], document["public_url"]) == (
        str(config),
        "https://127.0.0.1:12345",
    )
    (row,) = [line for line in table.splitlines() if " public_port " in line]
    assert row.replace("│", " ").split() == ["public_port", "12345", "file"]


# -- daemon start --------------------------------------------------------------------------------


def test_starting_a_second_daemon_fails_and_keeps_the_first(cli_leader: tuple[Berth, int]) -> None:
    berth, port = cli_leader
    before = berth.admin("GET", "/admin/info")

    line = berth.fails(
        "daemon", "start", "--public-port", str(find_free_port()), exit_code=EXIT_DAEMON
    )

    assert line == f"error: a berth daemon is already running for {berth.home}"
    after = berth.admin("GET", "/admin/info")
    assert after["pid"] == before["pid"]
    assert {"name": "public", "url": f"https://127.0.0.1:{port}"} in [
        {"name": x["name"], "url": x["url"]} for x in after["listeners"]
    ]


def test_a_public_port_in_use_fails_the_start_and_leaves_no_daemon(fresh: Berth) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        result = fresh("daemon", "start", "--public-port", str(port), check=False)

    assert result.returncode == EXIT_DAEMON
    assert result.stderr.startswith(
        f"error: the daemon failed to start: public listener 127.0.0.1:{port}: "
        "address already in use"
    )
    assert not (fresh.home / "daemon.pid").exists()
    assert not (fresh.home / "berth.sock").exists()
    fresh.fails("daemon", "status", exit_code=EXIT_DAEMON)


def test_a_database_out_of_reach_fails_the_start_on_one_line(fresh: Berth) -> None:
    with socket.socket() as held:  # bound, not listening: a connection is refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        url = f"postgresql+psycopg://berth:secret@127.0.0.1:{port}/berth"

        result = fresh(
            "daemon", "start", "--public-port", "0", "--cluster-port", "0",
            env={"BERTH_DATABASE_URL": url}, check=False,
        )  # fmt: skip

    assert result.returncode == EXIT_DAEMON
    first = result.stderr.splitlines()[0]
    assert first.startswith(
        "error: the daemon failed to start: database error: connection failed: "
    ), result.stderr
    assert first.endswith("Connection refused Is the server running on that host and "
                          "accepting TCP/IP connections?"), result.stderr  # fmt: skip
    assert not (fresh.home / "daemon.pid").exists()


def test_daemon_stop_leaves_a_stranger_with_a_stale_pid_alone(fresh: Berth) -> None:
    fresh.home.mkdir()
    with subprocess.Popen(["sleep", "60"]) as stranger:
        try:
            # What a crashed daemon leaves behind once its pid has been reused.
            (fresh.home / "daemon.pid").write_text(f"{stranger.pid}\n")

            result = fresh("daemon", "stop")

            assert stranger.poll() is None, "berth daemon stop killed an unrelated process"
            assert result.stdout.strip() == "berth daemon is not running"
        finally:
            stranger.kill()


# -- models --------------------------------------------------------------------------------------


def test_models_add_refuses_a_missing_path_and_a_taken_name(
    cli_leader: tuple[Berth, int], gguf: Path, workdir: Path
) -> None:
    berth, _ = cli_leader
    missing = workdir / "no-such.gguf"

    assert berth.fails("models", "add", "m1", "--path", str(missing)) == (
        f"error: model path does not exist: {missing}"
    )
    berth("models", "add", "m1", "--path", str(gguf))
    other = workdir / "other.gguf"
    other.write_bytes(b"GGUF")
    assert berth.fails("models", "add", "m1", "--path", str(other)) == (
        "error: model 'm1' already exists"
    )
    assert berth.fails("models", "rm", "nope") == "error: model 'nope' not found"

    (m1,) = [m for m in berth.json("models", "ls") if m["name"] == "m1"]
    assert m1["path"] == str(gguf) and m1["source"] == "local"
    assert m1["size_bytes"] == gguf.stat().st_size


def test_models_add_takes_a_relative_path_from_where_the_user_is(
    cli_leader: tuple[Berth, int], tmp_path: Path
) -> None:
    berth, _ = cli_leader
    (tmp_path / "here.gguf").write_bytes(b"GGUF")

    berth("models", "add", "relative", "--path", "here.gguf", cwd=tmp_path)

    (record,) = [m for m in berth.json("models", "ls") if m["name"] == "relative"]
    assert record["path"] == str(tmp_path / "here.gguf")


# -- deployments ---------------------------------------------------------------------------------


def test_admin_api_errors_are_openai_shaped(cli_leader: tuple[Berth, int], tmp_path: Path) -> None:
    berth, _ = cli_leader
    with httpx.Client(
        transport=httpx.HTTPTransport(uds=str(berth.home / "berth.sock")), base_url="http://b"
    ) as admin:
        missing = admin.get("/admin/nope")
        assert missing.status_code == 404 and missing.json()["error"]["message"]
        bad_json = admin.post(
            "/admin/models", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert bad_json.status_code == 400
        assert bad_json.json()["error"]["message"] == "request body is not valid JSON"
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"not a model")
    assert "is not a GGUF file" in berth.fails("models", "add", "bin", "--path", str(not_gguf))
    line = berth.fails("models", "add", "q?x", "--path", str(not_gguf))
    assert "name" in line


def test_run_refuses_bad_input_and_creates_nothing(
    cli_leader: tuple[Berth, int], gguf: Path
) -> None:
    berth, _ = cli_leader
    berth.add_model("m2", gguf)
    before = berth.deployments()

    assert berth.fails("run", "nope") == "error: model 'nope' not found"
    assert berth.fails("run", "m2", "--engine", "tgi") == (
        "error: unknown engine 'tgi': expected one of llamacpp, vllm, sglang"
    )
    line = berth.fails("run", "m2", "--gpu", "x", exit_code=EXIT_CONFIG)
    assert line == "error: --gpu takes GPU indexes like 0 or 0,1, not 'x'"

    assert berth.deployments() == before


def test_run_serve_logs_and_stop_the_fake_engine(cli_leader: tuple[Berth, int], gguf: Path) -> None:
    berth, port = cli_leader
    berth.add_model("m3", gguf)

    started = berth("run", "m3", "--ctx", "512")
    (record,) = [r for r in berth.json("ps") if r["served_model_name"] == "m3"]
    deployment_id, pid = record["id"], record["pid"]
    assert f"{deployment_id} ready: model m3 on llamacpp" in started.stdout
    assert record["state"] == "ready" and record["node_id"] == "local"
    assert isinstance(record["port"], int) and alive(pid)
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        argv = cmdline.read().split(b"\0")
    assert str(FAKE_ENGINE).encode() in argv and b"512" in argv

    status = berth("status").stdout
    assert "running" in status and str(berth.home) in status
    assert "local" in status and deployment_id in status

    secret = berth.admin("POST", "/admin/keys", json={"name": "chat"})["secret"]
    with _https(berth.home, port) as http:
        body = {"model": "m3", "messages": [{"role": "user", "content": "hi"}]}
        answer = http.post("/v1/chat/completions", json=body, headers=_bearer(secret))
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == ANSWER
        usage_asked = {"stream": True, "stream_options": {"include_usage": True}}
        streamed = http.post(
            "/v1/chat/completions", json={**body, **usage_asked}, headers=_bearer(secret)
        )
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = [e[6:] for e in streamed.text.splitlines() if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
        assert "".join(deltas) == ANSWER
        assert chunks[-1]["usage"]["completion_tokens"] == USAGE[1]

    logs = berth("logs", deployment_id).stdout
    assert f"{LISTENING} http://127.0.0.1:{record['port']}" in logs
    assert "POST /v1/chat/completions" in logs

    with _https(berth.home, port) as http:
        _follow_sees_new_output_and_ends_at_stop(berth, deployment_id, http, secret)

    assert wait_gone(pid, 10.0), "berth stop must stop the engine process"
    line = berth.fails("stop", deployment_id)
    assert deployment_id in line and "stopped" in line
    (stopped,) = [r for r in berth.deployments() if r["id"] == deployment_id]
    assert stopped["state"] == "stopped"
    active = berth.admin("GET", "/admin/deployments", params={"active": True})
    assert deployment_id not in {r["id"] for r in active}


def _follow_sees_new_output_and_ends_at_stop(
    berth: Berth, deployment_id: str, http: httpx.Client, secret: str
) -> None:
    """`berth logs --follow` prints what the engine writes after it started following, and
    ends by itself once the deployment is stopped."""
    argv = [sys.executable, "-m", "berth", "--home", str(berth.home)]
    argv += ["logs", deployment_id, "--follow", "--tail", "1"]
    lines: queue.Queue[str] = queue.Queue()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=berth.env) as follower:
        reader = threading.Thread(
            target=lambda: [lines.put(line) for line in follower.stdout or ()], daemon=True
        )
        reader.start()
        try:
            lines.get(timeout=15)  # the last line already there: the follower is attached
            body = {"model": "m3", "messages": [{"role": "user", "content": "follow me"}]}
            answer = http.post("/v1/chat/completions", json=body, headers=_bearer(secret))
            assert answer.is_success
            deadline = time.monotonic() + 10
            while "POST /v1/chat/completions" not in lines.get(timeout=10):
                assert time.monotonic() < deadline, "the followed log never showed the request"
            assert berth("stop", deployment_id).stdout.strip() == f"{deployment_id} stopped"
            assert follower.wait(timeout=15) == 0
        finally:
            if follower.poll() is None:
                follower.terminate()
        reader.join(timeout=10)


def test_a_failing_engine_start_reports_its_log_tail(
    cli_leader: tuple[Berth, int], gguf: Path
) -> None:
    berth, _ = cli_leader
    berth.add_model("m4", gguf)

    result = berth("run", "m4", "-x", "--fail-start", check=False)

    assert result.returncode != 0
    first, *tail = result.stderr.splitlines()
    assert first.startswith("error: d-") and " failed: engine exited with code 1" in first
    assert "--- engine log tail ---" in tail and FAIL_LINE in tail
    (failed,) = [r for r in berth.deployments() if r["served_model_name"] == "m4"]
    assert failed["state"] == "failed" and FAIL_LINE in failed["failure_reason"]
    table = berth("ps", "--all").stdout
    rows = [line for line in table.splitlines() if failed["id"] in line]
    assert any("failed" in row for row in rows)
    assert any("engine exited with code 1" in row and FAIL_LINE in row for row in rows)


def test_an_engine_killed_by_sigill_fails_its_deployment_saying_why(
    cli_leader: tuple[Berth, int], gguf: Path
) -> None:
    berth, _ = cli_leader
    berth.add_model("m-sigill", gguf)

    result = berth("run", "m-sigill", "-x", "--x-die-by", "-x", "ILL", check=False)

    words = "engine was killed by SIGILL (built for instructions this CPU does not run)"
    assert result.returncode != 0
    assert words in result.stderr.splitlines()[0], result.stderr
    (failed,) = [r for r in berth.deployments() if r["served_model_name"] == "m-sigill"]
    assert failed["state"] == "failed" and words in failed["failure_reason"]
    assert "`berth doctor` gives the command that rebuilds it" in failed["failure_reason"]


# -- keys ----------------------------------------------------------------------------------------


def test_an_unknown_key_tier_is_refused_listing_the_tiers(cli_leader: tuple[Berth, int]) -> None:
    berth, _ = cli_leader
    before = berth.admin("GET", "/admin/keys")

    line = berth.fails("key", "create", "x", "--tier", "root", exit_code=EXIT_CONFIG)

    assert line == (
        "error: unknown tier 'root'; tiers: admin, standard, desk "
        "(define others as [tiers.NAME] in config.toml)"
    )
    assert berth.admin("GET", "/admin/keys") == before


@pytest.mark.parametrize(
    "name", ["two\nrows", "tab\there", "esc\x1b[31m", "bidi\u202eoverride", " padded", ""]
)
def test_unsafe_key_names_are_refused_by_the_cli_and_the_admin_api(
    cli_leader: tuple[Berth, int], name: str
) -> None:
    berth, _ = cli_leader
    before = berth.admin("GET", "/admin/keys")

    line = berth.fails("key", "create", name, exit_code=EXIT_CONFIG)
    transport = httpx.HTTPTransport(uds=str(berth.home / "berth.sock"))
    with httpx.Client(transport=transport, base_url="http://berth", timeout=30.0) as api:
        response = api.post("/admin/keys", json={"name": name})

    assert line.startswith("error: ") and "key name" in line
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "name" in error["message"]
    assert berth.admin("GET", "/admin/keys") == before


def test_keys_guard_the_public_listener_and_revoke_at_once(cli_leader: tuple[Berth, int]) -> None:
    berth, port = cli_leader
    standard = berth.json("key", "create", "std")
    admin = berth.admin("POST", "/admin/keys", json={"name": "adm", "tier": "admin"})
    assert standard["tier"] == "standard" and standard["secret"].startswith("sk-berth-")

    with _https(berth.home, port) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers=_bearer("sk-berth-wrong")).status_code == 401
        assert http.get("/v1/models", headers=_bearer(standard["secret"])).status_code == 200
        assert http.get("/admin/keys", headers=_bearer(standard["secret"])).status_code == 403
        keys = http.get("/admin/keys", headers=_bearer(admin["secret"]))
        assert keys.status_code == 200
        assert standard["id"] in {k["id"] for k in keys.json()}
        assert all("secret" not in k for k in keys.json())

        assert berth("key", "revoke", standard["id"]).stdout.strip() == (
            f"revoked {standard['id']} (std)"
        )
        revoked = http.get("/v1/models", headers=_bearer(standard["secret"]))
        assert revoked.status_code == 401
        assert revoked.json()["error"]["message"] == "invalid API key"

    assert berth.fails("key", "revoke", "k-nope") == "error: API key 'k-nope' not found"


# -- pull ----------------------------------------------------------------------------------------


def test_pull_downloads_and_registers_a_hub_model(cli_leader: tuple[Berth, int]) -> None:
    berth, _ = cli_leader

    result = berth("pull", HUB_REPO, "--name", "tiny")

    folder = berth.home / "models" / "org--tiny"
    assert f"pulled tiny into {folder}" in result.stdout
    for name, data in HUB_FILES.items():
        assert (folder / name).read_bytes() == data
    (record,) = [m for m in berth.json("models", "ls") if m["name"] == "tiny"]
    assert record["source"] == "hub" and record["repo_id"] == HUB_REPO
    assert record["path"] == str(folder)


def test_pull_registers_an_adapter_repository_for_the_model_it_was_trained_on(
    cli_leader: tuple[Berth, int], hub: HubStandin
) -> None:
    berth, _ = cli_leader
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
    hub.add_repo("org/tiny-hf", {"config.json": json.dumps(config).encode(), "w.bin": b"0"})
    lora = {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"],
            "base_model_name_or_path": "org/tiny-hf"}  # fmt: skip
    hub.add_repo(
        "org/tiny-lora",
        {"adapter_config.json": json.dumps(lora).encode(), "adapter_model.bin": b"0"},
    )
    berth("pull", "org/tiny-hf", "--name", "tiny-hf")

    result = berth("pull", "org/tiny-lora", "--name", "tiny-lora")

    folder = berth.home / "models" / "org--tiny-lora"
    assert f"pulled adapter tiny-lora into {folder}" in result.stdout
    assert "added adapter tiny-lora of tiny-hf (peft, rank 4)" in result.stdout
    shown = berth.json("adapters", "show", "tiny-lora")
    assert shown["repo_id"] == "org/tiny-lora" and shown["source"] == "hub"
    assert shown["locations"] == {"local": str(folder)}
    berth("adapters", "rm", "tiny-lora")


def test_pulling_a_missing_repository_fails_cleanly(cli_leader: tuple[Berth, int]) -> None:
    berth, _ = cli_leader
    before = berth.admin("GET", "/admin/models")

    result = berth("pull", "org/missing", check=False)

    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == "error: hub repository 'org/missing' not found"
    assert berth.admin("GET", "/admin/models") == before
    assert not (berth.home / "models" / "org--missing").exists()


# -- status --------------------------------------------------------------------------------------


def test_daemon_status_json_has_pid_and_listeners(cli_leader: tuple[Berth, int]) -> None:
    berth, port = cli_leader

    info = berth.json("daemon", "status")

    assert info["pid"] == int((berth.home / "daemon.pid").read_text())
    assert alive(info["pid"]) and info["ready"] is True
    assert info["cluster_url"].startswith("https://127.0.0.1:")
    assert [{"name": x["name"], "url": x["url"]} for x in info["listeners"]] == [
        {"name": "public", "url": f"https://127.0.0.1:{port}"},
        {"name": "cluster", "url": info["cluster_url"]},
        {"name": "socket", "url": f"unix://{berth.home / 'berth.sock'}"},
    ]
    # The certificate each TLS listener serves now: the CA-issued public.pem here.
    public = x509.load_pem_x509_certificate((berth.home / "ca" / "public.pem").read_bytes())
    assert info["listeners"][0]["certificate_serial"] == f"{public.serial_number:X}"
    assert info["listeners"][0]["certificate_not_after"] == public.not_valid_after_utc.isoformat()
    assert info["listeners"][2]["certificate_serial"] is None  # the socket: no TLS
    assert info["ca_file"] == str(berth.home / "ca" / "ca.pem")
    # The daemon resolved its settings from the flag and environment `daemon start` got.
    settings = berth.admin("GET", "/admin/config")
    assert settings["public_port"] == {"value": port, "source": "flag"}
    assert settings["llama_server_bin"]["source"] == "env"
    assert settings["log_level"] == {"value": "info", "source": "default"}


# -- nodes ---------------------------------------------------------------------------------------


def test_nodes_enroll_register_list_and_remove(
    cli_leader: tuple[Berth, int], tmp_path: Path
) -> None:
    from berth.cluster.pki.enrollment import EnrollmentURI

    berth, _ = cli_leader
    info = berth.admin("GET", "/admin/info")

    enrolled = berth("nodes", "enroll", "cli-node").stdout
    (uri_line,) = [line for line in enrolled.splitlines() if line.startswith("berth://")]
    uri = EnrollmentURI.parse(uri_line)
    assert (uri.leader_url, uri.ca_fingerprint) == (info["cluster_url"], info["ca_fingerprint"])
    assert f"berth agent register --uri '{uri_line}'" in enrolled
    assert "expires at " in enrolled

    agent = Berth(tmp_path / "agent-home", env=berth.env, cwd=tmp_path)
    registered = agent("agent", "register", "--uri", uri_line).stdout
    assert "enrolled as node cli-node" in registered
    assert (tmp_path / "agent-home" / "agent.key").stat().st_mode & 0o077 == 0
    again = agent.fails("agent", "register", "--uri", uri_line)
    assert "already enrolled" in again and "--force" in again
    reused = agent.fails("agent", "register", "--uri", uri_line, "--force")
    assert "enrollment token already used" in reused
    with socket.create_server(("127.0.0.1", 0)) as taken:  # the port to advertise is in use
        port = taken.getsockname()[1]
        busy = agent.fails("agent", "start", "--advertise", f"127.0.0.1:{port}")
    assert (
        busy == f"error: the direct ingress cannot listen on 0.0.0.0:{port}: address already in use"
    )

    listed = {n["label"]: n for n in berth.json("nodes", "ls")}
    assert listed["local"]["status"] == "ready"
    assert listed["cli-node"]["status"] == "unreachable"
    # A day's certificate (agent_cert_lifetime_s), renewed over the link at two thirds.
    left_s = listed["cli-node"]["cert_not_after"] - time.time()
    assert 23 * 3600 < left_s <= 24 * 3600
    table = berth("nodes", "ls").stdout
    assert "local" in table and "cli-node" in table and "23h left" in table
    shown = berth.json("nodes", "show", "cli-node")
    assert shown["cert_fingerprint"].startswith("sha256:")

    # The path lives on the agent's host, so the leader records it without checking it.
    berth("models", "add", "remote-model", "/srv/models/remote.gguf", "--node", "cli-node")
    (model,) = [m for m in berth.json("models", "ls") if m["name"] == "remote-model"]
    assert model["locations"] == {shown["id"]: "/srv/models/remote.gguf"}

    assert berth("nodes", "remove", "cli-node").stdout.startswith("removed node cli-node (n-")
    assert "cli-node" not in {n["label"] for n in berth.json("nodes", "ls")}


def test_nodes_refuse_local_unknown_and_bad_labels(cli_leader: tuple[Berth, int]) -> None:
    berth, _ = cli_leader

    line = berth.fails("nodes", "remove", "local", exit_code=2)
    assert "cannot be removed" in line
    assert berth.fails("nodes", "remove", "no-such-node", exit_code=2) == (
        "error: node 'no-such-node' not found"
    )
    assert "invalid node label" in berth.fails("nodes", "enroll", "Bad_Label", exit_code=2)
    assert "'local'" in berth.fails("nodes", "enroll", "local", exit_code=2)


@pytest.mark.parametrize("address", ["10.0.0.7", "10.0.0.7:99999", "2001:db8::7:11502"])
def test_agent_start_refuses_a_malformed_advertise_address(fresh: Berth, address: str) -> None:
    result = fresh("agent", "start", "--advertise", address, check=False)

    assert result.returncode == 2
    assert "Invalid value for '--advertise'" in result.stderr
    assert not fresh.home.exists()


def test_agent_register_refuses_a_malformed_uri(fresh: Berth) -> None:
    line = fresh.fails("agent", "register", "--uri", "https://nope", exit_code=2)

    assert "not an enrollment URI" in line
    assert not fresh.home.exists()
