"""The proxy's request stages one by one, in process: the request value and its parser, the
admission stage, the usage rewriter, the routing stage (with its on-demand hold and the
Messages filter), the fair-queue slot, the per-engine body rewriter, the attempt stage and
the records, and the relay path an answer takes (:mod:`berth.gateway.request`,
:mod:`berth.gateway.stages`, :mod:`berth.gateway.attempt`, :mod:`berth.gateway.record`,
:mod:`berth.gateway.refusals`, :func:`berth.gateway.relay.relay_path`).

The stages get real collaborators (an :class:`Admission`, a :class:`Router` over a fixed
resolver, a :class:`SlotGate`, a :class:`RequestLog`); the engine behind an attempt is a
stand-in opener, since what an attempt does with a real one is the proxy tests' subject.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import pytest

from berth.admission import (
    Admission,
    ManualClock,
    QuotaExceededError,
    SlotGate,
    SocketCaller,
    UsageLedger,
)
from berth.config import TierTable
from berth.engine_http.request import EngineRequest
from berth.errors import NotFoundError
from berth.gateway import stages
from berth.gateway.attempt import Attempts, EngineBodies, StreamLimits, engine_body
from berth.gateway.outcome import Exchange
from berth.gateway.record import Flight, Records, target_of
from berth.gateway.refusals import reason, refusal_headers
from berth.gateway.relay import RelayPath, relay_path
from berth.gateway.request import PublicRequest, parse_request, read_body
from berth.gateway.stages import Routing, admit, ask_usage, take_slot
from berth.http_server.errors import ClientDisconnectedError
from berth.observability.metrics import ProxyMetrics
from berth.observability.request_log import RequestLog
from berth.routing.errors import (
    EngineUnreachableError,
    FirstByteTimeoutError,
    InvalidRequestError,
    NoReadyDeploymentError,
    RequestTooLargeError,
)
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import ApiKeyRecord, UsageRecord

CHAT = "/v1/chat/completions"
FORWARD = [(b"content-type", b"application/json"), (b"x-request-id", b"rid-1")]


def public(
    body: dict[str, Any] | bytes,
    *,
    path: str = CHAT,
    dialect: str = "",
    headers: list[tuple[bytes, bytes]] | None = None,
    key: ApiKeyRecord | SocketCaller | None = None,
    is_adapter: Callable[[str], bool] | None = None,
) -> PublicRequest:
    """A request for ``path`` whose body is ``body`` (a dict is written compactly)."""
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    return parse_request(
        raw,
        path=path,
        dialect=dialect,
        query=b"",
        request_id=b"rid-1",
        headers=headers or [],
        forward=FORWARD,
        key=key,
        key_name="tester",
        is_adapter=is_adapter,
    )


def upstream(name: str, node: str = "n1", **fields: Any) -> Upstream:
    return Upstream(f"http://127.0.0.1:9/{name}", f"d-{name}", node, "m", **fields)


class Chunks:
    """A client request whose body comes as ``chunks``; ``gone`` raises after them."""

    method = "POST"
    path = CHAT
    query = b""

    def __init__(self, chunks: Iterable[bytes], *, gone: bool = False) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks = list(chunks)
        self._gone = gone
        self.watching: Callable[[], None] | None = None

    async def read_chunk(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        if self._gone:
            raise ClientDisconnectedError("the client closed the connection")
        return b""

    def watch_disconnect(self, callback: Callable[[], None] | None) -> None:
        self.watching = callback


# -- the value and its parser -------------------------------------------------------------


def test_a_request_is_parsed_once_into_its_value() -> None:
    raw = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    request = public(raw, key=SocketCaller.CLI)
    assert request.raw is raw  # nothing rewrote it: the bytes as received
    assert request.body == json.loads(raw)
    assert (request.model, request.stream, request.received_bytes) == ("m", True, len(raw))
    assert request.key is SocketCaller.CLI and request.key_name == "tester"
    assert request.adapter is None and request.affinity_key is None
    assert not request.strip_usage


def test_the_value_names_the_adapter_its_model_is() -> None:
    request = public({"model": "m-lora"}, is_adapter=lambda name: name.endswith("-lora"))
    assert request.adapter == "m-lora"
    assert public({"model": "m"}, is_adapter=lambda name: False).adapter is None


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"[1]", "invalid_json"),
        (b'{"model": NaN}', "invalid_json"),
        (b"{", "invalid_json"),
        (b'{"messages": []}', "missing_model"),
        (b'{"model": ""}', "missing_model"),
    ],
)
def test_a_body_that_is_no_request_is_refused_400(raw: bytes, code: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        public(raw)
    assert caught.value.http_status == 400 and caught.value.error_code == code


async def test_the_body_is_read_whole_and_bounded() -> None:
    assert await read_body(Chunks([b'{"model"', b':"m"}']), None, 100) == b'{"model":"m"}'
    with pytest.raises(RequestTooLargeError):
        await read_body(Chunks([b"x" * 60, b"x" * 60]), None, 100)
    with pytest.raises(RequestTooLargeError):
        await read_body(Chunks([]), b"101", 100)  # announced too long: nothing is read
    with pytest.raises(InvalidRequestError):
        await read_body(Chunks([]), b"ten", 100)
    assert await read_body(Chunks([b"{"], gone=True), None, 100) is None  # the client left


# -- admission --------------------------------------------------------------------------------


class NoSink:
    def add_usage(self, batch: Iterable[UsageRecord]) -> int:
        return 0


def limited_key(rpm: int) -> ApiKeyRecord:
    return ApiKeyRecord(
        "k-stage",
        "stage",
        "standard",
        "sk-berth-stage",
        datetime(2025, 1, 1, tzinfo=UTC),
        None,
        LimitOverrides(rpm=rpm),
    )


def test_the_admission_stage_admits_then_refuses_past_the_keys_limit() -> None:
    admission = Admission(TierTable(), UsageLedger(NoSink()), clock=ManualClock())
    request = public({"model": "m"}, key=limited_key(rpm=1))
    ticket = admit(admission, request)
    assert ticket.key_id == "k-stage"
    with pytest.raises(QuotaExceededError) as caught:
        admit(admission, request)
    headers = dict(refusal_headers(caught.value, None))
    assert reason(caught.value) == caught.value.error_code
    assert int(headers[b"retry-after-ms"]) >= 0  # the OpenAI SDKs' own header


# -- the usage rewriter -----------------------------------------------------------------------


def test_a_stream_that_did_not_ask_for_usage_asks_for_it() -> None:
    request = public(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    body = request.body
    asked = ask_usage(request)
    assert asked.strip_usage
    assert asked.body == {**body, "stream_options": {"include_usage": True}}
    assert json.loads(asked.raw) == asked.body  # the bytes are the body's, always
    assert request.body is body and "stream_options" not in body  # nothing changed in place
    assert asked.received_bytes == request.received_bytes  # what the client sent


def test_a_stream_with_its_own_options_keeps_them_and_asks_for_usage() -> None:
    request = public({"model": "m", "stream": True, "stream_options": {"x": 1}, "n": 2})
    asked = ask_usage(request)
    assert asked.body == {"model": "m", "stream": True,
                          "stream_options": {"x": 1, "include_usage": True}, "n": 2}  # fmt: skip
    assert list(asked.body) == list(request.body)  # every field keeps its place
    assert json.loads(asked.raw) == asked.body


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, CHAT),  # not a stream
        ({"model": "m", "stream": True, "stream_options": {"include_usage": True}}, CHAT),
        ({"model": "m", "stream": True, "input": "x"}, "/v1/embeddings"),
    ],
)
def test_a_request_that_needs_no_usage_asked_is_left_as_it_is(
    body: dict[str, Any], path: str
) -> None:
    request = public(body, path=path)
    assert ask_usage(request) is request


# -- routing ----------------------------------------------------------------------------------


class Table:
    """A resolver of ``routes`` (model -> its upstreams); ``loading`` has none ready yet."""

    def __init__(self, routes: dict[str, list[Upstream]], loading: set[str] | None = None):
        self.routes = routes
        self.loading = loading or set()

    def candidates(self, model: str) -> list[Upstream]:
        if model in self.loading:
            raise NoReadyDeploymentError(model, retry_after_s=1.0, detail="loading")
        if model not in self.routes:
            raise NotFoundError("model", model)
        return list(self.routes[model])

    def models(self) -> list[str]:
        return sorted(self.routes)


class Loads:
    """A stand-in on-demand stage: the service of each model loads the first time it is
    waited for (``loaded`` says which were); ``hang`` makes the wait last."""

    def __init__(self, table: Table, *, hang: bool = False) -> None:
        self.table = table
        self.hang = hang
        self.loaded: list[str] = []

    async def until_ready(self, model: str, plan: Callable[[], Any]) -> Any:
        if self.hang:
            await asyncio.Event().wait()
        self.table.loading.discard(model)
        self.loaded.append(model)
        return plan()


async def test_one_candidate_is_planned_without_an_affinity_key() -> None:
    only = upstream("a")
    routing = Routing(Router(Table({"m": [only]})), None)
    request = public({"model": "m"}, headers=[(b"x-session-id", b"s1")])
    routed = await routing.route(request, Chunks([]))
    assert routed == (request, [only])


async def test_a_choice_is_planned_with_the_sessions_affinity_key() -> None:
    both = [upstream("a", "n1"), upstream("b", "n2")]
    routing = Routing(Router(Table({"m": both})), None)
    request = public({"model": "m"}, headers=[(b"x-session-id", b"s1")])
    routed = await routing.route(request, Chunks([]))
    assert routed is not None
    planned, plan = routed
    assert planned.affinity_key == "session:s1" and planned.body is request.body
    assert sorted(u.deployment_id for u in plan) == ["d-a", "d-b"]


async def test_nothing_ready_is_held_by_the_on_demand_stage_then_planned() -> None:
    table = Table({"m": [upstream("a")]}, loading={"m"})
    request = public({"model": "m"})
    with pytest.raises(NoReadyDeploymentError):
        await Routing(Router(table), None).route(request, Chunks([]))
    loads = Loads(table)
    routed = await Routing(Router(table), loads).route(request, Chunks([]))  # type: ignore[arg-type]
    assert loads.loaded == ["m"]
    assert routed is not None and [u.deployment_id for u in routed[1]] == ["d-a"]


async def test_a_client_that_leaves_while_its_service_loads_is_let_go() -> None:
    table = Table({"m": [upstream("a")]}, loading={"m"})
    client = Chunks([])
    routing = Routing(Router(table), Loads(table, hang=True))  # type: ignore[arg-type]
    task = asyncio.create_task(routing.route(public({"model": "m"}), client))
    while client.watching is None:
        await asyncio.sleep(0)
    client.watching()  # the client leaves
    assert await task is None
    assert client.watching is None  # the stage stopped watching


async def test_a_messages_request_is_planned_to_the_engines_that_serve_its_path() -> None:
    plan = [upstream("s", engine="sglang"), upstream("l", "n2", engine="llamacpp")]
    routing = Routing(Router(Table({"m": plan, "sg": plan[:1]})), None)
    ask = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    request = public(ask, path="/v1/messages", dialect="messages")
    routed = await routing.route(request, Chunks([]))
    assert routed is not None and [u.deployment_id for u in routed[1]] == ["d-l"]
    assert routed[0].engine_path is None and routed[0].raw == request.raw  # passed through
    # no engine serves it: translated to a chat completion for them all
    only_sglang = public({**ask, "model": "sg"}, path="/v1/messages", dialect="messages")
    routed = await routing.route(only_sglang, Chunks([]))
    assert routed is not None and [u.deployment_id for u in routed[1]] == ["d-s"]
    translated = routed[0]
    assert (translated.path, translated.engine_path) == ("/v1/messages", "/v1/chat/completions")
    assert (
        json.loads(translated.raw)
        == translated.body
        == {
            "model": "sg",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    # a token count is not translated
    counting = public({"model": "sg"}, path="/v1/messages/count_tokens", dialect="count_tokens")
    with pytest.raises(InvalidRequestError) as caught:
        await routing.route(counting, Chunks([]))
    assert caught.value.error_code == "path_not_served"


# -- the fair queue's slot --------------------------------------------------------------------


async def test_a_free_slot_is_taken_at_once_and_its_deployment_goes_first() -> None:
    gate = SlotGate(max_waiting=10, timeout_s=60)
    plan = [upstream("a", slots=1), upstream("b", "n2", slots=1)]
    request = public({"model": "m"})
    held, first = await take_slot(gate, request, None, plan)
    assert held == "d-a" and first == plan
    held, second = await take_slot(gate, request, None, plan)  # a's one slot is taken
    assert held == "d-b" and [u.deployment_id for u in second] == ["d-b", "d-a"]


async def test_unknown_slots_hold_nothing() -> None:
    plan = [upstream("a")]
    assert await take_slot(SlotGate(), public({"model": "m"}), None, plan) == (None, plan)


async def test_a_slot_taken_is_given_back_when_the_stage_fails_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The slot is free at the plan's second deployment; putting it first fails (a bug).
    gate = SlotGate(max_waiting=10, timeout_s=60)
    plan = [upstream("a", slots=0), upstream("b", "n2", slots=1)]

    def broken(plan: list[Upstream], deployment_id: str) -> list[Upstream]:
        raise RuntimeError("reordering failed")

    monkeypatch.setattr(stages, "first", broken)
    with pytest.raises(RuntimeError):
        await take_slot(gate, public({"model": "m"}), None, plan)
    assert gate.scheduler.in_use("d-b") == 0


# -- the per-engine body rewriter -------------------------------------------------------------


def test_an_engine_that_serves_the_name_gets_the_bytes_as_they_are() -> None:
    request = public({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert EngineBodies(request).get(upstream("a")) is request.raw


def test_an_engine_with_its_own_name_gets_it_written_in_its_place() -> None:
    raw = '{"model": "m", "messages": [{"role": "user", "content": "é"}], "n": 1}'.encode()
    request = public(raw)
    bodies = EngineBodies(request)
    named = bodies.get(upstream("a", engine_model="org/m"))
    # Compact, not ASCII-escaped, every other field kept in its place.
    assert named == '{"model":"org/m","messages":[{"role":"user","content":"é"}],"n":1}'.encode()
    assert bodies.get(upstream("b", engine_model="org/m")) is named  # written once per name
    assert request.body["model"] == "m"  # the parsed body is never changed


def test_llamacpp_with_adapters_gets_each_adapters_scale() -> None:
    request = public(
        {
            "model": "m-lora",
            "lora": [{"id": 0, "scale": 9}],
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    body = json.loads(EngineBodies(request).get(upstream("a", lora_scales=(0.0, 1.0))))
    assert body["model"] == "m-lora"
    assert body["lora"] == [
        {"id": 0, "scale": 0.0},
        {"id": 1, "scale": 1.0},
    ]  # the client's replaced
    assert list(body) == ["model", "lora", "messages"]
    assert json.loads(engine_body(request.body, "base", (1.0,)))["model"] == "base"


# -- the attempt stage ------------------------------------------------------------------------


class Answer:
    """An engine's answer as far as an attempt looks at it."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.closed = False

    def header(self, name: bytes) -> bytes | None:
        return b"application/json" if name == b"content-type" else None

    def close(self) -> None:
        self.closed = True


class Opener:
    """A stand-in engine client: answers with ``answers`` in turn (an exception is raised;
    ``None`` never answers); ``sent`` keeps what each attempt sent."""

    def __init__(self, *answers: Answer | Exception | None) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[Upstream, EngineRequest]] = []

    async def __call__(self, target: Upstream, request: EngineRequest) -> Any:
        self.sent.append((target, request))
        answer = self.answers.pop(0)
        if answer is None:
            await asyncio.Event().wait()
        if isinstance(answer, Exception):
            raise answer
        return answer


LIMITS = StreamLimits(first_byte_timeout_s=None, stream_idle_timeout_s=None)


async def test_an_attempt_sends_the_engine_request_and_records_how_it_ended() -> None:
    a, b = upstream("a"), upstream("b", engine_model="org/m")
    request = public({"model": "m"})
    down = EngineUnreachableError(a, "could not be reached")
    opener = Opener(down, Answer(200))
    attempts = Attempts(request, opener, LIMITS, Exchange(0.0))
    with pytest.raises(EngineUnreachableError):
        await attempts(a)
    answer = await attempts(b)
    assert answer.status == 200
    assert attempts.outcomes == [(a, "engine_unreachable"), (b, "status 200")]
    sent_a, sent_b = (sent for _, sent in opener.sent)
    assert sent_a == EngineRequest(CHAT, b"", FORWARD, request.raw)
    assert json.loads(sent_b.body)["model"] == "org/m" and sent_b.path == CHAT
    assert attempts.engine_request(b) == sent_b


def test_a_translated_request_is_sent_to_the_path_it_was_translated_to() -> None:
    request = public({"model": "m", "max_tokens": 8}, path="/v1/messages", dialect="messages")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    translated = request._replace(body=chat, raw=json.dumps(chat).encode(), engine_path=CHAT)
    sent = Attempts(translated, Opener(), LIMITS, Exchange(0.0)).engine_request(upstream("a"))
    assert (sent.path, sent.body) == (CHAT, translated.raw)
    assert translated.path == "/v1/messages"  # the client's, for the shape of its answers


async def test_a_stream_whose_first_byte_does_not_come_is_closed_and_moves_on() -> None:
    request = public({"model": "m", "stream": True})
    limits = StreamLimits(first_byte_timeout_s=0.05, stream_idle_timeout_s=None)
    attempts = Attempts(request, Opener(None), limits, Exchange(0.0))
    with pytest.raises(FirstByteTimeoutError):
        await attempts(upstream("a"))
    assert attempts.outcomes == [(upstream("a"), "first_byte_timeout")]


class Answering:
    """A deployment's answer count (``StreamLimits.answers``) that grows by one every
    ``every_s`` seconds for ``for_s`` seconds (as a busy engine begins others' answers)."""

    def __init__(self, every_s: float, for_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._begun = self._loop.time()
        self._every_s = every_s
        self._for_s = for_s

    def __call__(self, deployment_id: str) -> int:
        elapsed = min(self._loop.time() - self._begun, self._for_s)
        return int(elapsed // self._every_s)


class Late:
    """An engine client whose answer comes after ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def __call__(self, target: Upstream, request: EngineRequest) -> Any:
        await asyncio.sleep(self.delay_s)
        return Answer()


async def test_a_stream_queued_behind_others_waits_past_the_first_byte_timeout() -> None:
    # The engine begins other answers all along: this request waits its turn, not retried.
    answers = Answering(every_s=0.02, for_s=1.0)
    limits = StreamLimits(first_byte_timeout_s=0.1, stream_idle_timeout_s=None, answers=answers)
    attempts = Attempts(public({"model": "m", "stream": True}), Late(0.35), limits, Exchange(0.0))
    answer = await attempts(upstream("a"))
    assert answer.status == 200 and attempts.outcomes == [(upstream("a"), "status 200")]


async def test_a_stream_times_out_once_its_engine_answers_nobody_for_a_whole_period() -> None:
    # Busy for the first period, then silent for everyone: a hang, after two periods.
    answers = Answering(every_s=0.02, for_s=0.05)
    limits = StreamLimits(first_byte_timeout_s=0.1, stream_idle_timeout_s=None, answers=answers)
    attempts = Attempts(public({"model": "m", "stream": True}), Opener(None), limits, Exchange(0.0))
    begun = asyncio.get_running_loop().time()
    with pytest.raises(FirstByteTimeoutError):
        await attempts(upstream("a"))
    assert asyncio.get_running_loop().time() - begun >= 0.2
    assert attempts.outcomes == [(upstream("a"), "first_byte_timeout")]


async def test_an_attempt_cancelled_while_it_waits_says_whether_the_client_left() -> None:
    exchange = Exchange(0.0)
    attempts = Attempts(public({"model": "m"}), Opener(None, None), LIMITS, exchange)
    for gone, outcome in ((False, "given_up"), (True, "client_disconnected")):
        exchange.client_gone = gone
        task = asyncio.create_task(attempts(upstream("a")))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert attempts.outcomes[-1][1] == outcome


# -- the records ------------------------------------------------------------------------------


def test_a_finished_request_is_logged_with_its_retries_and_node() -> None:
    log = RequestLog()
    metrics = ProxyMetrics()
    records = Records(metrics, log, None, clock=lambda: 2.0)
    a, b = upstream("a", "n1"), upstream("b", "n2")
    metrics.request_started(target_of(b))  # as the proxy does once it is planned
    exchange = Exchange(0.5)
    exchange.status = 200
    flight = Flight(b, reached=True)
    records.finished(
        public({"model": "m"}), flight, exchange, [(a, "status 503"), (b, "status 200")], None, 0.0
    )
    (entry,) = log.after()
    assert (entry.model, entry.node_id, entry.deployment_id, entry.status) == (
        "m",
        "n2",
        "d-b",
        200,
    )
    assert entry.retries == ("status 503",) and entry.duration_ms == 1500
    records.unsent(0.0, 1.0, b"rid-2", "tester", "x" * 500, 429, "rate_limited")
    refused = log.after(entry.seq)[0]
    assert refused.status == 429 and len(refused.model) == 200  # a client may send anything


# -- the relay path ---------------------------------------------------------------------------


class Pulled:
    """An answer read chunk by chunk only (as the read-ahead buffer is)."""

    headers: list[tuple[bytes, bytes]] = []  # noqa: RUF012 - the protocol's class member

    def __init__(self, status: int = 200, content_length: int | None = None) -> None:
        self.status = status
        self.content_length = content_length

    def header(self, name: bytes) -> bytes | None:
        return None

    @property
    def at_eof(self) -> bool:
        return False

    async def read_chunk(self) -> bytes:
        return b""

    async def read(self, limit_bytes: int | None = None) -> bytes:
        return b""

    def close(self) -> None:
        pass


class Pushed(Pulled):
    """An answer that can push its body (a local engine's, or a tunneled one)."""

    def push_body(self, sink: Any) -> None:
        pass

    def pause_body(self) -> None:
        pass

    def resume_body(self) -> None:
        pass


class Buffering:
    """A writer whose writes wait only while the client is slow."""

    buffers_writes = True

    async def start(self, status: int, headers: Any) -> None:
        pass

    async def write(self, data: bytes) -> None:
        pass

    async def end(self, data: bytes = b"") -> None:
        pass


class Waiting(Buffering):
    """A writer that waits on every write (as ASGI's)."""

    buffers_writes = False


class Pushing(Buffering):
    """A writer that can also be written without waiting (berth's own server's)."""

    write_paused = False

    def write_now(self, data: bytes) -> None:
        pass

    def end_now(self, data: bytes = b"") -> None:
        pass

    async def drain(self) -> None:
        pass


@pytest.mark.parametrize(
    ("answer", "writer", "streamed", "path"),
    [
        (Pushed(), Pushing(), True, RelayPath.PUSH),  # a stream to berth's own server
        (Pulled(), Pushing(), True, RelayPath.PULL),  # an answer that cannot push
        (Pushed(), Buffering(), True, RelayPath.PULL),  # a writer that cannot be pushed to
        (Pushed(), Pushing(), False, RelayPath.PULL),  # JSON is read, never pushed
        (Pushed(), Waiting(), True, RelayPath.READ_AHEAD),  # ASGI: read ahead of the client
        (Pushed(content_length=2 << 20), Waiting(), False, RelayPath.READ_AHEAD),  # long
        (Pushed(content_length=100), Waiting(), False, RelayPath.PULL),  # short: read whole
        (Pushed(status=503), Waiting(), True, RelayPath.PULL),  # an engine error: read whole
        (Pushed(status=500), Pushing(), True, RelayPath.PULL),
    ],
)
def test_each_answer_goes_one_relay_path_decided_once(
    answer: Pulled, writer: Buffering, streamed: bool, path: RelayPath
) -> None:
    decided = relay_path(answer, writer, streamed=streamed, max_buffered_bytes=1 << 20)  # type: ignore[arg-type]
    assert decided is path
