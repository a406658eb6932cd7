"""What the desk worker asks of the berth leader, over the leader's own API.

:class:`Leader` is the interface; :class:`LeaderClient` is the real one, over the leader's
Unix socket ``$BERTH_HOME/berth.sock`` as the CLI talks to it (mode 0600: reaching it proves
the caller is the owner, so no key is sent). Every request names the worker as its caller
(:data:`berth.admission.SOCKET_CALLER_HEADER`), so the leader admits its jobs under the desk
tier and counts them as ``socket:desk``. Jobs go to ``POST /v1/chat/completions``, so the
leader's router sends each to the best node of the cluster. What serves a model comes from
the admin API:

- ``GET /v1/models``: the served names (deployments and routes);
- ``GET /admin/routing/{model}``: the deployments (and nodes) the router would use;
- ``GET /admin/deployments?active=true``: each deployment's GPUs;
- ``GET /admin/nodes/{id}``: each node's GPUs (NVML: name, memory in MiB);
- ``GET /admin/metrics/snapshot``: each deployment's requests in flight and each GPU's
  memory in use, from the nodes' latest samples.

The admin API's answers are decoded with the models the leader itself answers with
(:mod:`berth.api`), so the two cannot drift apart; ``/v1`` answers with the few OpenAI
fields read here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, overload
from urllib.parse import quote

import httpx
import msgspec
from pydantic import TypeAdapter, ValidationError

from berth.admission.socket import DESK_CALLER, SOCKET_CALLER_HEADER
from berth.api import ListedDeployment, MetricsSnapshot, NodeDetailWithAdopted, RoutingExplanation
from berth.desk.errors import LeaderAnswerError, LeaderUnavailableError
from berth.desk.pulse import GpuView, ModelServing, serving_of


class Message(msgspec.Struct):
    role: str
    content: str


class ChatRequest(msgspec.Struct, omit_defaults=True):
    """The body of a job or a speed test (the protocol's "Local model server" table)."""

    model: str
    messages: list[Message]
    stream: bool  # always sent, always false (never omitted as a default)
    max_tokens: int | None = None
    temperature: float | None = None


#: The pool test's additions to a job's request.
POOL_TEST_MAX_TOKENS = 512
POOL_TEST_TEMPERATURE = 0.0
#: The speed test's request: "hi", at most 16 tokens.
SPEED_TEST_PROMPT = "hi"
SPEED_TEST_MAX_TOKENS = 16


def job_request(model: str, prompt: str, *, pool_test: bool) -> ChatRequest:
    """A job's request: the prompt as one user message, not streamed; a pool test adds
    ``max_tokens`` 512 and ``temperature`` 0."""
    request = ChatRequest(
        model=model, messages=[Message(role="user", content=prompt)], stream=False
    )
    if pool_test:
        request.max_tokens = POOL_TEST_MAX_TOKENS
        request.temperature = POOL_TEST_TEMPERATURE
    return request


def speed_test_request(model: str) -> ChatRequest:
    """The speed test's request for ``model``."""
    return ChatRequest(
        model=model,
        messages=[Message(role="user", content=SPEED_TEST_PROMPT)],
        stream=False,
        max_tokens=SPEED_TEST_MAX_TOKENS,
    )


@dataclass(frozen=True)
class ChatAnswer:
    """An engine's answer: the text and its token counts (0 where the engine gave none)."""

    output: str
    prompt_tokens: int
    completion_tokens: int


class Leader(Protocol):
    """The berth leader as the desk worker sees it."""

    async def served_models(self) -> list[str]:
        """Every name ``/v1/models`` lists, in its order (invalid desk ids included).

        Raises :class:`LeaderUnavailableError` or :class:`LeaderAnswerError`."""
        ...

    async def serving(self, models: Sequence[str]) -> dict[str, ModelServing]:
        """What serves each of ``models`` now; a model with no ready deployment is left
        out. Raises :class:`LeaderUnavailableError` or :class:`LeaderAnswerError`."""
        ...

    async def chat(self, request: ChatRequest, *, timeout_s: float) -> ChatAnswer:
        """Send ``request`` through the router; the whole exchange within ``timeout_s``.

        Raises :class:`LeaderUnavailableError`, or :class:`LeaderAnswerError` for an error
        status, a timeout or an answer without a message.
        """
        ...


# -- the OpenAI shapes read here (the admin API's come from berth.api) -----------------------


class _ModelCard(msgspec.Struct):
    id: str


class _ModelList(msgspec.Struct):
    data: list[_ModelCard]


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _AnswerMessage(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    message: _AnswerMessage


class _Completion(msgspec.Struct):
    choices: list[_Choice]
    usage: _Usage | None = None


class _OpenAIError(msgspec.Struct):
    type: str = "error"
    message: str = ""


class _ErrorBody(msgspec.Struct):
    error: _OpenAIError


_MIB = 1024 * 1024
T = TypeVar("T")
_DEPLOYMENTS = TypeAdapter(list[ListedDeployment])
_SNAPSHOT = TypeAdapter(MetricsSnapshot)
_ROUTING = TypeAdapter(RoutingExplanation)
_NODE = TypeAdapter(NodeDetailWithAdopted)


class LeaderClient:
    """The leader of one home, over its socket ``socket_path``.

    ``transport`` replaces the socket (tests). Close with :meth:`aclose` or ``async with``.
    """

    def __init__(
        self, socket_path: Path, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.socket_path = socket_path
        self._http = httpx.AsyncClient(
            # verify=False: no TLS on a Unix socket, and it skips loading a CA bundle.
            transport=transport or httpx.AsyncHTTPTransport(uds=str(socket_path), verify=False),
            base_url="http://berth",
            headers={SOCKET_CALLER_HEADER: DESK_CALLER},  # the desk tier, socket:desk
            timeout=30.0,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> LeaderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def served_models(self) -> list[str]:
        """See :meth:`Leader.served_models`."""
        listing = await self._get("/v1/models", _ModelList)
        return [card.id for card in listing.data]

    async def serving(self, models: Sequence[str]) -> dict[str, ModelServing]:
        """See :meth:`Leader.serving`."""
        listed = await self._admin("/admin/deployments?active=true", _DEPLOYMENTS)
        deployments = {d.id: d for d in listed}
        snapshot = await self._admin("/admin/metrics/snapshot", _SNAPSHOT)
        in_flight: dict[str, int] = {}
        used_mb: dict[tuple[str, int], int] = {}
        for series in snapshot.nodes:
            for load in series.latest.deployments:
                in_flight[load.deployment] = load.in_flight
            for gpu in series.latest.gpus:
                used_mb[series.node, gpu.index] = gpu.mem_used_bytes // _MIB
        nodes: dict[str, list[GpuView]] = {}
        found: dict[str, ModelServing] = {}
        for model in models:
            path = f"/admin/routing/{quote(model, safe='/:')}"
            # 404: not served (any more); 503: nothing ready for it now.
            routing = await self._admin(path, _ROUTING, absent=(404, 503))
            if routing is None or not routing.candidates:
                continue
            gpus: list[GpuView] = []
            for candidate in routing.candidates:
                if candidate.node_id not in nodes:
                    nodes[candidate.node_id] = await self._node_gpus(candidate.node_id, used_mb)
                deployment = deployments.get(candidate.deployment_id)
                wanted = set(deployment.gpus) if deployment and deployment.gpus else None
                gpus += [g for g in nodes[candidate.node_id] if wanted is None or g.index in wanted]
            found[model] = serving_of(
                model,
                slots=len(routing.candidates),
                in_flight=sum(in_flight.get(c.deployment_id, 0) for c in routing.candidates),
                gpus=gpus,
            )
        return found

    async def chat(self, request: ChatRequest, *, timeout_s: float) -> ChatAnswer:
        """See :meth:`Leader.chat`. Error messages are not kept: an engine may quote the
        prompt in one, and these errors are logged."""
        body = msgspec.json.encode(request)
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._http.post(
                    "/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=timeout_s,
                )
        except (TimeoutError, httpx.TimeoutException):
            within = f"within {timeout_s:g} s"
            raise LeaderAnswerError("chat", 0, "timeout", within) from None
        except httpx.TransportError as exc:
            raise LeaderUnavailableError(str(self.socket_path), type(exc).__name__) from None
        if response.status_code != 200:
            raise LeaderAnswerError("chat", response.status_code, _error_kind(response))
        try:
            completion = msgspec.json.decode(response.content, type=_Completion)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise LeaderAnswerError("chat", response.status_code, "malformed answer") from None
        if not completion.choices:
            raise LeaderAnswerError("chat", response.status_code, "an answer without choices")
        usage = completion.usage or _Usage()
        return ChatAnswer(
            output=completion.choices[0].message.content or "",
            prompt_tokens=max(usage.prompt_tokens or 0, 0),
            completion_tokens=max(usage.completion_tokens or 0, 0),
        )

    async def _node_gpus(self, node_id: str, used_mb: dict[tuple[str, int], int]) -> list[GpuView]:
        path = f"/admin/nodes/{quote(node_id, safe='')}"
        node = await self._admin(path, _NODE, absent=(404,))
        if node is None:
            return []
        return [
            GpuView(
                node_id=node_id,
                index=gpu.index,
                name=gpu.name,
                memory_total_mb=gpu.memory_total_mb,
                memory_used_mb=used_mb.get((node_id, gpu.index), gpu.memory_used_mb),
            )
            for gpu in node.gpus
        ]

    async def _get(self, path: str, kind: type[T]) -> T:
        response = await self._request("GET", path)
        if response.status_code != 200:
            raise LeaderAnswerError(path, response.status_code, _error_kind(response))
        try:
            return msgspec.json.decode(response.content, type=kind)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            status = response.status_code
            raise LeaderAnswerError(path, status, "malformed answer", str(exc)) from None

    @overload
    async def _admin(self, path: str, adapter: TypeAdapter[T]) -> T: ...

    @overload
    async def _admin(
        self, path: str, adapter: TypeAdapter[T], *, absent: tuple[int, ...]
    ) -> T | None: ...

    async def _admin(
        self, path: str, adapter: TypeAdapter[T], *, absent: tuple[int, ...] = ()
    ) -> T | None:
        """``GET path`` of the admin API, decoded with its own model (:mod:`berth.api`);
        ``None`` for a status in ``absent``."""
        response = await self._request("GET", path)
        if response.status_code in absent:
            return None
        if response.status_code != 200:
            raise LeaderAnswerError(path, response.status_code, _error_kind(response))
        try:
            return adapter.validate_json(response.content)
        except ValidationError as exc:
            status = response.status_code
            raise LeaderAnswerError(path, status, "malformed answer", str(exc)) from None

    async def _request(self, method: str, path: str) -> httpx.Response:
        try:
            return await self._http.request(method, path)
        except httpx.TransportError as exc:
            raise LeaderUnavailableError(str(self.socket_path), type(exc).__name__) from None


def _error_kind(response: httpx.Response) -> str:
    try:
        return msgspec.json.decode(response.content, type=_ErrorBody).error.type
    except (msgspec.ValidationError, msgspec.DecodeError):
        return "error"
