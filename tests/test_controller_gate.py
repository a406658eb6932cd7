"""Issue 41's messages, in process: which admin requests only the controller serves, the
refusal a standby member answers them with, and the CLI's lines on the controller (from a
``LeaderStatus``, or from the database's lease row when the local leader is stopped)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from berth.api import LeaderStatus
from berth.cli.leadership_lines import controller_from_database, role_line
from berth.config import Settings
from berth.daemon.controller_gate import controller_only
from berth.openai_errors import error_from_exception
from berth.paths import BerthHome
from berth.store import Store
from berth.store.errors import NotControllerError


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/admin/deployments"),
        ("POST", "/admin/deployments/d-1/stop"),
        ("DELETE", "/admin/nodes/gpu-a"),
        ("POST", "/admin/nodes/gpu-a/cordon"),
        ("PATCH", "/admin/services/chat"),
        ("POST", "/admin/routes"),
        ("POST", "/admin/ca/rotate"),
        ("POST", "/admin/plan"),
        ("POST", "/admin/models"),
    ],
)
def test_control_commands_are_the_controllers(method: str, path: str) -> None:
    assert controller_only(method, path)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/deployments"),
        ("GET", "/admin/nodes/gpu-a"),
        ("POST", "/admin/keys"),
        ("DELETE", "/admin/keys/app"),
        ("POST", "/admin/leader/step-down"),
        ("POST", "/admin/shutdown"),
        ("POST", "/admin/deploymentsx"),
    ],
)
def test_reads_and_a_leaders_own_affairs_are_every_leaders(method: str, path: str) -> None:
    assert not controller_only(method, path)


def test_the_refusal_is_openai_shaped_and_names_the_controller() -> None:
    status, body, _ = error_from_exception(NotControllerError("https://a.lan:11500", 3))
    assert status == 409
    assert b'"code":"not_controller"' in body.replace(b" ", b"")
    assert b"the controller at https://a.lan:11500 (epoch 3)" in body
    assert "retry" in str(NotControllerError(None, 4))


def _status(
    role: Literal["active", "standby"], *, ha: bool = True, active: str | None = "https://a.lan"
) -> LeaderStatus:
    return LeaderStatus(role=role, id="x", epoch=3, active_address=active, ha=ha)


def test_role_lines() -> None:
    assert role_line(_status("active")) == "controller (holds the lease, epoch 3)"
    assert role_line(_status("standby")).endswith("the controller is https://a.lan (epoch 3)")
    assert "no leader holds the lease" in role_line(_status("standby", active=None))
    assert "leader_ha is off" in role_line(_status("active", ha=False))


def test_the_database_names_the_controller_of_a_stopped_leader(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    home = BerthHome(tmp_path / "home")
    settings = Settings.load(home, flags={"leader_ha": True, "database_url": url}, env={})
    lone = Settings.load(home, flags={"database_url": url}, env={})
    with Store(url) as store:
        store.migrate()
        assert controller_from_database(settings) == (
            f"no controller: no leader ever took the lease in {url}"
        )
        held = store.acquire_lease("a", "https://a.lan:11500", 30.0)
        line = controller_from_database(settings)
        assert line is not None
        assert line.startswith(f"controller https://a.lan:11500 (epoch {held.epoch}, lease renewed")
        assert line.endswith(f"per {url}")
        assert controller_from_database(lone) is None  # a lone leader: nothing more to say
        lapsed = controller_from_database(settings, now_s=held.expires_at + 10.0)
        assert lapsed is not None and lapsed.startswith("no controller now")
