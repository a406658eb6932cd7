"""Fixtures shared by the test modules; the helpers they are built on live in ``support/``.

- ``db_url``, ``store``: a migrated SQLite store in the test's folder, with the local node
  (mark ``store_models`` adds models to it); a module marked ``store_engines`` runs each
  test using them twice, on SQLite and on a fresh database of ``postgres_server``, a real
  PostgreSQL server the session starts (``support/postgres.py``; skipped with the reason
  where its binaries are missing, a failure under ``CI=true``);
- ``home``: an empty, created ``BerthHome``; ``gguf``: a model file the fake engine accepts;
- ``engine``, ``metrics``, ``resolver``, ``proxy_url``, ``client``: a scripted stand-in
  engine, the OpenAI proxy in front of it on loopback, and an HTTP client for the proxy;
- ``linked``: the agent link in one process, the leader's and the agent's ends joined by an
  in-memory WebSocket pair;
- ``hub``: the Hugging Face hub stand-in, one per module;
- ``cluster``: a leader daemon on loopback with the fake engine, for one test;
- ``docker_client``, ``engine_image``: a real Docker engine and a llama-server image in it.

Mark ``needs("part", ...)`` names parts that ``scripts/setup.sh`` installs: a test whose part
is missing is skipped, or fails under ``CI=true`` (``support/installed.py``).

The suite runs in parallel (pytest-xdist) in two phases, ``--phase parallel`` and
``--phase serial``; tests sharing a module-scoped fixture share a worker
(``support/parallel.py``).

Every leader and agent the suite starts gets an agent policy that allows the tests' own
model folders and images (``support/test_policy.py``).

Processes a run leaves running (a daemon whose test was interrupted) are stopped when it
ends, and those of a run that was killed are stopped when the next starts
(``support/reaper.py``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from berth.observability.metrics import ProxyMetrics
from berth.paths import BerthHome
from berth.store import Store
from support import installed, parallel, postgres
from support.clocks import StepClock
from support.cluster_harness import Cluster, started_cluster
from support.desk_harness import loopback_tls
from support.desk_standin import ThreadedDeskStandin
from support.direct import Pki, make_pki
from support.docker_support import llama_server_image, require_docker_client
from support.hub_standin import TINY_FILES, TINY_REPOS, HubStandin
from support.link_pair import Linked, linked_in_memory
from support.proxy_fixtures import StaticResolver, running_proxy
from support.reaper import Reaper
from support.standin_engine import StandinEngine
from support.test_policy import policy_env
from support.waiting import EVENT_TIMEOUT_S

#: ``pytester`` runs pytest inside a test (``test_skip_policy.py``).
pytest_plugins = ("pytester",)


def pytest_addoption(parser: pytest.Parser) -> None:
    parallel.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    # Every leader and agent of the suite may run models from the tests' folders
    # (``support/test_policy.py``); the processes tests start inherit it.
    os.environ.update(policy_env())
    # The suite's leaders close their listeners at once when they stop (the drain_s
    # setting); the tests of the drain itself set it (test_leader_readiness.py).
    os.environ.setdefault("BERTH_DRAIN_S", "0")
    # The parallel suite's phases and worker groups (``support/parallel.py``).
    config.pluginmanager.register(parallel.Parallel(config), "support.parallel")
    # The plugin that registers and applies the ``needs`` mark (an object, not a name: the
    # module is already imported by the helpers above).
    config.pluginmanager.register(installed, "support.installed")
    # Stops the daemons, agents and engines a run leaves behind (``support/reaper.py``).
    config.pluginmanager.register(Reaper(), "support.reaper")
    config.addinivalue_line(
        "markers",
        "store_models(*models): (name, path[, size_bytes]) rows the store fixture adds; "
        "a relative path is made as a small GGUF file in the test's folder",
    )
    config.addinivalue_line(
        "markers",
        "store_engines: run each test that uses db_url (or store) on SQLite and on PostgreSQL",
    )


#: The engines a ``store_engines`` test runs on, by test id.
STORE_ENGINES = ("sqlite", "postgresql")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "db_url" in metafunc.fixturenames and metafunc.definition.get_closest_marker(
        "store_engines"
    ):
        metafunc.parametrize("db_url", STORE_ENGINES, indirect=True)


# -- state on disk -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[postgres.PostgresServer]:
    """A PostgreSQL server on loopback for the whole session (``support/postgres.py``)."""
    installed.require_installed("postgresql", postgres.missing())
    server = postgres.PostgresServer.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def db_url(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A SQLite URL in the test's folder (the file does not exist yet); in a module marked
    ``store_engines``, also the URL of a fresh, empty PostgreSQL database (dropped after)."""
    engine = getattr(request, "param", "sqlite")
    if engine == "sqlite":
        yield f"sqlite:///{tmp_path / 'state' / 'berth.db'}"
        return
    server: postgres.PostgresServer = request.getfixturevalue("postgres_server")
    url = server.create_database()
    try:
        yield url
    finally:
        server.drop_database(url)


@pytest.fixture
def store(db_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Store]:
    """A migrated store at ``db_url`` with the local node, on a :class:`StepClock`.

    Mark ``store_models(("tiny", "/models/tiny.gguf"), ...)`` on a module or test adds those
    models; a relative path is created under ``tmp_path`` (``b"GGUF"``) and registered by its
    absolute path, for code that checks the model exists.
    """
    with Store(db_url, clock=StepClock()) as store:
        store.migrate()
        store.ensure_local_node()
        for mark in reversed(list(request.node.iter_markers("store_models"))):
            for name, path, *size in mark.args:
                if not Path(path).is_absolute():
                    weights = tmp_path / path
                    weights.write_bytes(b"GGUF")
                    path = str(weights)
                store.add_model(name, path, size_bytes=size[0] if size else 0)
        yield store


@pytest.fixture
def home(tmp_path: Path) -> BerthHome:
    """An empty ``BerthHome`` at ``tmp_path / "home"``, created."""
    home = BerthHome(tmp_path / "home")
    home.ensure()
    return home


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    """``tmp_path / "tiny.gguf"``: a file the fake engine accepts as a model (it never reads
    it) and berth's checks take for a GGUF file."""
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


# -- the proxy in front of a stand-in engine -----------------------------------------------------


@pytest.fixture
async def engine() -> AsyncIterator[StandinEngine]:
    """A scripted stand-in engine on loopback (``support/standin_engine.py``)."""
    async with StandinEngine() as standin:
        yield standin


@pytest.fixture
def metrics() -> ProxyMetrics:
    """The proxy's metrics, in a registry of their own."""
    return ProxyMetrics()


@pytest.fixture
def resolver(engine: StandinEngine) -> StaticResolver:
    """Models ``m`` and ``org/model:q4`` on ``engine``; ``warming`` known but not ready."""
    routes = {"m": engine.base_url, "org/model:q4": engine.base_url}
    return StaticResolver(routes, loading=("warming",))


@pytest.fixture
async def proxy_url(resolver: StaticResolver, metrics: ProxyMetrics) -> AsyncIterator[str]:
    """The OpenAI proxy over ``resolver``, served by berth's HTTP server on loopback (as the
    leader serves ``/v1``): its base URL."""
    async with running_proxy(resolver, metrics) as url:
        yield url


@pytest.fixture
async def client(proxy_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for the proxy at ``proxy_url``, its deadlines the suite's generous one
    (httpx's default 5 s connect timeout ran out once on loopback, four workers and other runs
    sharing two cores)."""
    async with httpx.AsyncClient(base_url=proxy_url, timeout=EVENT_TIMEOUT_S) as http:
        yield http


# -- the agent link in memory --------------------------------------------------------------------


@pytest.fixture
async def linked() -> AsyncIterator[Linked]:
    """The leader's ``RemoteLink`` to an agent service over an in-memory WebSocket pair,
    with a stand-in engine behind the agent (``support/link_pair.py``)."""
    async with linked_in_memory() as pair:
        yield pair


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A berth CA with the direct data path's identities: the leader's client certificate,
    an agent's certificate and key (``support/direct.py``)."""
    return make_pki(tmp_path)


# -- real parts ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub() -> Iterator[HubStandin]:
    """The Hugging Face hub stand-in on loopback for the module, publishing
    :data:`TINY_FILES` as each of :data:`TINY_REPOS`; ``hub.requests`` accumulates."""
    with HubStandin() as standin:
        for repo in TINY_REPOS:
            standin.add_repo(repo, TINY_FILES)
        yield standin


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A leader daemon (its own process, real TLS) with the fake engine, for one test; no
    agents yet (``cluster.add_agent``). Heartbeats are generous: what is tested is not the
    link's liveness, so a loaded machine must not drop links."""
    settings = {
        "BERTH_STOP_GRACE_S": "5",
        "BERTH_HEARTBEAT_INTERVAL_S": "1",
        "BERTH_NODE_TIMEOUT_S": "30",
    }
    with started_cluster(tmp_path, settings) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A docker SDK client of a Docker engine that answers (``support/docker_support.py``)."""
    client = require_docker_client()
    yield client
    client.close()


@pytest.fixture(scope="session")
def engine_image(docker_client: Any) -> str:
    """The tag of a local image running this machine's llama-server (built when missing)."""
    return llama_server_image(docker_client)


@pytest.fixture(scope="module")
def tls_desk(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ThreadedDeskStandin, Path]]:
    """A stand-in ow desk on 127.0.0.1 over real TLS for one test module, in a thread, and the
    CA file that verifies its certificate (for ``SSL_CERT_FILE``)."""
    server_tls, ca_file = loopback_tls(tmp_path_factory.mktemp("desk-tls"))
    with ThreadedDeskStandin(tls=server_tls) as standin:
        yield standin, ca_file
