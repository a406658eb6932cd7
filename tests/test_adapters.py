"""LoRA adapters without engines: reading adapter files and checking them against a base,
the routing tiers and the eviction choice (pure), the engine flags, the store's registry and
its migration, and the leader's gate (loads shared, least recently used idle adapter
unloaded, none unloaded while in use) over a fake link."""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web
from sqlalchemy import text

from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.adapters import AdapterManager
from berth.deployments.lora_plan import lora_notes, plan_lora
from berth.errors import ConfigError, ConflictError, EngineError, NotFoundError
from berth.routing.adapters import AdapterSlots, AdapterTier, eviction_choice, rank_tiers, tier_of
from berth.routing.errors import AdapterUnavailableError, NoReadyDeploymentError
from berth.routing.resolver import Upstream
from berth.runtime.engine_container import build_container_spec
from berth.runtime.engines import EngineBinaries, build_launch_spec, find_free_port
from berth.runtime.lora_api import load_adapter, unload_adapter
from berth.store import Store
from berth.store.migrations import MIGRATIONS, migrate
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.records import AdapterRecord, DeploymentRecord
from berth.vocab.states import DeploymentState
from berth.weights.adapter_files import check_fits, inspect_adapter, inspect_base
from support.fakes import FakeLink
from support.lora_gguf import write_lora_gguf

# -- files -----------------------------------------------------------------------------------


def write_base(folder: Path, *, hidden: int = 64, name: str = "org/tiny") -> Path:
    folder.mkdir(parents=True)
    config = {"model_type": "llama", "hidden_size": hidden, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 128, "_name_or_path": name}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_peft(
    folder: Path, *, rank: int = 8, inputs: int = 64, trained_on: str = "org/tiny", layer: int = 0
) -> Path:
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "target_modules": ["q_proj", "v_proj"],
              "base_model_name_or_path": trained_on}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    name = f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_A.weight"
    header = json.dumps({name: {"dtype": "F32", "shape": [rank, inputs], "data_offsets": [0, 0]}})
    raw = header.encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


def tiny_gguf_base(path: Path, arch: str = "llama", width: int = 32) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    for layer in range(2):
        q = np.zeros((width, width), dtype=np.float32)
        writer.add_tensor(f"blk.{layer}.attn_q.weight", q)
        writer.add_tensor(f"blk.{layer}.attn_v.weight", np.zeros((16, width), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_peft_folder_that_fits_its_base(tmp_path: Path) -> None:
    facts = inspect_adapter(write_peft(tmp_path / "a"))
    assert (facts.format, facts.rank, facts.target_modules) == ("peft", 8, ("q_proj", "v_proj"))
    base = inspect_base(write_base(tmp_path / "base"))
    assert base is not None and check_fits(facts, base, base_name="tiny") == []


@pytest.mark.parametrize(
    ("adapter", "reason"),
    [
        ({"trained_on": "org/other"}, "trained on 'org/other'"),
        ({"inputs": 32}, "takes 32 inputs, model 'tiny' has 64"),
        ({"layer": 5}, "changes layer 5, model 'tiny' has 2 layers"),
    ],
)
def test_a_peft_folder_that_does_not_fit_is_told_why(
    tmp_path: Path, adapter: dict[str, object], reason: str
) -> None:
    facts = inspect_adapter(write_peft(tmp_path / "a", **adapter))  # type: ignore[arg-type]
    base = inspect_base(write_base(tmp_path / "base"))
    assert base is not None
    (found,) = check_fits(facts, base, base_name="tiny")
    assert reason in found


def test_paths_that_are_not_adapters_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no adapter_config\.json"):
        inspect_adapter(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="is not an adapter"):
        inspect_adapter(tmp_path / "notes.txt")
    with pytest.raises(ConfigError, match="is a GGUF model, not an adapter"):
        inspect_adapter(tiny_gguf_base(tmp_path / "model.gguf"))
    bad_rank = write_peft(tmp_path / "bad")
    config = json.loads((bad_rank / "adapter_config.json").read_text())
    (bad_rank / "adapter_config.json").write_text(json.dumps({**config, "r": 0}))
    with pytest.raises(ConfigError, match="no positive LoRA rank"):
        inspect_adapter(bad_rank)


def test_a_gguf_lora_is_checked_against_the_base_s_architecture_and_shapes(
    tmp_path: Path,
) -> None:
    base_path = tiny_gguf_base(tmp_path / "base.gguf")
    base = inspect_base(base_path)
    assert base is not None
    fits = inspect_adapter(write_lora_gguf(base_path, tmp_path / "ok.gguf", rank=4))
    assert (fits.format, fits.rank, fits.architecture) == ("gguf", 4, "llama")
    assert check_fits(fits, base, base_name="tiny") == []
    other = inspect_adapter(write_lora_gguf(base_path, tmp_path / "q.gguf", architecture="qwen2"))
    assert check_fits(other, base, base_name="tiny") == [
        "the adapter is for architecture 'qwen2', model 'tiny' is 'llama'"
    ]
    wider = inspect_base(tiny_gguf_base(tmp_path / "wide.gguf", width=48))
    assert wider is not None
    misfits = check_fits(fits, wider, base_name="tiny")  # made for a width of 32
    assert (
        misfits
        and "blk.0.attn_q.weight.lora_a has shape [32, 4], which does not fit" in (misfits[0])
    )
    peft_on_gguf = check_fits(inspect_adapter(write_peft(tmp_path / "p")), base, base_name="tiny")
    assert "PEFT adapter folder is for vLLM and SGLang" in peft_on_gguf[0]


# -- tiers (pure) ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        (AdapterSlots("d", 2, frozenset({"a"})), AdapterTier.LOADED),
        (AdapterSlots("d", 2, frozenset({"b"})), AdapterTier.FREE_SLOT),
        (AdapterSlots("d", 1, frozenset({"b"})), AdapterTier.EVICT),
        (
            AdapterSlots("d", 1, frozenset({"b"}), frozenset({"b"})),
            "all 1 adapter slots are in use",
        ),
        (AdapterSlots("d", 2, frozenset(), has_files=False), "not on its node"),
        (AdapterSlots("d", None, frozenset({"a"})), AdapterTier.LOADED),
        (AdapterSlots("d", None, frozenset({"b"})), "started without this adapter"),
    ],
)
def test_tier_of(slots: AdapterSlots, expected: AdapterTier | str) -> None:
    found = tier_of("a", slots)
    if isinstance(expected, AdapterTier):
        assert found is expected
    else:
        assert isinstance(found, str) and expected in found


def test_rank_tiers_keeps_why_the_others_cannot() -> None:
    tiered = rank_tiers(
        "a",
        [AdapterSlots("loaded", 1, frozenset({"a"})), AdapterSlots("full", 1, frozenset({"b"}),
                                                                   frozenset({"b"}))],
    )  # fmt: skip
    assert tiered.tiers == {"loaded": AdapterTier.LOADED}
    assert "in use" in tiered.refused["full"]


def test_eviction_choice_is_the_least_recently_used_idle_adapter() -> None:
    slots = AdapterSlots("d", 3, frozenset({"x", "y", "z"}), frozenset({"x"}))
    assert eviction_choice(slots, {"x": 1.0, "y": 3.0, "z": 2.0}) == "z"  # x is oldest, but busy
    assert eviction_choice(slots, {"y": 3.0}) == "z"  # never used counts as oldest
    assert eviction_choice(AdapterSlots("d", 1, frozenset({"x"}), frozenset({"x"})), {}) is None


# -- engine flags ----------------------------------------------------------------------------


def _request(tmp_path: Path, engine: str, **extra: object) -> DeploymentRequest:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    return DeploymentRequest(
        deployment_id="d-1", model_name="m", model_path=model, engine=engine,  # type: ignore[arg-type]
        port=9000, log_path=tmp_path / "log", **extra,  # type: ignore[arg-type]
    )  # fmt: skip


BINARIES = EngineBinaries(llama_server="/bin/llama-server", vllm="/bin/vllm", sglang_python="py")


def test_engine_flags_for_adapters(tmp_path: Path) -> None:
    vllm = build_launch_spec(
        _request(tmp_path, "vllm", adapter_slots=3, max_lora_rank=12), BINARIES
    )
    assert vllm.argv[-5:] == ("--enable-lora", "--max-loras", "3", "--max-lora-rank", "16")
    assert vllm.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    sglang = build_launch_spec(
        _request(tmp_path, "sglang", adapter_slots=2, lora_target_modules=("q_proj", "v_proj")),
        BINARIES,
    )
    assert "--max-loras-per-batch" in sglang.argv
    assert sglang.argv[-3:] == ("--lora-target-modules", "q_proj", "v_proj")
    lora = tmp_path / "a.gguf"
    lora.write_bytes(b"GGUF")
    llama = build_launch_spec(_request(tmp_path, "llamacpp", lora_files=(lora,)), BINARIES)
    assert llama.argv[-3:] == ("--lora", str(lora), "--lora-init-without-apply")
    plain = build_launch_spec(_request(tmp_path, "vllm"), BINARIES)
    assert "--enable-lora" not in plain.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env
    with pytest.raises(ConfigError, match="berth sets the LoRA flags"):
        build_launch_spec(
            _request(tmp_path, "vllm", adapter_slots=1, extra_args=("--max-loras=4",)), BINARIES
        )
    with pytest.raises(ConfigError, match="process runtime only"):
        build_container_spec(_request(tmp_path, "vllm", adapter_slots=1), "img", shm_size="1g")


def _adapter(name: str, fmt: str, nodes: dict[str, str], rank: int | None = 8) -> AdapterRecord:
    return AdapterRecord(
        name,
        "m",
        fmt,
        rank,
        ("q_proj",),
        "local",
        None,
        None,
        datetime.now(UTC),
        nodes,  # type: ignore[arg-type]
    )


def test_plan_lora() -> None:
    adapters = [
        _adapter("b", "gguf", {"n1": "/b.gguf"}),
        _adapter("a", "gguf", {"n1": "/a.gguf", "n2": "/a2.gguf"}),
        _adapter("p", "peft", {"n1": "/p"}, rank=32),
    ]
    llama = plan_lora("llamacpp", "process", "n1", adapters, max_adapters=None,
                      node_serves_adapters=True)  # fmt: skip
    assert llama.names == ("a", "b") and [str(f) for f in llama.files] == ["/a.gguf", "/b.gguf"]
    vllm = plan_lora(
        "vllm", "process", "n2", adapters, max_adapters=None, node_serves_adapters=True
    )
    assert (vllm.slots, vllm.max_rank, vllm.target_modules) == (1, 32, ("q_proj",))
    none = plan_lora("vllm", "process", "n1", [], max_adapters=None, node_serves_adapters=True)
    assert none.slots is None
    old = plan_lora("vllm", "process", "n1", adapters, max_adapters=2, node_serves_adapters=False)
    assert old.slots is None  # an agent without op.load_adapter starts it without LoRA
    with pytest.raises(ConfigError, match="for vLLM and SGLang"):
        plan_lora("llamacpp", "process", "n1", [], max_adapters=2, node_serves_adapters=True)


# -- the store -------------------------------------------------------------------------------


def test_the_registry_and_its_names(store: Store) -> None:
    store.ensure_local_node()
    store.add_model("base", "/models/base")
    added = store.add_adapter("sql", "base", "local", "/a/sql", format="peft", rank=8)
    assert added.locations == {"local": "/a/sql"}
    with pytest.raises(ConflictError, match="a model's name"):
        store.add_adapter("base", "base", "local", "/a/x", format="peft")
    with pytest.raises(NotFoundError):
        store.add_adapter("x", "nope", "local", "/a/x", format="peft")
    with pytest.raises(ConflictError, match="adapter of 'base'"):
        store.add_model("sql", "/models/sql")
    with pytest.raises(ConflictError, match="adapter of 'base'"):
        store.create_service_profile("sql", "base", "vllm", "process")
    with pytest.raises(ConflictError, match="base of adapter"):
        store.remove_model("base")
    with pytest.raises(ConflictError, match="already at /a/sql"):
        store.add_adapter("sql", "base", "local", "/elsewhere", format="peft")
    assert store.remove_adapter("sql").name == "sql"
    assert store.list_adapters() == []


def test_a_migration_numbered_below_one_already_applied_still_runs(tmp_path: Path) -> None:
    """Numbers may skip (features reserve theirs): a database at 7 gets a later-landed 5."""
    from sqlalchemy import create_engine

    from berth.store.migrations import Migration

    engine = create_engine(f"sqlite:///{tmp_path / 'late.db'}")
    applied: list[int] = []

    def five(conn: object) -> None:
        applied.append(5)

    without_five = tuple(m for m in MIGRATIONS if m.version != 5)
    migrate(engine, migrations=without_five)
    steps = tuple(sorted((*without_five, Migration(5, "late", five)), key=lambda m: m.version))  # type: ignore[arg-type]
    migrate(engine, migrations=steps)
    migrate(engine, migrations=steps)
    assert applied == [5]
    with engine.connect() as conn:
        versions = conn.execute(text("SELECT version FROM schema_version")).scalars().all()
    assert sorted(versions) == [m.version for m in steps]
    engine.dispose()


# -- the gate --------------------------------------------------------------------------------


def _record(deployment_id: str, node: str, slots: int | None) -> DeploymentRecord:
    now = datetime.now(UTC)
    return DeploymentRecord(
        deployment_id, "m", "vllm", "process", node, DeploymentState.READY, 1, 1, (), None, (),
        "m", None, now, now, adapter_slots=slots,
    )  # fmt: skip


def _manager(slots: int = 2) -> tuple[AdapterManager, FakeLink, list[float]]:
    link = FakeLink("n1")
    now = [0.0]
    manager = AdapterManager(LinkRegistry([link]), clock=lambda: now[0])
    manager.deployment_changed(_record("d-1", "n1", slots))
    manager.load_registry(
        [_adapter(name, "peft", {"n1": f"/a/{name}"}) for name in ("x", "y", "z")]
    )
    return manager, link, now


def _upstream(manager: AdapterManager, adapter: str) -> Upstream:
    entry = manager.entry(adapter)
    assert entry is not None
    base = Upstream("http://127.0.0.1:1", "d-1", "n1", "m")
    (upstream,) = manager.upstreams(entry, [base])
    return upstream


async def test_requests_share_one_load_and_the_lru_idle_adapter_makes_room() -> None:
    manager, link, now = _manager()
    first = _upstream(manager, "x")
    assert first.tier == AdapterTier.FREE_SLOT and first.model == "x"
    leases = await asyncio.gather(manager.enter(first), manager.enter(first))
    assert link.adapter_calls == [("load", "d-1", "x")]  # one load for both
    for lease in leases:
        assert lease is not None
        lease.release(200)
    now[0] = 1.0
    y = await manager.enter(_upstream(manager, "y"))
    assert y is not None
    now[0] = 2.0
    x_again = await manager.enter(_upstream(manager, "x"))  # x is now newer than y
    assert x_again is not None
    x_again.release(200)
    busy = y  # y stays in use: it must not be the one unloaded
    z = _upstream(manager, "z")
    assert z.tier == AdapterTier.EVICT
    lease = await manager.enter(z)
    assert lease is not None
    assert link.adapter_calls[-2:] == [("unload", "d-1", "x"), ("load", "d-1", "z")]
    assert sorted(d for d, _n in manager.loaded_on("z")) == ["d-1"]
    busy.release(200)
    lease.release(200)


async def test_with_every_slot_in_use_there_is_no_tier_and_a_404_forgets_the_adapter() -> None:
    manager, link, _now = _manager(slots=1)
    held = await manager.enter(_upstream(manager, "x"))
    assert held is not None
    entry = manager.entry("y")
    assert entry is not None
    with pytest.raises(NoReadyDeploymentError, match="all 1 adapter slots are in use"):
        manager.upstreams(entry, [Upstream("http://127.0.0.1:1", "d-1", "n1", "m")])
    held.release(404)  # the engine lost it: the next request loads it again
    assert manager.loaded_on("x") == []
    lease = await manager.enter(_upstream(manager, "x"))
    assert lease is not None
    assert link.adapter_calls == [("load", "d-1", "x"), ("load", "d-1", "x")]
    lease.release(200)


async def test_a_failed_load_is_an_attempt_to_retry_elsewhere() -> None:
    manager, link, _now = _manager()

    async def refuse(deployment_id: str, engine: str, adapter: str, path: str) -> None:
        raise EngineError("the engine refused")

    link.load_adapter = refuse  # type: ignore[method-assign]
    with pytest.raises(AdapterUnavailableError, match="could not load adapter 'x'"):
        await manager.enter(_upstream(manager, "x"))
    assert manager.loaded_on("x") == []


def test_deployments_started_without_lora_need_a_restart_for_adapters() -> None:
    manager, _link, _now = _manager()
    manager.deployment_changed(_record("d-2", "n1", None))  # vLLM started without LoRA
    assert manager.restarts_for("m") == {"d-2": ["x", "y", "z"]}
    assert manager.restarts_for("other") == {}
    assert lora_notes(plan_lora("vllm", "process", "n1", [], max_adapters=2,
                                node_serves_adapters=True)) == [
        "starts with LoRA on: 2 adapter slots, loaded on demand"
    ]  # fmt: skip


# -- the engines' adapter API ------------------------------------------------------------------


async def test_sglang_and_vllm_adapter_api_over_real_http() -> None:
    """``runtime/lora_api``: each engine's paths, the key sent, and how each engine's own
    refusals are read (an adapter already loaded or already gone is no failure)."""
    seen: list[tuple[str, object, str | None]] = []

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.path, body, request.headers.get("Authorization")))
        name = body["lora_name"]
        if request.path == "/load_lora_adapter" and name == "broken":
            return web.json_response(
                {"success": False, "error_message": "rank 64 is above --max-lora-rank 16"},
                status=400,
            )
        if request.path == "/unload_lora_adapter" and name == "gone":
            return web.json_response(
                {"success": False, "error_message": "LoRA adapter gone not found"}, status=400
            )
        if request.path == "/v1/load_lora_adapter" and name == "twice":
            message = "The lora adapter 'twice' has already been loaded."
            return web.json_response({"error": {"message": message}}, status=400)
        return web.json_response({"success": True})

    app = web.Application()
    for path in ("/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter"):
        app.router.add_post(path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        url = f"http://127.0.0.1:{port}"
        await load_adapter("sglang", url, "sql", "/a/sql", api_key="k1")
        await unload_adapter("sglang", url, "gone", api_key=None)  # already gone: fine
        await load_adapter("vllm", url, "twice", "/a/twice", api_key=None)  # already there
        with pytest.raises(EngineError, match="rank 64 is above --max-lora-rank 16"):
            await load_adapter("sglang", url, "broken", "/a/broken", api_key=None)
        with pytest.raises(ConfigError, match="restart the deployment"):
            await load_adapter("llamacpp", url, "x", "/a/x.gguf", api_key=None)
    finally:
        await runner.cleanup()
    assert seen[0] == ("/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"},
                       "Bearer k1")  # fmt: skip
    assert [path for path, _body, _key in seen] == [
        "/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter",
        "/load_lora_adapter",
    ]  # fmt: skip


async def test_a_restarted_engine_holds_no_adapter_it_had_loaded() -> None:
    manager, link, _now = _manager()
    lease = await manager.enter(_upstream(manager, "x"))
    assert lease is not None
    lease.release(200)
    assert manager.loaded_on("x") == [("d-1", "n1")]
    restarting = replace(_record("d-1", "n1", 2), state=DeploymentState.RESTARTING)
    manager.deployment_changed(restarting)  # its engine ended: what it had loaded is gone
    assert manager.loaded_on("x") == []
    manager.deployment_changed(_record("d-1", "n1", 2))  # ready again, after the restart
    lease = await manager.enter(_upstream(manager, "x"))
    assert lease is not None
    lease.release(200)
    assert link.adapter_calls == [("load", "d-1", "x"), ("load", "d-1", "x")]
