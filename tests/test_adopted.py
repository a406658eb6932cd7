"""Adopted endpoints in-process: the adopted.yaml file, the rules for names, and the watcher
probing a real HTTP server (the fake llama-server) as it comes and goes."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from berth.agent.adopted import (
    AdoptedEndpoint,
    AdoptedWatcher,
    adopted_endpoint,
    fetch_model_ids,
    load_adopted,
    save_adopted,
    with_endpoint,
    without_endpoint,
)
from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.runtime.engines import find_free_port
from support.cluster_harness import FAKE_ENGINE


def _endpoint(name: str = "outside", port: int = 8000, **fields: object) -> AdoptedEndpoint:
    values: dict[str, object] = {
        "name": name,
        "host": "127.0.0.1",
        "port": port,
        "served_model_name": "smol",
        "engine_model": "smol",
    }
    values.update(fields)
    return AdoptedEndpoint(**values)  # type: ignore[arg-type]


@pytest.fixture
def outside_engine() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = find_free_port()
    process = subprocess.Popen(
        [sys.executable, str(FAKE_ENGINE), "-m", "x.gguf", "--port", str(port),
         "--alias", "smol-outside"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(100):
            try:
                fetch_model_ids("127.0.0.1", port, timeout_s=0.5)
                break
            except ConfigError:
                time.sleep(0.05)
        yield port, process
    finally:
        process.kill()
        process.wait()


def test_the_file_round_trips_and_a_missing_one_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "adopted.yaml"
    assert load_adopted(path) == []
    endpoints = [_endpoint(gpus=(0, 7), vram_mb=24000), _endpoint("second", 8001)]
    save_adopted(path, endpoints)
    assert load_adopted(path) == endpoints


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("- name: [unclosed", "malformed YAML"),
        ("name: x\n", "expected a list"),
        ("- just-a-string\n", "entry 1: not a mapping"),
        ("- {name: a, host: h, port: 1}\n", "entry 1: missing served_model_name"),
        ("- {name: a, host: h, port: 0, served_model_name: s, engine_model: s}\n", "port"),
        ("- {name: a b, host: h, port: 1, served_model_name: s, engine_model: s}\n", "name"),
        ("- {name: a, host: h, port: 1, served_model_name: s, engine_model: s, x: 1}\n",
         "unknown field(s) x"),
        ("- {name: a, host: h, port: 1, served_model_name: s, engine_model: s}\n"
         "- {name: a, host: h, port: 2, served_model_name: s, engine_model: s}\n",
         "used twice"),
    ],
)  # fmt: skip
def test_a_malformed_file_is_reported_with_its_path(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "adopted.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(problem)) as failure:
        load_adopted(path)
    assert str(path) in str(failure.value)


def test_names_and_addresses_are_unique_and_unadopting_needs_a_known_name() -> None:
    endpoints = [_endpoint()]
    with pytest.raises(ConflictError, match="already named"):
        with_endpoint(endpoints, _endpoint(port=9000))
    with pytest.raises(ConflictError, match="already adopted as 'outside'"):
        with_endpoint(endpoints, _endpoint("other"))
    assert without_endpoint(endpoints, "outside") == []
    with pytest.raises(NotFoundError):
        without_endpoint(endpoints, "nope")


def test_the_served_name_is_the_flag_or_the_servers_first_model() -> None:
    listed = ["/models/SmolLM2.gguf", "other"]
    chosen = adopted_endpoint(name=None, host="127.0.0.1", port=8080, model=None,
                              served_model_name=None, model_ids=listed)  # fmt: skip
    assert (chosen.served_model_name, chosen.engine_model) == (listed[0], listed[0])
    assert chosen.name == "models-SmolLM2.gguf"
    named = adopted_endpoint(name="big", host="127.0.0.1", port=8080, model="other",
                             served_model_name="chat", gpus=[0, 7], model_ids=listed)  # fmt: skip
    assert (named.name, named.served_model_name, named.engine_model) == ("big", "chat", "other")
    assert named.gpus == (0, 7)
    with pytest.raises(ConfigError, match="does not serve 'missing'"):
        adopted_endpoint(name=None, host="h", port=1, model="missing", served_model_name=None,
                         model_ids=listed)  # fmt: skip
    with pytest.raises(ConfigError, match="lists no model: pass --model"):
        adopted_endpoint(name=None, host="h", port=1, model=None, served_model_name=None,
                         model_ids=[])  # fmt: skip


def test_adopting_a_port_where_nothing_listens_says_so() -> None:
    port = find_free_port()
    with pytest.raises(ConfigError, match=f"nothing answers at http://127.0.0.1:{port}/v1/models"):
        fetch_model_ids("127.0.0.1", port, timeout_s=1)


async def test_the_watcher_follows_the_file_and_the_servers_liveness(
    tmp_path: Path, outside_engine: tuple[int, subprocess.Popen[bytes]]
) -> None:
    port, process = outside_engine
    path = tmp_path / "adopted.yaml"
    changes: list[list[tuple[str, bool]]] = []
    watcher = AdoptedWatcher(path, probe_interval_s=0.0)
    watcher.on_change = lambda: changes.append([(s.name, s.alive) for s in watcher.states()])
    await watcher.check_once()
    assert watcher.states() == [] and changes == []
    save_adopted(path, [_endpoint(port=port, served_model_name="smol-outside")])
    await watcher.check_once()
    assert changes[-1] == [("outside", True)]
    assert watcher.origin("adopted:outside") == ("127.0.0.1", port)
    assert watcher.origin("outside") is None and watcher.origin("adopted:nope") is None
    process.kill()
    process.wait()
    await watcher.check_once()
    assert changes[-1] == [("outside", False)]
    path.write_text("- [broken\n")  # a bad edit keeps the last good set
    await asyncio.sleep(0.01)
    await watcher.check_once()
    assert [s.name for s in watcher.states()] == ["outside"]
    save_adopted(path, [])
    await watcher.check_once()
    assert changes[-1] == []
