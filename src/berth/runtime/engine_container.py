"""An engine in a container: the docker runtime's :class:`~berth.runtime.base.LaunchSpec`
for a deployment (the image's command, the model mounted read-only, the port inside, GPUs,
``/dev/shm``, ulimits and labels).  Pure, like :mod:`berth.runtime.engines`, whose engine
flags, request checks and key delivery it shares; the docker runtime starts what it
describes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import assert_never

from berth.errors import ConfigError
from berth.runtime.base import ContainerSpec, LaunchSpec, Mount
from berth.runtime.engines import ENGINE_HOST, check_request, health_path, key_delivery, serve_flags
from berth.runtime.gguf_folder import resolve_gguf
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import EngineName

#: ``/dev/shm`` size of engine containers unless the ``docker_shm_size`` setting says: vLLM
#: and SGLang document a large one for their workers (SGLang's examples use 32g); it is
#: memory used only as filled.
DEFAULT_SHM_SIZE = "16g"

#: The port each engine listens on inside its container: the images' documented defaults.
CONTAINER_PORTS: dict[EngineName, int] = {"llamacpp": 8080, "vllm": 8000, "sglang": 30000}

#: Where the model is mounted (read-only) inside a container.
CONTAINER_MODEL_DIR = "/models"

#: What the engine binds inside its container: Docker's published port arrives through the
#: container's own interface, not its loopback.  The host side is published on 127.0.0.1 only.
CONTAINER_BIND = "0.0.0.0"

#: ``(name, soft, hard)`` limits NVIDIA documents for its CUDA containers (unlimited locked
#: memory for pinned transfers, a 64 MiB stack), as SGLang's docker compose file also sets.
#: Given to containers that get GPUs only: a CPU engine has no use for them, and a Docker
#: engine without the right to raise ``memlock`` (inside another container) refuses them.
CONTAINER_ULIMITS: tuple[tuple[str, int, int], ...] = (
    ("memlock", -1, -1),
    ("stack", 67108864, 67108864),
)


def build_container_spec(
    req: DeploymentRequest, image: str, *, shm_size: str, secrets_dir: Path | None = None
) -> LaunchSpec:
    """Translate ``req`` into a container for the docker runtime.

    The model is bind-mounted read-only at ``/models``: a directory as a whole, a file with
    the folder it is in (a split GGUF's other shards live beside its first); when that folder
    holds symlinks (a Hugging Face cache snapshot), the common ancestor of the folder and the
    links' targets is mounted instead, so relative links still resolve in the container.
    The engine binds ``0.0.0.0`` at its image's usual port (:data:`CONTAINER_PORTS`); the
    runtime publishes that port on the host's 127.0.0.1 at a free port.  GPUs go through a
    device request, so no ``CUDA_VISIBLE_DEVICES`` is set; the engine sees them numbered
    from 0.  ``shm_size`` sizes ``/dev/shm`` (vLLM and SGLang share tensors between workers
    there); a container with GPUs also gets :data:`CONTAINER_ULIMITS`.  The API key goes
    in the container's environment (llama.cpp, vLLM), or in a file from ``secrets_dir``
    mounted read-only at :data:`~berth.runtime.engines.CONTAINER_KEY_FILE` (SGLang).

    Raises the same errors as :func:`~berth.runtime.engines.build_launch_spec`, except that
    no engine program is needed on the host, and ``ConfigError`` for a request with
    adapters (their files are not mounted into containers).
    """
    check_request(req, needs_port=False)
    if req.adapter_slots is not None or req.lora_files:
        raise ConfigError(
            "LoRA adapters are served by engines of the process runtime only: deploy the base "
            "with --runtime process"
        )
    if not image.strip():
        raise ConfigError("the docker image name is empty")
    served = req.effective_served_name
    port = CONTAINER_PORTS[req.engine]
    folder = (req.model_path if req.model_path.is_dir() else req.model_path.parent).resolve()
    source = _mount_root(folder)
    below = folder.relative_to(source).as_posix()
    inside = CONTAINER_MODEL_DIR if below == "." else f"{CONTAINER_MODEL_DIR}/{below}"
    if req.model_path.is_dir():
        if req.engine == "llamacpp":
            inside = f"{inside}/{resolve_gguf(req.model_path).name}"
    else:
        inside = f"{inside}/{req.model_path.name}"
    flags = serve_flags(req, served, CONTAINER_BIND, port)
    secret_env, secret_files, key_flags = key_delivery(req, secrets_dir, container=True)
    flags.extend(key_flags)
    command: list[str]
    if req.engine == "llamacpp":
        command = ["-m", inside, *flags]
    elif req.engine == "vllm":
        command = ["--model", inside, *flags]
    elif req.engine == "sglang":
        command = ["python3", "-m", "sglang.launch_server", "--model-path", inside, *flags]
    else:
        assert_never(req.engine)
    command.extend(req.extra_args)
    container = ContainerSpec(
        image=image.strip(),
        command=tuple(command),
        container_port=port,
        mounts=(
            Mount(source=source, target=CONTAINER_MODEL_DIR),
            *(Mount(f.path, f.container_path) for f in secret_files if f.container_path),
        ),
        gpus=req.gpus,
        shm_size=shm_size,
        ulimits=CONTAINER_ULIMITS if req.gpus else (),
        labels={
            "berth.deployment": req.deployment_id,
            "berth.model": served,
            "berth.engine": req.engine,
        },
    )
    return LaunchSpec(
        deployment_id=req.deployment_id,
        argv=tuple(command),
        port=0,
        health_path=health_path(req.engine),
        served_model_name=served,
        log_path=req.log_path,
        host=ENGINE_HOST,
        container=container,
        api_key=req.api_key,
        secret_env=secret_env,
        secret_files=secret_files,
    )


def _mount_root(folder: Path) -> Path:
    """The folder to mount so that ``folder`` and whatever its symlinks point at are inside.

    A Hugging Face cache snapshot holds relative links (``../../blobs/<hash>``), which resolve
    inside the container too when their common ancestor is what is mounted.
    """
    targets = [folder]
    for entry in folder.rglob("*"):
        if entry.is_symlink():
            targets.append(entry.resolve().parent)
    return Path(os.path.commonpath(targets))
