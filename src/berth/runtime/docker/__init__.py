"""The docker runtime: each engine runs in a container on this host's Docker engine.

- :mod:`~berth.runtime.docker.api`: the seam, the :class:`DockerApi` Protocol with its typed
  results and errors;
- :mod:`~berth.runtime.docker.sdk`: the real :class:`DockerApi` over the ``docker`` SDK (the
  only module that sees the SDK);
- :mod:`~berth.runtime.docker.spec`: the container berth creates for a launch spec (name,
  labels, configuration);
- :mod:`~berth.runtime.docker.containers`: create and start, stop and remove, find by labels
  (blocking sequences of Docker calls);
- :mod:`~berth.runtime.docker.pull`: pulling an image, with its progress;
- :mod:`~berth.runtime.docker.logs`: copying a container's output into its deployment's log;
- :mod:`~berth.runtime.docker.threads`: where the blocking calls run (off the event loop);
- :mod:`~berth.runtime.docker.runtime`: :class:`DockerRuntime`, the engine lifecycle.

The names callers use are importable from here.
"""

from berth.runtime.docker.api import (
    ContainerInfo,
    DockerApi,
    DockerApiError,
    DockerConflict,
    DockerNotFound,
    DockerUnreachable,
    ImageInfo,
)
from berth.runtime.docker.pull import PullProgress
from berth.runtime.docker.runtime import (
    DEFAULT_DOCKER_HOST,
    DockerRuntime,
    DockerStatus,
    resolve_docker_host,
)
from berth.runtime.docker.sdk import connect_docker, docker_error_text
from berth.runtime.docker.spec import CONTAINER_PREFIX, DEPLOYMENT_LABEL, HOME_LABEL, NODE_LABEL

__all__ = [
    "CONTAINER_PREFIX",
    "DEFAULT_DOCKER_HOST",
    "DEPLOYMENT_LABEL",
    "HOME_LABEL",
    "NODE_LABEL",
    "ContainerInfo",
    "DockerApi",
    "DockerApiError",
    "DockerConflict",
    "DockerNotFound",
    "DockerRuntime",
    "DockerStatus",
    "DockerUnreachable",
    "ImageInfo",
    "PullProgress",
    "connect_docker",
    "docker_error_text",
    "resolve_docker_host",
]
