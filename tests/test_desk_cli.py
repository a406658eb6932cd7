"""``berth desk`` as a user runs it: real CLI processes, a real leader daemon (its engine is
``tests/support/fake_llama_server.py``, which starts in a blink), the stand-in desk over real TLS.

The same flow on llama.cpp's real server is ``test_desk_e2e.py`` (slow).
"""

from __future__ import annotations

import json
import ssl
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from berth.runtime.engines import find_free_port
from support.berth_cli import Berth
from support.cluster_harness import clean_env, fake_engine_wrapper
from support.desk_harness import DeskServe, files_containing
from support.desk_standin import ThreadedDeskStandin
from support.fake_llama_server import ANSWER, USAGE

#: A name berth accepts but a desk does not (more than 80 characters).
LONG_NAME = "m" * 85
PLAIN_PROMPT = "plain desk prompt 4b7e: tell me a joke"
SEALED_PROMPT = "sealed desk prompt 81d2: a secret question"
EXIT_CONFIG = 2
EXIT_DAEMON = 3


@pytest.fixture(scope="module")
def desk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("desk-cli")


@pytest.fixture(scope="module")
def desk_leader(desk_dir: Path, tls_desk: tuple[ThreadedDeskStandin, Path]) -> Iterator[Berth]:
    """A leader serving ``smollm2`` and a model whose name no desk takes."""
    _, ca_file = tls_desk
    wrapper = fake_engine_wrapper(desk_dir)
    gguf = desk_dir / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    env = clean_env({"BERTH_LLAMA_SERVER_BIN": str(wrapper), "SSL_CERT_FILE": str(ca_file)})
    berth = Berth(desk_dir / "home", env=env, cwd=desk_dir)
    berth("daemon", "start", "--public-port", str(find_free_port()),
          "--cluster-port", str(find_free_port()))  # fmt: skip
    try:
        for name in ("smollm2", LONG_NAME):
            berth("models", "add", name, "--path", str(gguf))
            berth("run", name, "--engine", "llamacpp")
        yield berth
    finally:
        berth("daemon", "stop", check=False)


@pytest.fixture(scope="module")
def registered(desk_leader: Berth, tls_desk: tuple[ThreadedDeskStandin, Path]) -> str:
    standin, _ = tls_desk
    result = desk_leader("desk", "register", "--pool-url", standin.url, "--price", "150")
    return result.stdout + result.stderr


def test_register_prints_each_code_and_price_and_skips_a_bad_name(
    desk_leader: Berth, tls_desk: tuple[ThreadedDeskStandin, Path], registered: str
) -> None:
    standin, _ = tls_desk
    assert "smollm2: registered, node code N001, price 150 cents per million tokens (set by you)" \
        in registered  # fmt: skip
    assert f"warning: served model '{LONG_NAME}' is not a valid desk model id" in registered
    assert [r["model"] for r in standin.registrations] == ["smollm2"]
    nodes = desk_leader.home / "desk" / "nodes.json"
    keys = desk_leader.home / "desk" / "enckey.json"
    for path in (nodes, keys):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    book = json.loads(nodes.read_text())
    assert book["pool_url"] == standin.url
    assert book["nodes"][0]["secret"] == standin.node_for("smollm2").secret
    assert set(json.loads(keys.read_text())) == {"private_key", "public_key"}

    again = desk_leader("desk", "register")  # the registered pool is the default now
    assert "smollm2: already registered, node code N001" in again.stdout
    assert len(standin.registrations) == 1


def test_serve_answers_plain_and_sealed_jobs_through_the_leader(
    desk_leader: Berth, tls_desk: tuple[ThreadedDeskStandin, Path], registered: str, desk_dir: Path
) -> None:
    standin, _ = tls_desk
    plain = standin.add_job("smollm2", PLAIN_PROMPT)
    sealed = standin.add_job("smollm2", SEALED_PROMPT, sealed=True)
    tampered = standin.add_job("smollm2", SEALED_PROMPT, sealed=True, tamper="wrap_aad")
    serve = DeskServe(desk_leader, desk_dir / "serve.out", "--wait", "2")
    try:
        outcomes = [standin.wait_outcome(job, timeout_s=60) for job in (plain, sealed, tampered)]
        node = standin.node_for("smollm2")
        standin_pulses = list(node.pulses)

        status = desk_leader("desk", "status")
        status_json = json.loads(desk_leader("desk", "status", "--json").stdout)
        check = desk_leader("desk", "check")
        standin.wait_outcome(node.check["job"], timeout_s=60)  # type: ignore[index]
        link = desk_leader("desk", "link")
    finally:
        code = serve.stop()
    output = serve.text()
    assert code == 0, output

    prompt_tokens, completion_tokens = USAGE
    for outcome, job in zip(outcomes[:2], (plain, sealed), strict=True):
        assert outcome.kind == "finish"
        assert outcome.body == {"id": job, "output": ANSWER, "prompt_tokens": prompt_tokens,
                                "completion_tokens": completion_tokens}  # fmt: skip
    assert outcomes[2].kind == "fail"
    assert f"job {tampered} (smollm2): the sealed prompt does not open" in output

    first = standin_pulses[0]
    assert (first["slots"], first["busy"], first["models"]) == (1, False, ["smollm2"])
    assert first["enc_pubkey"] == json.loads((desk_leader.home / "desk" / "enckey.json")
                                             .read_text())["public_key"]  # fmt: skip
    assert {h.get("x-ow-wait") for h in node.claim_headers} == {"2"}  # one model offered

    assert status.stdout.startswith(("smollm2 (N001): READY", "smollm2 (N001): CHECKING"))
    assert "last seen  20" in status.stdout
    (row,) = status_json
    assert (row["model"], row["code"], row["error"]) == ("smollm2", "N001", None)
    assert row["state"] in ("ready", "checking") and row["lastSeen"].startswith("20")
    assert "smollm2: pool test requested; result:" in check.stdout
    assert json.loads(check.stdout.splitlines()[1])["status"] in ("pending", "passed")
    assert node.check["status"] == "passed"  # type: ignore[index]
    assert "code     LINK-M1 (one-time)" in link.stdout
    assert f"enter it at {standin.url}/account/machines" in link.stdout

    for secret in ("4b7e", "81d2"):
        assert secret not in output
        assert files_containing(desk_leader.home, secret) == []

    # The worker's requests are counted as the desk's, not as an anonymous socket's: the
    # two jobs and the speed test at least (pool tests too).
    desk_rows = requests_by_key(desk_leader)
    assert desk_rows.get("socket:desk", 0) >= 3, desk_rows
    assert "(socket)" not in desk_rows


def requests_by_key(berth: Berth) -> dict[str, int]:
    """``berth usage --by key``: requests per key name."""
    report = berth.json("usage", "--by", "key")
    return {row["key"]: row["requests"] for row in report["rows"]}


def test_a_socket_request_is_counted_by_what_sent_it_and_a_key_cannot_claim_the_desk(
    desk_leader: Berth,
) -> None:
    before = requests_by_key(desk_leader)
    secret = next(line for line in desk_leader("key", "create", "spoofer").stdout.splitlines()
                  if line.startswith("sk-berth-"))  # fmt: skip
    info = desk_leader.admin("GET", "/admin/info")
    public = next(listener["url"] for listener in info["listeners"] if listener["name"] == "public")
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    claims = {"x-berth-client": "desk", "authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=public, verify=ssl.create_default_context(cafile=info["ca_file"]),
                      timeout=30) as http:  # fmt: skip
        assert http.post("/v1/chat/completions", json=body, headers=claims).status_code == 200
    socket = httpx.HTTPTransport(uds=str(desk_leader.home / "berth.sock"))
    with httpx.Client(transport=socket, base_url="http://berth", timeout=30) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200  # as curl would

    after = requests_by_key(desk_leader)
    # On the public listener the header is nobody's word: the request is its key's.
    assert after["spoofer"] == 1
    assert after.get("socket:desk", 0) == before.get("socket:desk", 0)
    assert after["socket:cli"] == before.get("socket:cli", 0) + 1
    table = desk_leader("usage", "--by", "key").stdout
    assert "socket:cli" in table and "spoofer" in table


def test_bad_input_gets_one_clear_line(
    desk_leader: Berth, tls_desk: tuple[ThreadedDeskStandin, Path], registered: str, desk_dir: Path
) -> None:
    """What only the CLI checks (the rest is refused in-process: ``test_desk_worker.py``)."""
    standin, _ = tls_desk
    assert "--wait 20: the desk holds a claim 1 to 15 s" in desk_leader.fails(
        "desk", "serve", "--wait", "20", exit_code=EXIT_CONFIG
    )
    line = desk_leader.fails("desk", "status", "--pool-url", "https://other.example",
                        exit_code=EXIT_CONFIG)  # fmt: skip
    assert f"are registered with {standin.url}, not https://other.example (desk_pool_url, " \
        "from flag)" in line  # fmt: skip

    fresh = Berth(desk_dir / "fresh-home", env=desk_leader.env, cwd=desk_dir)
    assert "the berth leader does not answer on" in fresh.fails(
        "desk", "register", "--pool-url", standin.url, exit_code=EXIT_DAEMON
    )
    (fresh.home / "desk").mkdir(parents=True)
    (fresh.home / "desk" / "nodes.json").write_text("{not json")
    assert f"{fresh.home / 'desk' / 'nodes.json'}: malformed node file" in fresh.fails(
        "desk", "serve", exit_code=EXIT_CONFIG
    )


def test_a_desk_that_is_down_is_a_clear_message(desk_leader: Berth, desk_dir: Path) -> None:
    home = desk_dir / "dead-pool-home"
    (home / "desk").mkdir(parents=True)
    dead = f"https://127.0.0.1:{find_free_port()}"
    node = {"model": "smollm2", "secret": "sk-node-" + "a" * 32, "code": "N7"}
    (home / "desk" / "nodes.json").write_text(json.dumps({"pool_url": dead, "nodes": [node]}))
    berth = Berth(home, env=desk_leader.env, cwd=desk_dir)

    assert f"error: the desk at {dead} did not answer: node/link" in berth.fails(
        "desk", "link", exit_code=1
    )
    status = berth("desk", "status", check=False)
    assert status.returncode == 1
    assert status.stderr.startswith(f"smollm2 (N7): the desk at {dead} did not answer")
