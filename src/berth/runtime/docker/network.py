"""The Docker network engine containers sit on: a bridge of berth's own where containers
cannot reach each other.

On Docker's default bridge every container can open connections to every other one, so an
engine would be reachable from any container on the host, whatever its port is published on.
berth puts its engines on a user-defined bridge, :data:`ENGINE_NETWORK`, created with
``com.docker.network.bridge.enable_icc=false`` (the bridge driver's option for "no traffic
between containers", Docker's network driver documentation); their ports are still published
on the host's 127.0.0.1 only, which is how berth reaches them.  The network is created on
first use and never removed: every berth home on the Docker engine shares it.
"""

from __future__ import annotations

import contextlib

from berth.errors import EngineError
from berth.runtime.docker.api import DockerApi, DockerConflict, NetworkInfo

#: The network engine containers are attached to.
ENGINE_NETWORK = "berth-engines"
#: The bridge driver option that allows (``true``) or forbids traffic between containers.
ICC_OPTION = "com.docker.network.bridge.enable_icc"
#: The label berth sets on the network it creates.
NETWORK_LABEL = "berth.network"


def ensure_engine_network(client: DockerApi) -> NetworkInfo:
    """The engine network, created when missing (by this call or a concurrent one).

    Raises :class:`~berth.errors.EngineError` when a network of that name exists that lets
    containers talk to each other (not made by berth): berth never attaches engines to it.
    Docker's own errors pass as :class:`~berth.runtime.docker.api.DockerApiError`.
    """
    found = client.inspect_network(ENGINE_NETWORK)
    if found is None:
        # A conflict: made meanwhile by another berth on this Docker engine.
        with contextlib.suppress(DockerConflict):
            client.create_network(
                ENGINE_NETWORK,
                options={ICC_OPTION: "false"},
                labels={NETWORK_LABEL: "engines"},
            )
        found = client.inspect_network(ENGINE_NETWORK)
        if found is None:
            raise EngineError(f"Docker network {ENGINE_NETWORK} vanished as it was created")
    if found.driver != "bridge" or found.options.get(ICC_OPTION) != "false":
        raise EngineError(
            f"Docker network {ENGINE_NETWORK} exists but is not a bridge with {ICC_OPTION}=false "
            f"(containers on it could reach each other): remove it (docker network rm "
            f"{ENGINE_NETWORK}) and berth creates it again"
        )
    return found
