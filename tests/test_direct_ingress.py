"""The agent's direct ingress on loopback with real TLS: only the leader's certificate gets
in, and what gets in is relayed like a tunneled exchange (same bounds, same failures)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from berth.cluster.pki.direct_tls import ensure_leader_certificate
from berth.cluster.protocol.direct import RESET_HEADER, deployment_target
from berth.cluster.protocol.ops import IngressArgs
from berth.engine_http.errors import UpstreamDisconnectError, UpstreamError
from berth.engine_http.pool import UpstreamPool
from berth.engine_http.response import UpstreamResponse
from berth.errors import AuthError
from support.direct import (
    DEPLOYMENT,
    Ingress,
    Pki,
    running_ingress,
    stranger_leader_certificate,
)
from support.standin_engine import Die, Head, Reply, Stall, Write, chat_chunks, sse_reply

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
CHAT = b"/v1/chat/completions"


async def _post(
    pool: UpstreamPool,
    side: Ingress,
    body: bytes = BODY,
    *,
    deployment: str = DEPLOYMENT,
    path: bytes = CHAT,
) -> UpstreamResponse:
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"r-1")]
    target = deployment_target(deployment, path)
    return await pool.request(side.origin, b"POST", target, headers, body)


async def test_the_leaders_request_reaches_the_engine_and_its_answer_comes_back(pki: Pki) -> None:
    async with running_ingress(pki) as side:
        pool = pki.pool()
        try:
            response = await _post(pool, side)
            answer = json.loads(await response.read())
            response.close()
        finally:
            await pool.close()
    assert response.status == 200
    assert answer["choices"][0]["message"]["content"] == "hello"
    (seen,) = side.engine.requests
    assert (seen.method, seen.path, seen.body) == ("POST", "/v1/chat/completions", BODY)
    # The request's own headers travel; the leader-to-agent Host does not.
    assert seen.headers["x-request-id"] == "r-1"
    assert seen.headers["host"] == f"127.0.0.1:{side.engine.port}"


async def test_the_engines_cache_signals_are_relayed_to_a_get_and_nothing_else_is(
    pki: Pki,
) -> None:
    async with running_ingress(pki) as side:
        pool = pki.pool()
        try:
            answers = {}
            for path in (b"/slots", b"/metrics", b"/v1/models"):
                target = deployment_target(DEPLOYMENT, path)
                response = await pool.request(side.origin, b"GET", target, [])
                await response.read()
                response.close()
                answers[path] = response.status
        finally:
            await pool.close()
    assert answers == {b"/slots": 200, b"/metrics": 200, b"/v1/models": 405}
    assert [(r.method, r.path) for r in side.engine.requests] == [
        ("GET", "/slots"),
        ("GET", "/metrics"),
    ]
    # the leader reading a cache signal is not a client's request
    assert side.service.meter.deployments() == []


@pytest.mark.parametrize("who", ["no certificate", "an agent's certificate", "another CA's"])
async def test_anyone_but_the_leader_is_refused_before_a_request_is_read(
    pki: Pki, tmp_path: Path, who: str
) -> None:
    cert, key = {
        "no certificate": (None, None),
        "an agent's certificate": (pki.agent_cert, pki.agent_key),
        "another CA's": stranger_leader_certificate(tmp_path),
    }[who]
    async with running_ingress(pki) as side:
        pool = pki.pool(pki.client_context(cert, key))
        try:
            with pytest.raises(UpstreamError):
                await _post(pool, side)
        finally:
            await pool.close()
    assert side.engine.requests == []


async def test_a_body_over_the_limit_is_refused_with_413(pki: Pki) -> None:
    async with running_ingress(pki, max_body_bytes=1024) as side:
        pool = pki.pool()
        try:
            response = await _post(pool, side, b'{"model": "m", "pad": "' + b"x" * 4096 + b'"}')
            error = json.loads(await response.read())["error"]
            response.close()
        finally:
            await pool.close()
    assert response.status == 413
    assert error["code"] == "request_too_large"
    assert side.engine.requests == []


async def test_relay_failures_before_the_head_carry_the_tunnels_reset_codes(pki: Pki) -> None:
    async with running_ingress(pki) as side:
        pool = pki.pool()
        try:
            unknown = await _post(pool, side, deployment="d-ffffffff")
            unknown_body = json.loads(await unknown.read())
            unknown.close()
            route = await pool.request(side.origin, b"GET", b"/v2/elsewhere", [], b"")
            route.close()
        finally:
            await pool.close()
    assert (unknown.status, unknown.header(RESET_HEADER)) == (502, b"not_found")
    assert "d-ffffffff" in unknown_body["error"]["message"]
    assert route.status == 404


async def test_exchanges_over_the_limit_are_refused_with_503(pki: Pki) -> None:
    async with running_ingress(pki, max_open_exchanges=1) as side:
        side.engine.script(Reply([Stall(30.0)]))
        pool = pki.pool()
        first = asyncio.create_task(_post(pool, side))
        try:
            await side.engine.wait_for_request(timeout_s=10.0)
            second = await _post(pool, side)
            second.close()
        finally:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await pool.close()
    assert (second.status, second.header(RESET_HEADER)) == (503, b"refused")


async def test_a_stream_is_relayed_event_by_event_and_a_leader_that_leaves_stops_the_engine(
    pki: Pki,
) -> None:
    events = chat_chunks(["one ", "two ", "three"])
    async with running_ingress(pki) as side:
        side.engine.script(sse_reply(events, pause_s=0.05), sse_reply(events, pause_s=5.0))
        pool = pki.pool()
        try:
            whole = await _post(pool, side)
            streamed = await whole.read()
            whole.close()
            left = await _post(pool, side)
            first = await left.read_chunk()
            left.close()  # the leader's client went away
            gone = side.engine.requests[1]
            await asyncio.wait_for(gone.disconnected.wait(), 10.0)
        finally:
            await pool.close()
    assert whole.status == 200 and whole.header(b"content-type") == b"text/event-stream"
    assert streamed == b"".join(events)
    assert first and not gone.completed


async def test_a_leader_that_reads_slowly_holds_the_engine_back(pki: Pki) -> None:
    chunk = b"x" * (1 << 20)
    writes = [Write(chunk) for _ in range(64)]
    async with running_ingress(pki) as side:
        side.engine.script(Reply([Head(content_type="application/octet-stream"), *writes]))
        pool = pki.pool()
        try:
            response = await _post(pool, side)
            first = await response.read_chunk()
            record = await side.engine.wait_for_request(timeout_s=10.0)
            # Room for the engine to write all 64 MiB, were nothing holding it back.
            await asyncio.sleep(1.0)
            written, done = record.bytes_written, record.completed
            rest = await response.read()
            response.close()
        finally:
            await pool.close()
    assert not done and written < 32 * len(chunk)
    assert len(first) + len(rest) == 64 * len(chunk)


async def test_an_engine_that_dies_mid_answer_breaks_the_answer_off(pki: Pki) -> None:
    async with running_ingress(pki) as side:
        side.engine.script(Reply([Head(content_type="text/event-stream"), Write(b"data: 1\n\n"),
                                  Die()]))  # fmt: skip
        pool = pki.pool()
        try:
            response = await _post(pool, side)
            with pytest.raises(UpstreamDisconnectError) as raised:
                await response.read()
            response.close()
        finally:
            await pool.close()
    assert response.status == 200
    assert raised.value.answered


async def test_certificates_not_from_the_pinned_ca_or_not_the_leaders_are_refused(
    pki: Pki, tmp_path: Path
) -> None:
    good = pki.ingress_args()
    stranger, _key = stranger_leader_certificate(tmp_path)
    bad = [
        IngressArgs(certificate=good.certificate, leader_certificate=stranger.read_text()),
        IngressArgs(certificate=good.certificate, leader_certificate=pki.agent_cert.read_text()),
        IngressArgs(
            certificate=pki.agent_cert.read_text(), leader_certificate=good.leader_certificate
        ),
    ]
    async with running_ingress(pki, configure=False) as side:
        for args in bad:
            with pytest.raises(AuthError):
                await side.ingress.configure(args)
        await side.ingress.configure(good)  # and the right ones still work


async def test_new_certificates_take_over_without_cutting_off_an_answer_in_flight(
    pki: Pki,
) -> None:
    events = chat_chunks(["word "] * 6)
    async with running_ingress(pki) as side:
        side.engine.script(sse_reply(events, pause_s=0.4))
        old_context = pki.leader_context()
        pool = pki.pool(old_context)
        try:
            streaming = await _post(pool, side)
            first = await streaming.read_chunk()
            # The leader's certificate is renewed (a new key) and the agent is told so while
            # the answer streams on a connection made with the old one.
            pki.leader_cert.unlink()
            ensure_leader_certificate(pki.ca, pki.ca_dir)
            await side.ingress.configure(pki.ingress_args())
            rest = await streaming.read()
            streaming.close()
            renewed_pool = pki.pool()
            renewed = await _post(renewed_pool, side)
            renewed_body = await renewed.read()
            renewed.close()
            await renewed_pool.close()
            stale = pki.pool(old_context)
            with pytest.raises(UpstreamError):
                await _post(stale, side)  # a new connection with the old certificate
            await stale.close()
        finally:
            await pool.close()
    assert first + rest == b"".join(events)
    assert renewed.status == 200 and json.loads(renewed_body)["object"] == "chat.completion"
