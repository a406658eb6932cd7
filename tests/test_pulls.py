"""The leader's pull jobs through the admin API, in-process: ``/admin/pulls`` against the
hub stand-in on loopback, registering into a real store (jobs, progress, a hub's refusal in
plain words, cancelling, a name taken). The console's pull form against a real leader:
``test_console_browser.py``."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from berth.admin.adapters import build_adapter_router
from berth.admin.app import build_admin_app
from berth.admin.models import build_model_router
from berth.admin.pulls import build_pull_router, leader_pull_jobs
from berth.api.client import DaemonClient
from berth.api.pulls import Pull, PullFile, PullIn
from berth.cluster.leader.link_registry import LinkRegistry
from berth.config import Settings
from berth.deployments.adapters import AdapterManager
from berth.paths import BerthHome
from berth.store import Store
from support.hub_standin import TINY_FILES, HubStandin

SLOW_REPO = "org/pull-slow"
LORA_REPO = "org/pull-lora"
TOTAL_BYTES = sum(len(data) for data in TINY_FILES.values())


class _Lifecycle:
    """What registering a model tells the lifecycle manager."""

    def __init__(self) -> None:
        self.refreshed = 0

    async def refresh_known_models(self) -> None:
        self.refreshed += 1


@pytest.fixture
async def pull_admin(
    store: Store, home: BerthHome, tmp_path: Path, hub: HubStandin, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[httpx.AsyncClient]:
    """The admin app over a real store, pulling from the hub stand-in into
    ``tmp_path/home/models``."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    adapters, lifecycle = AdapterManager(LinkRegistry([])), _Lifecycle()
    jobs = leader_pull_jobs(store, lifecycle, adapters, home.models_dir)  # type: ignore[arg-type]
    routers = [
        build_model_router(store, lifecycle, LinkRegistry([])),  # type: ignore[arg-type]
        build_adapter_router(store, adapters),
        build_pull_router(jobs),
    ]
    app = build_admin_app(routers, tiers=Settings.load(home).tiers)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://leader") as client:
        yield client


async def _settled(pull_admin: httpx.AsyncClient, pull_id: str) -> dict[str, Any]:
    for _ in range(600):
        job: dict[str, Any] = (await pull_admin.get(f"/admin/pulls/{pull_id}")).json()
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"pull {pull_id} did not finish: {job}")


async def _until(pull_admin: httpx.AsyncClient, pull_id: str, check: Any) -> dict[str, Any]:
    for _ in range(600):
        job: dict[str, Any] = (await pull_admin.get(f"/admin/pulls/{pull_id}")).json()
        if check(job):
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"pull {pull_id} never got there: {job}")


async def test_a_pull_downloads_reports_its_bytes_and_registers_the_model(
    pull_admin: httpx.AsyncClient, tmp_path: Path
) -> None:
    started = await pull_admin.post("/admin/pulls", json={"repo": "org/tiny", "name": "tiny"})

    assert started.status_code == 202
    job = started.json()
    assert job["state"] in ("queued", "downloading")
    assert job["name"] == "tiny" and job["repo"] == "org/tiny"
    done = await _settled(pull_admin, job["id"])
    assert done["state"] == "done", done["error"]
    assert done["error"] is None
    assert done["kind"] == "model"
    assert done["done_bytes"] == done["total_bytes"] == TOTAL_BYTES
    assert {f["path"]: f["done_bytes"] for f in done["files"]} == {
        name: len(data) for name, data in TINY_FILES.items()
    }
    folder = tmp_path / "home" / "models" / "org--tiny"
    assert done["path"] == str(folder.resolve())
    assert (folder / "tiny.gguf").read_bytes() == TINY_FILES["tiny.gguf"]
    models = (await pull_admin.get("/admin/models")).json()
    (model,) = [m for m in models if m["name"] == "tiny"]
    assert model["source"] == "hub" and model["repo_id"] == "org/tiny"
    assert model["size_bytes"] >= TOTAL_BYTES
    listed = (await pull_admin.get("/admin/pulls")).json()
    assert [j["id"] for j in listed] == [job["id"]]

    # The name is taken now: refused at once, no job.
    again = await pull_admin.post("/admin/pulls", json={"repo": "org/tiny-remote", "name": "tiny"})
    assert again.status_code == 409
    assert again.json()["error"]["message"] == "a model or adapter named 'tiny' already exists"
    assert len((await pull_admin.get("/admin/pulls")).json()) == 1


async def test_an_unknown_repository_fails_with_the_reason(pull_admin: httpx.AsyncClient) -> None:
    started = await pull_admin.post("/admin/pulls", json={"repo": "org/missing"})

    assert started.status_code == 202
    failed = await _settled(pull_admin, started.json()["id"])
    assert failed["state"] == "failed"
    assert failed["error"] == "hub repository 'org/missing' not found"
    assert failed["total_bytes"] is None
    assert (await pull_admin.get("/admin/models")).json() == []
    # A finished job is forgotten when deleted.
    forgotten = await pull_admin.delete(f"/admin/pulls/{failed['id']}")
    assert forgotten.status_code == 200
    assert forgotten.json()["state"] == "failed"
    assert (await pull_admin.get(f"/admin/pulls/{failed['id']}")).status_code == 404


async def test_progress_shows_mid_pull_and_cancelling_stops_it(
    pull_admin: httpx.AsyncClient, hub: HubStandin, tmp_path: Path
) -> None:
    hub.add_repo(SLOW_REPO, TINY_FILES)
    gate = hub.stall(SLOW_REPO, "tiny.gguf")  # config.json comes whole, tiny.gguf half
    try:
        job = (await pull_admin.post("/admin/pulls", json={"repo": SLOW_REPO})).json()
        busy = await _until(
            pull_admin, job["id"], lambda j: j["done_bytes"] >= len(TINY_FILES["config.json"])
        )
        assert busy["state"] == "downloading"
        assert busy["total_bytes"] == TOTAL_BYTES > busy["done_bytes"]
        # A second pull of the same name while this one runs: refused at once.
        twice = await pull_admin.post("/admin/pulls", json={"repo": "org/tiny", "name": SLOW_REPO})
        assert twice.status_code == 409

        cancelling = asyncio.create_task(pull_admin.delete(f"/admin/pulls/{job['id']}"))
        await asyncio.sleep(0.2)
        gate.set()  # the stalled file's rest arrives: the download stops at that chunk
        cancelled = (await cancelling).json()
    finally:
        gate.set()
    assert cancelled["state"] == "cancelled"
    assert not (tmp_path / "home" / "models" / "org--pull-slow").exists()
    assert (await pull_admin.get("/admin/models")).json() == []
    # A cancelled job goes away with its cancel (issue 38: it stayed readable at the
    # address it was deleted at): not found, not listed, not deleted twice.
    missing = await pull_admin.get(f"/admin/pulls/{job['id']}")
    assert missing.status_code == 404
    assert (await pull_admin.get("/admin/pulls")).json() == []
    assert (await pull_admin.delete(f"/admin/pulls/{job['id']}")).status_code == 404


def _peft_files(trained_on: str) -> dict[str, bytes]:
    """A PEFT LoRA repository's files: its config and a safetensors header with one lora_A."""
    config = {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "v_proj"],
              "base_model_name_or_path": trained_on}  # fmt: skip
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    header = json.dumps({name: {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 0]}})
    raw = header.encode()
    return {
        "adapter_config.json": json.dumps(config).encode(),
        "adapter_model.safetensors": struct.pack("<Q", len(raw)) + raw,
    }


async def test_an_adapter_repository_is_registered_for_the_model_it_was_trained_on(
    pull_admin: httpx.AsyncClient, hub: HubStandin
) -> None:
    hub.add_repo(LORA_REPO, _peft_files("berth-test/tiny-model"))
    base = (await pull_admin.post("/admin/pulls", json={"repo": "berth-test/tiny-model"})).json()
    assert (await _settled(pull_admin, base["id"]))["state"] == "done"

    job = (await pull_admin.post("/admin/pulls", json={"repo": LORA_REPO, "name": "lora"})).json()
    done = await _settled(pull_admin, job["id"])

    assert done["state"] == "done", done["error"]
    assert done["kind"] == "adapter"
    (adapter,) = (await pull_admin.get("/admin/adapters")).json()
    assert adapter["name"] == "lora"
    assert adapter["base"] == "berth-test/tiny-model"
    assert adapter["source"] == "hub" and adapter["repo_id"] == LORA_REPO
    # An adapter whose base cannot be found: downloaded, not registered, and it says why.
    hub.add_repo("org/pull-orphan", _peft_files("org/never-pulled"))
    orphan = (await pull_admin.post("/admin/pulls", json={"repo": "org/pull-orphan"})).json()
    failed = await _settled(pull_admin, orphan["id"])
    assert failed["state"] == "failed"
    assert "name its base model" in failed["error"]
    assert "org/never-pulled" in failed["error"]


@pytest.mark.parametrize(
    "body",
    [
        {"repo": "org/tiny", "name": "../x"},
        {"repo": "../../etc"},
        {"repo": "org/tiny/extra"},
        {"repo": ""},
        {"name": "tiny"},
    ],
)
async def test_a_bad_body_is_refused(pull_admin: httpx.AsyncClient, body: dict[str, str]) -> None:
    answer = await pull_admin.post("/admin/pulls", json=body)

    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert (await pull_admin.get("/admin/pulls")).json() == []


def test_the_client_starts_lists_shows_and_cancels_pulls(tmp_path: Path) -> None:
    job = Pull(
        id="pull-1-abc",
        repo="org/tiny",
        name="tiny",
        revision=None,
        base=None,
        state="downloading",
        error=None,
        done_bytes=58,
        total_bytes=TOTAL_BYTES,
        files=[PullFile(path="config.json", size_bytes=58, done_bytes=58)],
        kind=None,
        path=None,
        created_at=datetime(2026, 1, 2, tzinfo=UTC),
        finished_at=None,
    )
    seen: list[tuple[str, str, bytes]] = []

    def daemon(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, request.content))
        one = job.model_dump_json()
        listing = request.method == "GET" and request.url.path == "/admin/pulls"
        return httpx.Response(200, content=f"[{one}]" if listing else one)

    with DaemonClient(BerthHome(tmp_path), transport=httpx.MockTransport(daemon)) as client:
        assert client.start_pull(PullIn(repo="org/tiny", name="tiny")) == job
        assert client.pulls() == [job]
        assert client.pull(job.id) == job
        assert client.cancel_pull(job.id) == job

    assert [(method, path) for method, path, _ in seen] == [
        ("POST", "/admin/pulls"),
        ("GET", "/admin/pulls"),
        ("GET", "/admin/pulls/pull-1-abc"),
        ("DELETE", "/admin/pulls/pull-1-abc"),
    ]
    assert json.loads(seen[0][2])["repo"] == "org/tiny"
