"""The container berth creates for an engine (its name, labels and configuration), and the
engine handle and exit description read back from what ``docker inspect`` says.

A container is named ``berth-<deployment id>`` and labelled with its deployment (and the
model and engine, from the launch spec), the node that runs it and the berth home that owns
it (``docker ps --filter label=berth.deployment``).  The labels are how a restarted agent
finds its containers again, and keep two berth homes on one Docker engine apart.
"""

from __future__ import annotations

from berth.runtime.base import ContainerSpec, EngineHandle, LaunchSpec
from berth.runtime.docker.api import ContainerConfig, ContainerInfo
from berth.runtime.docker.network import ENGINE_NETWORK
from berth.runtime.exits import container_exit_words

DEPLOYMENT_LABEL = "berth.deployment"
NODE_LABEL = "berth.node"
HOME_LABEL = "berth.home"
#: Container names: this prefix and the deployment id.
CONTAINER_PREFIX = "berth-"


def container_name(deployment_id: str) -> str:
    """``berth-<deployment id>``."""
    return CONTAINER_PREFIX + deployment_id


def owner_labels(home: str, node_id: str, deployment_id: str | None) -> list[str]:
    """Label filters (``key=value``) selecting the containers of ``home`` on ``node_id``:
    of one deployment, or of any deployment when ``deployment_id`` is ``None``."""
    labels = [f"{HOME_LABEL}={home}", f"{NODE_LABEL}={node_id}"]
    labels.append(f"{DEPLOYMENT_LABEL}={deployment_id}" if deployment_id else DEPLOYMENT_LABEL)
    return labels


def container_config(
    spec: LaunchSpec, container: ContainerSpec, *, home: str, node_id: str
) -> ContainerConfig:
    """The container for ``spec`` (whose ``container`` is ``container``), owned by ``home``
    on ``node_id``.

    The engine's port is published on ``spec.host`` only (the host's loopback), at a port
    Docker picks; GPUs (NVML indexes) go in a device request; docker-init runs as PID 1,
    forwarding signals to the engine and reaping the helper processes vLLM and SGLang fork.
    The container is on berth's engine network (no traffic between containers) and its
    environment carries the engine's key (``spec.secret_env``).
    """
    return ContainerConfig(
        image=container.image,
        name=container_name(spec.deployment_id),
        command=container.command,
        labels={
            **container.labels,
            DEPLOYMENT_LABEL: spec.deployment_id,
            NODE_LABEL: node_id,
            HOME_LABEL: home,
        },
        environment=spec.environment(),
        ports={container.container_port: spec.host},
        mounts=container.mounts,
        gpu_device_ids=tuple(str(index) for index in container.gpus),
        ulimits=container.ulimits,
        shm_size=container.shm_size,
        init=True,
        network=ENGINE_NETWORK,
    )


def engine_handle(deployment_id: str, info: ContainerInfo) -> EngineHandle:
    """The handle of the engine in the container ``info`` describes.

    A container that already exited has no published port (0 then): waiting for its health
    reports how it exited, with its output.
    """
    return EngineHandle(
        deployment_id=deployment_id,
        pid=info.state.pid,
        port=info.published_port() or 0,
        runtime="docker",
        container_id=info.id,
    )


def exit_description(info: ContainerInfo | None) -> str:
    """How a stopped container ended, after the word "container": ``exited with code 1
    (killed: out of memory)``, or ``was removed`` when it is gone."""
    if info is None:
        return "was removed"
    state = info.state
    text = container_exit_words(state.exit_code)
    if state.oom_killed:
        text += " (killed: out of memory)"
    if state.error:
        text += f" ({state.error})"
    return text
