"""A real leader (``berth daemon start``, a subprocess) on real TLS: its public listener
holds flat memory against oversized heads, closes slow clients while serving others, and
answers browsers on an allowed origin (CORS) without changing anything for the rest."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from berth.runtime.engines import find_free_port

ORIGIN = "https://chat.example.com"
HEAD_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Leader:
    home: Path
    port: int
    pid: int
    key: str
    tls: ssl.SSLContext

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


def _berth(home: Path, *args: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "berth", "--home", str(home), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def bounded_leader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Leader]:
    home = tmp_path_factory.mktemp("bounded-leader")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    env.update(
        BERTH_DRAIN_S="0",  # the stop closes at once (no load balancer here)
        BERTH_HEAD_TIMEOUT_S=str(HEAD_TIMEOUT_S),
        BERTH_CORS_ORIGINS=f"{ORIGIN}, http://localhost:3000",
        BERTH_LEADER_ONLY="1",  # no engines needed here
    )
    port = find_free_port()
    _berth(
        home,
        "daemon",
        "start",
        "--public-port",
        str(port),
        "--cluster-port",
        str(find_free_port()),
        env=env,
    )
    try:
        pid = int((home / "daemon.pid").read_text().split()[0])
        key = json.loads(_berth(home, "key", "create", "bounds", "--json", env=env))["secret"]
        tls = ssl.create_default_context(cafile=str(home / "ca" / "ca.pem"))
        yield Leader(home, port, pid, key, tls)
    finally:
        subprocess.run(
            [sys.executable, "-m", "berth", "--home", str(home), "daemon", "stop"],
            capture_output=True,
            timeout=60,
            env=env,
        )


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of ``pid``, in KiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(rest.split()[0])
    return values


async def _send_huge_head(bounded_leader: Leader, size: int) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", bounded_leader.port, ssl=bounded_leader.tls, server_hostname="127.0.0.1"
    )
    writer.write(b"GET /v1/models HTTP/1.1\r\nhost: berth\r\nx-pad: ")
    piece = b"a" * (1 << 20)
    try:
        for _ in range(size // len(piece)):
            writer.write(piece)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass  # the leader stopped reading after its answer: expected
    answer = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 30):
            answer += chunk
    except (ConnectionError, ssl.SSLError):
        pass
    writer.close()
    return answer


def test_oversized_heads_get_431_and_the_leader_memory_stays_flat(bounded_leader: Leader) -> None:
    before = _status(bounded_leader.pid)["VmRSS"]

    async def four() -> list[bytes]:
        return await asyncio.gather(*(_send_huge_head(bounded_leader, 64 << 20) for _ in range(4)))

    answers = asyncio.run(four())
    after = _status(bounded_leader.pid)
    for answer in answers:
        if answer:  # a client cut off mid-send may lose the answer to the reset
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 431"), head
            assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert any(answers), "no client read the 431"
    # Before the bound, the same four heads took the leader from 127 MB to 428 MB.
    grown_mib = (after["VmHWM"] - before) / 1024
    print(f"4 x 64 MiB heads: leader RSS {before / 1024:.0f} MiB, peak {after['VmHWM'] / 1024:.0f}")
    assert grown_mib < 48, f"the leader grew {grown_mib:.0f} MiB at its peak"
    assert httpx.get(bounded_leader.url + "/healthz", verify=bounded_leader.tls).status_code == 200


def test_slow_clients_are_closed_after_the_head_timeout_while_others_are_served(
    bounded_leader: Leader,
) -> None:
    async def slow_client() -> bytes:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", bounded_leader.port, ssl=bounded_leader.tls, server_hostname="127.0.0.1"
        )
        writer.write(b"GET /v1/models HTTP/1.1\r\n")
        answer = b""
        for _ in range(100):  # one byte at a time, far slower than the head timeout allows
            read = asyncio.ensure_future(reader.read(65536))
            done, _ = await asyncio.wait([read], timeout=HEAD_TIMEOUT_S / 4)
            if done:
                answer += read.result()
                if not read.result():
                    break
                continue
            read.cancel()
            try:
                writer.write(b"x")
                await writer.drain()
            except (ConnectionError, ssl.SSLError):
                break
        writer.close()
        return answer

    async def run() -> tuple[list[bytes], list[int]]:
        slow = asyncio.gather(*(slow_client() for _ in range(50)))
        served = []
        async with httpx.AsyncClient(verify=bounded_leader.tls) as client:
            for _ in range(5):
                answer = await client.get(
                    bounded_leader.url + "/v1/models",
                    headers={"authorization": f"Bearer {bounded_leader.key}"},
                )
                served.append(answer.status_code)
                await asyncio.sleep(HEAD_TIMEOUT_S / 5)
        return await slow, served

    answers, served = asyncio.run(run())
    assert served == [200] * 5
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]


def test_a_preflight_from_an_allowed_origin_is_answered_without_a_key(
    bounded_leader: Leader,
) -> None:
    answer = httpx.options(
        bounded_leader.url + "/v1/chat/completions",
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
        verify=bounded_leader.tls,
    )
    assert answer.status_code == 204
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    assert answer.headers["access-control-allow-credentials"] == "true"
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert answer.headers["access-control-allow-headers"] == "authorization, content-type"
    assert answer.headers["vary"] == "Origin"


def test_a_preflight_from_another_origin_is_refused_as_before(bounded_leader: Leader) -> None:
    answer = httpx.options(
        bounded_leader.url + "/v1/chat/completions",
        headers={"origin": "https://evil.example.com", "access-control-request-method": "POST"},
        verify=bounded_leader.tls,
    )
    assert answer.status_code == 401
    assert not [h for h in answer.headers if h.startswith("access-control-")]


def test_requests_from_an_allowed_origin_still_need_a_key(bounded_leader: Leader) -> None:
    headers = {"origin": ORIGIN}
    refused = httpx.get(
        bounded_leader.url + "/v1/models", headers=headers, verify=bounded_leader.tls
    )
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN  # the page can read why
    headers["authorization"] = f"Bearer {bounded_leader.key}"
    served = httpx.get(
        bounded_leader.url + "/v1/models", headers=headers, verify=bounded_leader.tls
    )
    assert served.status_code == 200
    assert served.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in served.headers["access-control-expose-headers"]
    plain = httpx.get(
        bounded_leader.url + "/v1/models",
        headers={"authorization": f"Bearer {bounded_leader.key}"},
        verify=bounded_leader.tls,
    )
    assert not [h for h in plain.headers if h.startswith("access-control-")]
