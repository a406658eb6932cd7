"""What an engine start prepares on this host before a runtime runs it.

An engine gets an API key of its own (:func:`new_engine_key`), made here, on the host that
runs it.  :func:`launch_spec` turns the deployment request into the process or container to
start; the secret files that spec names (an engine that reads its key from a file) are
written with mode 0600 before the start (:func:`write_secret_files`) and removed once the
engine answers or the start fails (:func:`remove_secret_files`, :func:`remove_key_files`).
The agent core (:class:`berth.agent.core.AgentCore`) calls these; nothing here keeps state.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import replace
from pathlib import Path

from berth.atomic import write_atomic
from berth.errors import EngineError
from berth.runtime.base import LaunchSpec, SecretFile
from berth.runtime.engine_container import build_container_spec
from berth.runtime.engines import EngineBinaries, build_launch_spec, find_free_port
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.images import DEFAULT_IMAGES

#: What every engine API key starts with (so a leaked one is recognised as berth's).
ENGINE_KEY_PREFIX = "berth-ek-"


def new_engine_key() -> str:
    """A fresh engine API key: :data:`ENGINE_KEY_PREFIX` and 256 random bits (URL-safe
    base64, so no character any engine splits keys on)."""
    return ENGINE_KEY_PREFIX + secrets.token_urlsafe(32)


def launch_spec(
    request: DeploymentRequest,
    binaries: EngineBinaries,
    *,
    docker_shm_size: str,
    keys_dir: Path,
) -> LaunchSpec:
    """The container (``request.runtime`` ``docker``: its image, or the engine's default
    one, with ``/dev/shm`` of ``docker_shm_size``) or process (on ``request.port``, a free
    port when 0) that runs ``request``'s engine; its secret files go in ``keys_dir``.

    Raises what :func:`~berth.runtime.engines.build_launch_spec` and
    :func:`~berth.runtime.engine_container.build_container_spec` raise.
    """
    if request.runtime == "docker":
        image = request.image or DEFAULT_IMAGES[request.engine]
        return build_container_spec(request, image, shm_size=docker_shm_size, secrets_dir=keys_dir)
    request = replace(request, port=request.port or find_free_port())
    return build_launch_spec(request, binaries, secrets_dir=keys_dir)


async def write_secret_files(files: tuple[SecretFile, ...], deployment_id: str) -> None:
    """Write each file with mode 0600 (its folder 0700, made when missing), off the event
    loop; raises ``EngineError`` (for ``deployment_id``) when one cannot be written."""
    try:
        await asyncio.to_thread(_write_files, files)
    except OSError as exc:
        raise EngineError(
            f"cannot write the engine's key file: {exc.strerror or exc}",
            deployment_id=deployment_id,
        ) from exc


def _write_files(files: tuple[SecretFile, ...]) -> None:
    for secret in files:
        secret.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(secret.path, secret.content, mode=0o600, durable=False)


def remove_secret_files(files: tuple[SecretFile, ...]) -> None:
    """Remove each file (one already gone is no error)."""
    for secret in files:
        secret.path.unlink(missing_ok=True)


def remove_key_files(keys_dir: Path, deployment_id: str) -> None:
    """Remove what ``keys_dir`` still holds of ``deployment_id`` (a start cut short)."""
    with contextlib.suppress(OSError):
        for path in keys_dir.glob(f"{deployment_id}.*"):
            path.unlink(missing_ok=True)
