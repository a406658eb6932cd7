"""Why a request held for an on-demand load is answered without an engine.

Each is a 503 with ``Retry-After`` in the OpenAI error shape, answered by the proxy like any
:class:`~berth.routing.errors.NoReadyDeploymentError` (which they extend, so the proxy's
metrics and the routes' explanations treat them alike)::

    NoReadyDeploymentError          (berth.routing.errors: 503, no_ready_deployment)
    └── LoadError                   a request waited for its service to load, in vain
        ├── LoadTimeoutError        model_loading: not ready within load_wait_s (progress
        │                           in the message)
        ├── LoadQueueFullError      load_queue_full: load_queue_max requests already wait
        └── LoadFailedError         load_failed: the start was refused (no room, with the
                                    estimate) or the engine failed to start
"""

from __future__ import annotations

from berth.routing.errors import NoReadyDeploymentError


class LoadError(NoReadyDeploymentError):
    """A request for ``model`` waited for ``service`` to load and is answered 503.

    The message is ``detail`` alone (not "has no ready deployment: …"): it says what
    happened to the load.
    """

    error_code = "load_error"

    def __init__(self, model: str, service: str, detail: str, *, retry_after_s: float) -> None:
        super().__init__(model, retry_after_s=retry_after_s, detail=detail)
        self.service = service
        self.args = (detail,)


class LoadTimeoutError(LoadError):
    """The service was not ready within ``load_wait_s``; the message says how far its load
    got."""

    error_code = "model_loading"


class LoadQueueFullError(LoadError):
    """``load_queue_max`` requests already wait for the service."""

    error_code = "load_queue_full"


class LoadFailedError(LoadError):
    """The load was refused (nothing fits, with the estimate) or its engine failed."""

    error_code = "load_failed"
