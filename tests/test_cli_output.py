"""What the CLI prints, in-process (typer's ``CliRunner``) against a canned daemon.

The daemon is an ``httpx.MockTransport`` answering admin calls with real admin API
models, so these tests see exactly what a user sees: names printed as written (rich markup
in a name is text, not style), tables readable at 80 columns, help text whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel
from typer.testing import CliRunner, Result

from berth.api import ApiKey, CreatedApiKey, UsageReport, UsageRow
from berth.api.client import DaemonClient
from berth.cli import common
from berth.cli.main import app
from berth.paths import BerthHome

CREATED = datetime(2026, 11, 2, tzinfo=UTC)
KEY_ID = "k-b3f1c2d4e5a6b7c8"
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

    created = berth("key", "create", name)
    listed = berth("key", "ls")
    revoked = berth("key", "revoke", KEY_ID)

    assert created.exit_code == 0, created.output
    assert SECRET in created.stdout
    assert f"({name})" in created.stdout
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
