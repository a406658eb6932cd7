"""Admin input that must be refused with a 4xx, never a 500, and never read on the event loop.

A whole leader runs in the test's process (:class:`berth.daemon.server.Leader`, leader-only:
no engine is ever started) and is asked over its Unix socket, as the CLI asks it. Issue 38
found each of these answered 500, accepted, or blocking the leader's loop:

- a model path: ``/`` (walked on the loop for seconds, then a ``PermissionError``), a
  character device (``/dev/zero``), a FIFO (opening it blocks), a folder that cannot be
  read;
- numbers past what the store or the clock can hold: ``ended_within_s`` of ``1e20`` or
  ``inf``, a key's ``expires_at`` of ``9999-12-31T23:59:59-14:00``, a deployment ``ctx``
  of 2^63 or 10^12;
- names and values that passed unchecked: a ``served_model_name`` with CR, LF or ESC or
  past the length of names, ``"gpus": [false]`` read as GPU 0.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest
from prometheus_client.parser import text_string_to_metric_families

from berth.api.nodes import NODE_LABEL_PATTERN
from berth.cluster.pki.enrollment import validate_node_label
from berth.config import Settings
from berth.daemon.server import Leader
from berth.errors import ConfigError
from berth.paths import BerthHome


def _settings(home: BerthHome) -> Settings:
    flags: dict[str, object] = {
        "public_bind": "127.0.0.1",
        "public_host": "127.0.0.1",
        "cluster_bind": "127.0.0.1",
        "cluster_host": "127.0.0.1",
        "public_port": 0,
        "cluster_port": 0,
        "orphan_grace_s": 0,
        "leader_only": True,
        "drain_s": 0,
    }
    return Settings.load(home, flags=flags, env={})


@pytest.fixture
async def leader_api(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A started in-process leader's admin API over its Unix socket (no key needed)."""
    home = BerthHome(tmp_path / "home")
    leader = Leader(home, _settings(home))
    await leader.start()
    try:
        transport = httpx.AsyncHTTPTransport(uds=str(home.socket_file))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://berth", timeout=60
        ) as client:
            yield client
    finally:
        await leader.stop()


def _refused(response: httpx.Response, status: int = 400) -> str:
    """The message of an OpenAI-shaped refusal with ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    message: str = response.json()["error"]["message"]
    return message


def _lag_buckets(text: str) -> dict[str, float]:
    """``berth_event_loop_lag_seconds{node="local"}``'s cumulative bucket counts by ``le``."""
    for family in text_string_to_metric_families(text):
        if family.name == "berth_event_loop_lag_seconds":
            return {
                s.labels["le"]: s.value
                for s in family.samples
                if s.name.endswith("_bucket") and s.labels.get("node") == "local"
            }
    raise AssertionError("no berth_event_loop_lag_seconds in /metrics")


def _over(buckets: dict[str, float], bound: str) -> float:
    return buckets["+Inf"] - buckets[bound]


# -- model paths --------------------------------------------------------------------------


async def test_the_root_folder_is_refused_by_the_walks_bound_and_the_loop_keeps_ticking(
    leader_api: httpx.AsyncClient,
) -> None:
    before = _lag_buckets((await leader_api.get("/metrics")).text)
    response = await leader_api.post("/admin/models", json={"name": "root", "path": "/"})
    message = _refused(response)
    # The walk stops at its bound (or at the first folder it may not read): either way it
    # names the path and never turns into a 500.
    assert "/ holds more than" in message or message.startswith("cannot read /"), message
    after = _lag_buckets((await leader_api.get("/metrics")).text)
    # Walked on the loop, `/` stalled the leader for seconds; in a worker thread no tick of
    # the loop waited anywhere near that (0.5 s: room for a loaded machine; the 100 ms
    # target is measured in docs/testing.md).
    assert _over(after, "0.5") == _over(before, "0.5")
    assert (await leader_api.get("/admin/models")).json() == []


async def test_a_character_device_and_a_fifo_are_refused_as_models(
    leader_api: httpx.AsyncClient, tmp_path: Path
) -> None:
    message = _refused(
        await leader_api.post("/admin/models", json={"name": "zero", "path": "/dev/zero"})
    )
    assert message.startswith("/dev/zero is a character device, not a model"), message
    fifo = tmp_path / "weights.gguf"
    os.mkfifo(fifo)
    message = _refused(
        await leader_api.post("/admin/models", json={"name": "fifo", "path": str(fifo)})
    )
    assert message.startswith(f"{fifo} is a FIFO, not a model"), message


def _unreadable(tmp_path: Path) -> tuple[Path, Path]:
    """A model path that cannot be read, and the path a refusal must name: a folder holding
    a folder of mode 0 (not root), or ``/proc/1`` whose ``cwd`` link root may not follow in
    a container without ``CAP_SYS_PTRACE`` (issue 38's 500); skipped where neither is."""
    if os.geteuid() != 0:
        locked = tmp_path / "model" / "locked"
        locked.mkdir(parents=True)
        locked.chmod(0)
        return tmp_path / "model", locked
    try:
        os.stat("/proc/1/cwd")
    except PermissionError:
        return Path("/proc/1/cwd"), Path("/proc/1/cwd")
    pytest.skip("root may read every path here: no unreadable folder to register")


async def test_a_path_that_cannot_be_read_is_refused_naming_it(
    leader_api: httpx.AsyncClient, tmp_path: Path
) -> None:
    path, named = _unreadable(tmp_path)
    try:
        response = await leader_api.post("/admin/models", json={"name": "m", "path": str(path)})
    finally:
        if named.is_relative_to(tmp_path):
            named.chmod(0o700)
    assert _refused(response) == f"cannot read {named}: permission denied"


async def test_a_name_past_the_file_systems_limit_is_refused_for_models_and_adapters(
    leader_api: httpx.AsyncClient, tmp_path: Path
) -> None:
    long = "/" + "0" * 300  # one name past NAME_MAX (255): ENAMETOOLONG, was a 500
    weights = tmp_path / "base.gguf"
    weights.write_bytes(b"GGUF" + bytes(60))
    base = await leader_api.post("/admin/models", json={"name": "base", "path": str(weights)})
    assert base.status_code == 201, base.text
    for route, body in (
        ("/admin/models", {"name": "m", "path": long}),
        ("/admin/adapters", {"name": "a", "base": "base", "path": long}),
    ):
        message = _refused(await leader_api.post(route, json=body))
        assert message.startswith("path: ") and "each name at most 255" in message, message
    answer = await leader_api.post(
        "/admin/adapters", json={"name": "a", "base": "base", "path": "/dev/zero"}
    )
    assert _refused(answer).startswith("/dev/zero is a character device, not an adapter")


async def test_a_path_that_does_not_exist_is_not_found(
    leader_api: httpx.AsyncClient, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such.gguf"
    response = await leader_api.post("/admin/models", json={"name": "m", "path": str(missing)})
    assert _refused(response, 404) == f"model path does not exist: {missing}"


async def test_a_gguf_file_and_a_model_folder_are_still_registered_with_their_size(
    leader_api: httpx.AsyncClient, tmp_path: Path
) -> None:
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF" + b"\0" * 60)
    answer = await leader_api.post("/admin/models", json={"name": "file", "path": str(weights)})
    assert answer.status_code == 201, answer.text
    assert answer.json()["size_bytes"] == 64
    folder = tmp_path / "hf"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "model.safetensors").write_bytes(b"\0" * 100)
    (folder / "link.safetensors").symlink_to(folder / "sub" / "model.safetensors")
    (folder / "dangling").symlink_to(folder / "gone")
    answer = await leader_api.post("/admin/models", json={"name": "dir", "path": str(folder)})
    assert answer.status_code == 201, answer.text
    assert answer.json()["size_bytes"] == 2 + 100 + 100  # a linked file counts, as a blob


async def test_a_file_that_is_not_gguf_is_still_refused(
    leader_api: httpx.AsyncClient, tmp_path: Path
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    message = _refused(
        await leader_api.post("/admin/models", json={"name": "t", "path": str(text)})
    )
    assert message == f"{text} is not a GGUF file; register a .gguf file or a model folder"


# -- numbers and names --------------------------------------------------------------------


@pytest.mark.parametrize("window", ["1e20", "inf", "-inf", "nan", "-1", "316224001"])
async def test_an_ended_within_window_past_ten_years_or_not_finite_is_refused(
    leader_api: httpx.AsyncClient, window: str
) -> None:
    response = await leader_api.get(f"/admin/deployments?active=true&ended_within_s={window}")
    assert _refused(response).startswith("ended_within_s: "), response.text


async def test_an_ended_within_window_of_ten_years_is_answered(
    leader_api: httpx.AsyncClient,
) -> None:
    response = await leader_api.get("/admin/deployments?active=true&ended_within_s=316224000")
    assert response.status_code == 200, response.text
    assert response.json() == []


@pytest.mark.parametrize(
    ("expires_at", "says"),
    [
        ("9999-12-31T23:59:59-14:00", "is out of range"),
        ("0001-01-01T00:00:00+14:00", "is out of range"),
        ("2099-01-01T00:00:00", "with its offset"),
        ("1893456000", "with its offset"),  # not read as a Unix time
        ("soon", "expires_at: "),
    ],
)
async def test_a_key_expiry_the_clock_cannot_hold_is_refused_on_create_and_change(
    leader_api: httpx.AsyncClient, expires_at: str, says: str
) -> None:
    created = await leader_api.post("/admin/keys", json={"name": "k", "expires_at": expires_at})
    assert says in _refused(created)
    assert (await leader_api.post("/admin/keys", json={"name": "k"})).status_code == 201
    changed = await leader_api.patch("/admin/keys/k", json={"expires_at": expires_at})
    assert says in _refused(changed)
    assert (await leader_api.get("/admin/keys")).json()[0]["expires_at"] is None


async def _deploy_refused(api: httpx.AsyncClient, **fields: Any) -> str:
    """The refusal of a deployment of model ``m`` with ``fields``; nothing was created."""
    message = _refused(await api.post("/admin/deployments", json={"model": "m", **fields}))
    assert (await api.get("/admin/deployments")).json() == []
    return message


@pytest.mark.parametrize("ctx", [2**63, 10**12, 2**31, 0, -1])
async def test_a_context_length_past_any_engine_is_refused(
    leader_api: httpx.AsyncClient, ctx: int
) -> None:
    message = await _deploy_refused(leader_api, ctx=ctx)
    assert message.startswith("ctx: Input should be"), message


@pytest.mark.parametrize("gpus", [[False], [True], [0, "1"], [1.5], [-1], [1024]])
async def test_gpu_indexes_are_whole_numbers_never_booleans(
    leader_api: httpx.AsyncClient, gpus: list[Any]
) -> None:
    message = await _deploy_refused(leader_api, gpus=gpus)
    assert message.startswith("gpus."), message


@pytest.mark.parametrize(
    "served",
    ["chat\r\nX-Injected: 1", "red\x1b[31mname", "a" * 201, "a..b", "", " lead", "tab\there"],
)
async def test_a_served_model_name_follows_the_rules_of_every_other_name(
    leader_api: httpx.AsyncClient, served: str
) -> None:
    message = await _deploy_refused(leader_api, served_model_name=served)
    assert message.startswith("served_model_name: "), message


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/admin/plan", {"target": "m", "engine": ""}),
        ("/admin/plan", {"target": "m", "runtime": ""}),
        ("/admin/deployments", {"model": "m", "runtime": ""}),
        ("/admin/services", {"name": "s", "model": "m", "runtime": ""}),
    ],
)
async def test_an_empty_engine_or_runtime_is_refused_not_read_as_the_default(
    leader_api: httpx.AsyncClient, tmp_path: Path, route: str, body: dict[str, Any]
) -> None:
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF" + bytes(60))
    added = await leader_api.post("/admin/models", json={"name": "m", "path": str(weights)})
    assert added.status_code == 201, added.text
    # A plan of engine "" was answered 200 with llama.cpp's (schemathesis, issue 38).
    message = _refused(await leader_api.post(route, json=body))
    assert message.startswith(("unknown engine ''", "unknown runtime ''")), message


async def test_text_that_is_not_unicode_is_refused_in_any_field(
    leader_api: httpx.AsyncClient,
) -> None:
    raw = b'{"name": "bad\\ud800name"}'
    response = await leader_api.post(
        "/admin/keys", content=raw, headers={"content-type": "application/json"}
    )
    assert "not valid Unicode" in _refused(response) or "lone surrogate" in response.text
    message = await _deploy_refused(leader_api, extra_args=["--alias", "x\x00y"])
    assert message.startswith("extra_args.1: "), message


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/admin/deployments/d-1/logs?tail=1000000000000000000000", "tail"),
        ("/admin/deployments/d-1/logs?tail=-1", "tail"),
        ("/admin/requests?after=-1", "after"),
        ("/admin/requests?limit=100000", "limit"),
        ("/admin/usage?by=week", "by"),
    ],
)
async def test_query_numbers_and_words_out_of_range_are_refused(
    leader_api: httpx.AsyncClient, path: str, field: str
) -> None:
    assert _refused(await leader_api.get(path)).startswith(f"{field}: ")


async def test_usage_since_a_later_day_is_an_empty_report(leader_api: httpx.AsyncClient) -> None:
    response = await leader_api.get("/admin/usage?since=2999-01-01")
    assert response.status_code == 200, response.text
    assert response.json()["rows"] == []


# -- what the API says about itself -------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/admin/keys", "GET, POST"),
        ("/admin/keys/some-key", "PATCH, DELETE"),
        ("/admin/pulls/pull-1", "GET, DELETE"),
        ("/healthz", "GET"),
        ("/ui/session", "GET, POST, DELETE"),  # not the console's files' /ui/{name}
        ("/admin/nodes/enroll", "POST"),  # not /admin/nodes/{ident}
    ],
)
async def test_every_405_names_each_method_of_the_path_in_allow(
    leader_api: httpx.AsyncClient, path: str, allowed: str
) -> None:
    response = await leader_api.request("TRACE", path)
    assert response.status_code == 405
    assert response.headers["allow"] == allowed
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_the_schema_states_the_bounds_and_names_the_server_enforces(
    leader_api: httpx.AsyncClient,
) -> None:
    schema = (await leader_api.get("/admin/openapi.json")).json()
    bodies = schema["components"]["schemas"]
    deployment = bodies["DeploymentIn"]["properties"]
    assert deployment["ctx"]["anyOf"][0] == {
        "type": "integer",
        "exclusiveMinimum": 0,
        "maximum": 2**31 - 1,
    }
    assert deployment["gpus"]["items"] == {"type": "integer", "minimum": 0, "maximum": 1023}
    served = deployment["served_model_name"]["anyOf"][0]
    assert served["pattern"] == bodies["ModelIn"]["properties"]["name"]["pattern"]
    assert deployment["engine"]["enum"] == ["llamacpp", "vllm", "sglang"]
    image = deployment["image"]["anyOf"][0]["pattern"]
    assert re.fullmatch(image, "vllm/vllm-openai:v0.9.2")
    assert not re.fullmatch(image, "]D")  # refused by the leader, so not "valid" in the schema
    # The leader's own tiers.
    tiers = bodies["KeyIn"]["properties"]["tier"]["enum"]
    assert {"admin", "standard"} <= set(tiers)
    assert bodies["KeyChangeIn"]["properties"]["tier"]["anyOf"][0]["enum"] == tiers
    # A role is for admin keys: the schema says so, as the leader refuses it otherwise.
    created = jsonschema_rs.validator_for({**bodies["KeyIn"], "components": schema["components"]})
    assert created.is_valid({"name": "ops", "tier": "admin", "role": "viewer"})
    assert created.is_valid({"name": "ci", "tier": "standard", "role": None})
    assert not created.is_valid({"name": "ci", "tier": "standard", "role": "admin"})
    assert not created.is_valid({"name": "ci", "role": "viewer"})  # the default tier: standard
    change = jsonschema_rs.validator_for(
        {**bodies["KeyChangeIn"], "components": schema["components"]}
    )
    assert change.is_valid({"role": "viewer"}) and change.is_valid({"tier": "standard"})
    assert not change.is_valid({"tier": "standard", "role": "viewer"})
    listing = schema["paths"]["/admin/deployments"]["get"]["parameters"]
    window = next(p for p in listing if p["name"] == "ended_within_s")["schema"]["anyOf"][0]
    assert window["maximum"] == 316224000
    # An error is JSON on every route, also where success is text.
    for path in ("/metrics", "/admin/deployments/{deployment_id}/logs"):
        errors = schema["paths"][path]["get"]["responses"]["4XX"]["content"]
        assert list(errors) == ["application/json"]


async def test_a_model_that_nothing_serves_is_explained_as_a_conflict_not_an_outage(
    leader_api: httpx.AsyncClient, tmp_path: Path
) -> None:
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF" + bytes(60))
    assert (
        await leader_api.post("/admin/models", json={"name": "m", "path": str(weights)})
    ).status_code == 201
    response = await leader_api.get("/admin/routing/m")
    assert "has no ready deployment" in _refused(response, 409)


@pytest.mark.parametrize(
    "label",
    ["gpu-1", "a", "a" * 63, "a" * 64, "-gpu", "gpu-", "GPU", "gpu_1", "local", "locals",
     "n-1a2b3c4d", "n-1a2b3c4", "n-1a2b3c4dd", "", "g.pu", "0", "9-9"],
)  # fmt: skip
def test_the_schemas_node_label_pattern_is_the_leaders_rule(label: str) -> None:
    """``EnrollIn.label``'s pattern (for the schema) and ``validate_node_label`` (whose messages
    the leader answers) are two spellings of one rule: they must accept the same labels."""
    try:
        validate_node_label(label)
    except ConfigError:
        accepted = False
    else:
        accepted = True
    assert (re.match(NODE_LABEL_PATTERN, label) is not None) is accepted
