"""The admin API's client over the daemon's Unix socket (``$BERTH_HOME/berth.sock``), for the
CLI and ``berth doctor``.

The socket is mode 0600, so reaching it proves the caller is the daemon's owner and no key
is sent.  Every admin endpoint has one typed method here, which sends a request body of
:mod:`berth.api` and decodes the answer into the model the daemon declares for it.  Errors
come back in the OpenAI error shape and are raised as berth's own error types (a 404 as
:class:`NotFoundError`, a 409 as :class:`ConflictError`, …) carrying the daemon's message,
so the CLI prints one line and exits with that error's code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from berth.api import (
    Adapter,
    AdapterIn,
    AdapterRemoved,
    AddedAdapter,
    ApiKey,
    CreatedApiKey,
    DaemonInfo,
    DeployIn,
    Deployment,
    DeploymentIn,
    DrainIn,
    EnrollIn,
    EnrollmentIssued,
    ErrorBody,
    FallbackIn,
    KeyChangeIn,
    KeyIn,
    LeaderStatus,
    ListedDeployment,
    LocatedModel,
    MetricsSnapshot,
    ModelDetail,
    ModelIn,
    ModelRemoved,
    NodeDetail,
    NodeDetailWithAdopted,
    NodeMaintenance,
    NodeSummary,
    Plan,
    PlanIn,
    RegisteredModel,
    Route,
    RouteIn,
    RouteRemoved,
    RoutingExplanation,
    ScaleIn,
    Service,
    ServiceDetail,
    ServiceIn,
    SettingsReport,
    StepDownAccepted,
    StepDownIn,
    Uncordoned,
    UsageGrouping,
    UsageReport,
    describe_invalid,
)
from berth.api.ca import CaStatus, RetireIn
from berth.api.pulls import Pull, PullIn
from berth.errors import (
    AuthError,
    BerthError,
    ConfigError,
    ConflictError,
    DaemonError,
    EngineError,
    NotFoundError,
    RateLimitError,
)
from berth.paths import BerthHome, resolve_home

#: Seconds to wait for an ordinary admin call.
DEFAULT_TIMEOUT_S = 30.0

_T = TypeVar("_T")
_Params = Mapping[str, str | int | bool]

_MODELS = TypeAdapter(list[LocatedModel])
_ADAPTERS = TypeAdapter(list[Adapter])
_PULLS = TypeAdapter(list[Pull])
_ADDED_MODEL = TypeAdapter(LocatedModel | RegisteredModel)
_DEPLOYMENTS = TypeAdapter(list[ListedDeployment])
_KEYS = TypeAdapter(list[ApiKey])
_NODES = TypeAdapter(list[NodeSummary])
_SERVICES = TypeAdapter(list[Service])
_ROUTES = TypeAdapter(list[Route])
_SETTINGS = TypeAdapter(SettingsReport)


def _segment(text: str, *, safe: str = "") -> str:
    """``text`` as one URL path segment (model and route names keep ``/`` and ``:``)."""
    return quote(text, safe=safe)


class DaemonClient:
    """Talks to the daemon of one ``BerthHome`` over its socket.

    Every method raises :class:`DaemonError` when no daemon answers (or its answer is not
    what this berth expects), and the :class:`BerthError` subclass the daemon's error
    status stands for otherwise (see :func:`error_from_response`).
    """

    def __init__(
        self,
        home: BerthHome,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """``transport`` replaces the socket (tests pass an ``httpx.MockTransport``)."""
        self.home = home
        self._client = httpx.Client(
            # verify=False: no TLS on a Unix socket, and it skips loading a CA bundle.
            transport=transport or httpx.HTTPTransport(uds=str(home.socket_file), verify=False),
            base_url="http://berth",
            timeout=timeout_s,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def is_running(self) -> bool:
        """Whether a daemon answers on the socket."""
        if not self.home.socket_file.exists():
            return False
        try:
            self._client.get("/healthz", timeout=2.0)
        except httpx.TransportError:
            return False
        return True

    # -- the leader ----------------------------------------------------------------------------
    def info(self) -> DaemonInfo:
        """``GET /admin/info``: version, pid, listeners, CA, runtimes."""
        return self.call("GET", "/admin/info", TypeAdapter(DaemonInfo))

    def leader(self) -> LeaderStatus:
        """``GET /admin/leader``: this leader's role, the lease's epoch, the active's address."""
        return self.call("GET", "/admin/leader", TypeAdapter(LeaderStatus))

    def step_down(self, *, force: bool = False) -> StepDownAccepted:
        """``POST /admin/leader/step-down``: hand leadership over, finish, exit; refused
        (:class:`ConflictError`) when no other leader was seen within the lease, unless
        ``force``."""
        body = StepDownIn(force=True) if force else StepDownIn()
        return self.call(
            "POST", "/admin/leader/step-down", TypeAdapter(StepDownAccepted), body=body
        )

    def settings(self) -> SettingsReport:
        """``GET /admin/config``: every setting the daemon runs with, and its source."""
        return self.call("GET", "/admin/config", _SETTINGS)

    # -- models --------------------------------------------------------------------------------
    def models(self) -> list[LocatedModel]:
        """``GET /admin/models``."""
        return self.call("GET", "/admin/models", _MODELS)

    def add_model(self, body: ModelIn) -> LocatedModel | RegisteredModel:
        """``POST /admin/models``; with ``locations`` when registered on another node."""
        return self.call("POST", "/admin/models", _ADDED_MODEL, body=body)

    def model(self, name: str) -> ModelDetail:
        """``GET /admin/models/{name}``: the model with each copy's shape and estimate."""
        path = f"/admin/models/{_segment(name, safe='/:')}"
        return self.call("GET", path, TypeAdapter(ModelDetail))

    def remove_model(self, name: str) -> ModelRemoved:
        """``DELETE /admin/models/{name}``."""
        path = f"/admin/models/{_segment(name, safe='/:')}"
        return self.call("DELETE", path, TypeAdapter(ModelRemoved))

    # -- adapters ------------------------------------------------------------------------------
    def adapters(self) -> list[Adapter]:
        """``GET /admin/adapters``."""
        return self.call("GET", "/admin/adapters", _ADAPTERS)

    def add_adapter(self, body: AdapterIn) -> AddedAdapter:
        """``POST /admin/adapters``."""
        return self.call("POST", "/admin/adapters", TypeAdapter(AddedAdapter), body=body)

    def adapter(self, name: str) -> Adapter:
        """``GET /admin/adapters/{name}``."""
        path = f"/admin/adapters/{_segment(name, safe='/:')}"
        return self.call("GET", path, TypeAdapter(Adapter))

    def remove_adapter(self, name: str, node: str | None = None) -> AdapterRemoved:
        """``DELETE /admin/adapters/{name}``: the adapter, or only its copy on ``node``."""
        path = f"/admin/adapters/{_segment(name, safe='/:')}"
        params = {"node": node} if node is not None else None
        return self.call("DELETE", path, TypeAdapter(AdapterRemoved), params=params)

    # -- pulls ---------------------------------------------------------------------------------
    def start_pull(self, body: PullIn) -> Pull:
        """``POST /admin/pulls``: the leader downloads and registers; the job, ``queued``."""
        return self.call("POST", "/admin/pulls", TypeAdapter(Pull), body=body)

    def pulls(self) -> list[Pull]:
        """``GET /admin/pulls``."""
        return self.call("GET", "/admin/pulls", _PULLS)

    def pull(self, pull_id: str) -> Pull:
        """``GET /admin/pulls/{id}``."""
        return self.call("GET", f"/admin/pulls/{_segment(pull_id)}", TypeAdapter(Pull))

    def cancel_pull(self, pull_id: str) -> Pull:
        """``DELETE /admin/pulls/{id}``: stop the job (or forget a finished one)."""
        return self.call("DELETE", f"/admin/pulls/{_segment(pull_id)}", TypeAdapter(Pull))

    # -- deployments ---------------------------------------------------------------------------
    def deployments(
        self, *, active: bool = False, ended_within_s: int | None = None
    ) -> list[ListedDeployment]:
        """``GET /admin/deployments``: every deployment, or the active ones (with those that
        ended ``ended_within_s`` seconds ago or less, when given)."""
        params: dict[str, str | int | bool] = {"active": active}
        if ended_within_s is not None:
            params["ended_within_s"] = ended_within_s
        return self.call("GET", "/admin/deployments", _DEPLOYMENTS, params=params)

    def deployment(self, deployment_id: str) -> Deployment:
        """``GET /admin/deployments/{id}``."""
        path = f"/admin/deployments/{_segment(deployment_id)}"
        return self.call("GET", path, TypeAdapter(Deployment))

    def create_deployment(self, body: DeploymentIn) -> Deployment:
        """``POST /admin/deployments``: the new deployment, pending."""
        return self.call("POST", "/admin/deployments", TypeAdapter(Deployment), body=body)

    def stop_deployment(self, deployment_id: str) -> Deployment:
        """``POST /admin/deployments/{id}/stop``: returns once its engine stopped."""
        path = f"/admin/deployments/{_segment(deployment_id)}/stop"
        return self.call("POST", path, TypeAdapter(Deployment))

    @contextmanager
    def logs(self, deployment_id: str, *, tail: int, follow: bool) -> Iterator[Iterator[bytes]]:
        """``GET /admin/deployments/{id}/logs``: an iterator over the raw log chunks, from
        ``tail`` lines before the end; with ``follow``, until the deployment stops (no read
        timeout)."""
        path = f"/admin/deployments/{_segment(deployment_id)}/logs"
        params = {"tail": tail, "follow": follow}
        try:
            with self._client.stream(
                "GET", path, params=params, timeout=httpx.Timeout(10.0, read=None)
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise error_from_response(response)
                yield response.iter_bytes()
        except httpx.TransportError as exc:
            raise self._not_running() from exc

    # -- keys ----------------------------------------------------------------------------------
    def keys(self) -> list[ApiKey]:
        """``GET /admin/keys`` (prefixes only; secrets are never stored)."""
        return self.call("GET", "/admin/keys", _KEYS)

    def create_key(self, body: KeyIn) -> CreatedApiKey:
        """``POST /admin/keys``: the new key with its secret, shown this once."""
        return self.call("POST", "/admin/keys", TypeAdapter(CreatedApiKey), body=body)

    def change_key(self, ident: str, body: KeyChangeIn) -> ApiKey:
        """``PATCH /admin/keys/{name or id}``: tier, limits, expiry."""
        path = f"/admin/keys/{_segment(ident)}"
        return self.call("PATCH", path, TypeAdapter(ApiKey), body=body)

    def revoke_key(self, ident: str) -> ApiKey:
        """``DELETE /admin/keys/{name or id}``."""
        return self.call("DELETE", f"/admin/keys/{_segment(ident)}", TypeAdapter(ApiKey))

    # -- usage ---------------------------------------------------------------------------------
    def usage(
        self,
        *,
        since: str,
        by: UsageGrouping,
        key: str | None = None,
        model: str | None = None,
    ) -> UsageReport:
        """``GET /admin/usage``: the usage ledger summed ``by`` day, key, model or node."""
        params: dict[str, str] = {"since": since, "by": by}
        if key is not None:
            params["key"] = key
        if model is not None:
            params["model"] = model
        return self.call("GET", "/admin/usage", TypeAdapter(UsageReport), params=params)

    # -- nodes ---------------------------------------------------------------------------------
    def enroll_node(self, body: EnrollIn) -> EnrollmentIssued:
        """``POST /admin/nodes/enroll``: a single-use enrollment URI."""
        return self.call("POST", "/admin/nodes/enroll", TypeAdapter(EnrollmentIssued), body=body)

    def nodes(self) -> list[NodeSummary]:
        """``GET /admin/nodes``."""
        return self.call("GET", "/admin/nodes", _NODES)

    def node(self, ident: str) -> NodeDetailWithAdopted:
        """``GET /admin/nodes/{id-or-label}``."""
        path = f"/admin/nodes/{_segment(ident)}"
        return self.call("GET", path, TypeAdapter(NodeDetailWithAdopted))

    def remove_node(self, ident: str) -> NodeDetail:
        """``DELETE /admin/nodes/{id-or-label}``: the node as removed."""
        return self.call("DELETE", f"/admin/nodes/{_segment(ident)}", TypeAdapter(NodeDetail))

    def cordon_node(self, ident: str) -> NodeMaintenance:
        """``POST /admin/nodes/{id-or-label}/cordon``."""
        path = f"/admin/nodes/{_segment(ident)}/cordon"
        return self.call("POST", path, TypeAdapter(NodeMaintenance))

    def uncordon_node(self, ident: str) -> Uncordoned:
        """``DELETE /admin/nodes/{id-or-label}/cordon``."""
        path = f"/admin/nodes/{_segment(ident)}/cordon"
        return self.call("DELETE", path, TypeAdapter(Uncordoned))

    def drain_node(self, ident: str, body: DrainIn) -> NodeMaintenance:
        """``POST /admin/nodes/{id-or-label}/drain``."""
        path = f"/admin/nodes/{_segment(ident)}/drain"
        return self.call("POST", path, TypeAdapter(NodeMaintenance), body=body)

    # -- the cluster CA ------------------------------------------------------------------------
    def ca_status(self) -> CaStatus:
        """``GET /admin/ca``."""
        return self.call("GET", "/admin/ca", TypeAdapter(CaStatus))

    def rotate_ca(self) -> CaStatus:
        """``POST /admin/ca/rotate``: a new CA issues leaves from now on."""
        return self.call("POST", "/admin/ca/rotate", TypeAdapter(CaStatus))

    def retire_ca(self, body: RetireIn) -> CaStatus:
        """``POST /admin/ca/retire``: the old root is no longer trusted."""
        return self.call("POST", "/admin/ca/retire", TypeAdapter(CaStatus), body=body)

    # -- routing and metrics -------------------------------------------------------------------
    def explain_routing(self, model: str, *, session: str | None = None) -> RoutingExplanation:
        """``GET /admin/routing/{model}[?session=ID]``."""
        path = f"/admin/routing/{_segment(model, safe='/:')}"
        params = {"session": session} if session else {}
        return self.call("GET", path, TypeAdapter(RoutingExplanation), params=params)

    def metrics_snapshot(self) -> MetricsSnapshot:
        """``GET /admin/metrics/snapshot``: every node's load over the last minute."""
        return self.call("GET", "/admin/metrics/snapshot", TypeAdapter(MetricsSnapshot))

    def plan(self, body: PlanIn) -> Plan:
        """``POST /admin/plan``: where a deployment would go and why (nothing changes)."""
        return self.call("POST", "/admin/plan", TypeAdapter(Plan), body=body)

    # -- services and routes -------------------------------------------------------------------
    def services(self) -> list[Service]:
        """``GET /admin/services``."""
        return self.call("GET", "/admin/services", _SERVICES)

    def create_service(self, body: ServiceIn) -> Service:
        """``POST /admin/services``."""
        return self.call("POST", "/admin/services", TypeAdapter(Service), body=body)

    def service(self, name: str) -> ServiceDetail:
        """``GET /admin/services/{name}``: with its active deployments."""
        path = f"/admin/services/{_segment(name, safe='/:')}"
        return self.call("GET", path, TypeAdapter(ServiceDetail))

    def scale_service(self, name: str, body: ScaleIn) -> ServiceDetail:
        """``PATCH /admin/services/{name}``: new scaling settings; the service as it is now."""
        path = f"/admin/services/{_segment(name, safe='/:')}"
        return self.call("PATCH", path, TypeAdapter(ServiceDetail), body=body)

    def remove_service(self, name: str) -> Service:
        """``DELETE /admin/services/{name}``."""
        path = f"/admin/services/{_segment(name, safe='/:')}"
        return self.call("DELETE", path, TypeAdapter(Service))

    def deploy_service(self, name: str, body: DeployIn) -> Deployment:
        """``POST /admin/services/{name}/deploy``: the new deployment, pending."""
        path = f"/admin/services/{_segment(name, safe='/:')}/deploy"
        return self.call("POST", path, TypeAdapter(Deployment), body=body)

    def routes(self) -> list[Route]:
        """``GET /admin/routes``."""
        return self.call("GET", "/admin/routes", _ROUTES)

    def add_route(self, body: RouteIn) -> Route:
        """``POST /admin/routes``: the route with the service added."""
        return self.call("POST", "/admin/routes", TypeAdapter(Route), body=body)

    def route(self, name: str) -> Route:
        """``GET /admin/routes/{name}``."""
        return self.call("GET", f"/admin/routes/{_segment(name, safe='/:')}", TypeAdapter(Route))

    def set_route_fallback(self, name: str, body: FallbackIn) -> Route:
        """``PATCH /admin/routes/{name}``."""
        path = f"/admin/routes/{_segment(name, safe='/:')}"
        return self.call("PATCH", path, TypeAdapter(Route), body=body)

    def remove_route(self, name: str, *, service: str | None = None) -> RouteRemoved:
        """``DELETE /admin/routes/{name}[?service=S]``: one service, or the whole route."""
        path = f"/admin/routes/{_segment(name, safe='/:')}"
        params = {"service": service} if service else {}
        return self.call("DELETE", path, TypeAdapter(RouteRemoved), params=params)

    # -- the one request path ------------------------------------------------------------------
    def call(
        self,
        method: str,
        path: str,
        answer: TypeAdapter[_T],
        *,
        body: BaseModel | None = None,
        params: _Params | None = None,
    ) -> _T:
        """Send one admin call with ``body`` as JSON and decode the answer with ``answer``.

        Raises :class:`DaemonError` when no daemon answers or the answer does not decode,
        and the error of :func:`error_from_response` for an error status.
        """
        # Only the fields the body was given: a field left out of a change (PATCH) means "as
        # it is", which a default written out would not say.
        content = None if body is None else body.model_dump_json(exclude_unset=True).encode()
        headers = {} if content is None else {"content-type": "application/json"}
        try:
            response = self._client.request(
                method, path, content=content, headers=headers, params=params
            )
        except httpx.TransportError as exc:
            raise self._not_running() from exc
        if response.status_code >= 400:
            raise error_from_response(response)
        try:
            return answer.validate_json(response.content)
        except ValidationError as exc:
            message, _ = describe_invalid(exc.errors()[0])
            raise DaemonError(
                f"the daemon's answer to {method} {path} is not what this berth expects "
                f"({message}); is the daemon another berth version?"
            ) from None

    def _not_running(self) -> DaemonError:
        command = "berth daemon start"
        if self.home.root != resolve_home():
            command = f"berth --home {self.home.root} daemon start"
        return DaemonError(
            f"berth daemon is not running (no answer on {self.home.socket_file}); "
            f"start it with: {command}"
        )


def error_from_response(response: httpx.Response) -> BerthError:
    """The berth error an admin API error answer stands for, carrying the daemon's message.

    400/413/422 → :class:`ConfigError`, 401/403 → :class:`AuthError`, 404 →
    :class:`NotFoundError` (its kind from a ``<kind>_not_found`` code), 409 →
    :class:`ConflictError`, 429 → :class:`RateLimitError` (``Retry-After``), an
    ``engine_error`` → :class:`EngineError`, anything else a plain :class:`BerthError`.
    Each keeps the answer's status as ``http_status``; the exit code is the type's (2 for
    input the daemon refused, 1 otherwise).
    """
    status = response.status_code
    try:
        detail = ErrorBody.model_validate_json(response.content).error
        message, kind, code = detail.message, detail.type, detail.code
    except ValidationError:
        message, kind, code = (response.text or f"HTTP {status}"), "", None
    error: BerthError
    if status in (400, 413, 422):
        error = ConfigError(message)
    elif status in (401, 403):
        error = AuthError(message, status=status)
    elif status == 404:
        what = code.removesuffix("_not_found") if code and code.endswith("_not_found") else ""
        error = NotFoundError(what or "resource", response.url.path, message=message)
    elif status == 409:
        error = ConflictError(message)
    elif status == 429:
        retry_after = response.headers.get("retry-after", "")
        retry_after_s = float(retry_after) if retry_after.isdigit() else 0.0
        error = RateLimitError(message, retry_after_s=retry_after_s)
    elif kind == "engine_error":
        error = EngineError(message)
    else:
        error = BerthError(message)
    error.http_status = status
    return error
