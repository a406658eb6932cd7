"""Adopted endpoints: OpenAI-compatible servers a host runs that berth did not start.

An operator adopts a server (``berth agent adopt``); the set lives in
``$BERTH_HOME/adopted.yaml``, so it survives restarts and can be edited while the agent (or
the leader, for its own host) runs: :class:`AdoptedWatcher` reads the file again when it
changes and probes each endpoint (``GET /v1/models``) every :data:`PROBE_INTERVAL_S` seconds.
The leader routes to an adopted endpoint while its last probe answered, never starts, stops
or evicts it, and keeps its declared GPUs out of its own placements.

The file is a YAML list of mappings, one per endpoint::

    - name: vllm-big
      host: 127.0.0.1
      port: 8000
      served_model_name: qwen-72b
      engine_model: Qwen/Qwen2.5-72B-Instruct
      gpus: [0, 1]
      vram_mb: 150000
      api_key_file: /home/me/.berth/adopted-keys/vllm-big.key

``api_key_file`` names a file holding the server's API key (its first line that is not blank
and not a ``#`` comment); every probe and request berth sends it carries the key as
``Authorization: Bearer``, in place of the client's own credentials.  ``berth agent adopt
--api-key-file PATH`` copies the key into ``$BERTH_HOME/adopted-keys/<name>.key`` (mode
0600) and names that copy here, so ``adopted.yaml`` itself holds nothing secret.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from berth.atomic import write_atomic
from berth.cluster.protocol.payloads import AdoptedState
from berth.engine_http.auth import bearer_header
from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.runtime.health import HealthProber

log = logging.getLogger(__name__)

#: Seconds between two probes of one adopted endpoint.
PROBE_INTERVAL_S = 15.0
#: Seconds one probe may take.
PROBE_TIMEOUT_S = 5.0
#: Seconds between two looks at whether ``adopted.yaml`` changed.
RELOAD_INTERVAL_S = 2.0
#: The prefix of an adopted endpoint's id where a deployment id would be (tunnel, router).
ADOPTED_ID_PREFIX = "adopted:"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


@dataclass(frozen=True)
class AdoptedEndpoint:
    """One adopted server: where it answers and what clients call it.

    ``engine_model`` is the model id the server itself serves (sent to it in each request's
    ``"model"``); ``served_model_name`` is the name clients use through berth; ``gpus`` and
    ``vram_mb`` are what it declares to use (reserved: berth places nothing else there).
    """

    name: str
    host: str
    port: int
    served_model_name: str
    engine_model: str
    gpus: tuple[int, ...] = ()
    vram_mb: int | None = None
    container: str | None = None
    api_key_file: str | None = None

    @property
    def endpoint_id(self) -> str:
        """The id the router and the tunnel use for it, where a deployment id would be."""
        return ADOPTED_ID_PREFIX + self.name

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def check_name(name: str) -> str:
    """``name`` when it is a valid endpoint name (letters, digits, ``._-``, up to 63),
    else ``ConfigError``."""
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"adopted endpoint name {name!r} must be 1-63 letters, digits, '.', '_' or '-'"
        )
    return name


def load_adopted(path: Path) -> list[AdoptedEndpoint]:
    """The endpoints in ``path`` (none when it does not exist).

    Raises ``ConfigError`` naming the file for malformed YAML, an entry that is not a
    mapping, a missing or mistyped field, an unknown field or a duplicate name.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", path=path) from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"malformed YAML: {exc}".replace("\n", " "), path=path) from None
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError("expected a list of adopted endpoints", path=path)
    endpoints: list[AdoptedEndpoint] = []
    for index, entry in enumerate(raw, start=1):
        try:
            endpoint = _endpoint_from(entry)
        except (ConfigError, TypeError, ValueError) as exc:
            raise ConfigError(f"entry {index}: {exc}", path=path) from None
        if any(e.name == endpoint.name for e in endpoints):
            raise ConfigError(f"entry {index}: name {endpoint.name!r} is used twice", path=path)
        endpoints.append(endpoint)
    return endpoints


_FIELDS = {"name", "host", "port", "served_model_name", "engine_model", "gpus", "vram_mb",
           "container", "api_key_file"}  # fmt: skip


def _endpoint_from(entry: Any) -> AdoptedEndpoint:
    if not isinstance(entry, dict):
        raise ConfigError("not a mapping")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(map(str, unknown))}")
    for required in ("name", "host", "port", "served_model_name", "engine_model"):
        if required not in entry:
            raise ConfigError(f"missing {required}")
    port = entry["port"]
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"port must be 1-65535, not {port!r}")
    gpus = entry.get("gpus") or []
    if not isinstance(gpus, list) or not all(isinstance(g, int) and g >= 0 for g in gpus):
        raise ConfigError(f"gpus must be a list of GPU indexes, not {gpus!r}")
    vram_mb = entry.get("vram_mb")
    if vram_mb is not None and (not isinstance(vram_mb, int) or vram_mb < 0):
        raise ConfigError(f"vram_mb must be a number of MiB, not {vram_mb!r}")
    return AdoptedEndpoint(
        name=check_name(str(entry["name"])),
        host=str(entry["host"]),
        port=port,
        served_model_name=str(entry["served_model_name"]),
        engine_model=str(entry["engine_model"]),
        gpus=tuple(gpus),
        vram_mb=vram_mb,
        container=str(entry["container"]) if entry.get("container") else None,
        api_key_file=str(entry["api_key_file"]) if entry.get("api_key_file") else None,
    )


def read_api_key(path: Path) -> str:
    """The API key in ``path``: its first line that is neither blank nor a ``#`` comment,
    without surrounding blanks.

    Raises ``ConfigError`` naming the file when it cannot be read, holds no key, or the key
    cannot travel in a header (not ASCII, or with blanks inside).
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"cannot read the API key file: {why or exc}", path=path) from None
    for line in text.splitlines():
        key = line.strip()
        if key and not key.startswith("#"):
            try:
                bearer_header(key)
            except ValueError as exc:
                raise ConfigError(f"unusable API key: {exc}", path=path) from None
            return key
    raise ConfigError("the API key file holds no key", path=path)


def store_api_key(keys_dir: Path, name: str, key: str) -> Path:
    """Keep ``key`` for the adopted endpoint ``name`` in ``keys_dir/<name>.key`` (mode
    0600, the folder 0700); the file's path.  Raises :class:`OSError`."""
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = keys_dir / f"{check_name(name)}.key"
    write_atomic(path, key + "\n", mode=0o600)
    return path


def save_adopted(path: Path, endpoints: Sequence[AdoptedEndpoint]) -> None:
    """Write ``endpoints`` to ``path`` atomically (:func:`berth.atomic.write_atomic`), mode
    0644; its folder is created when missing.  Raises :class:`OSError` when it cannot be
    written (the old file is kept then)."""
    entries = []
    for endpoint in endpoints:
        entry = {k: v for k, v in asdict(endpoint).items() if v not in (None, ())}
        if endpoint.gpus:
            entry["gpus"] = list(endpoint.gpus)
        entries.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, yaml.safe_dump(entries, sort_keys=False), mode=0o644)


def with_endpoint(
    endpoints: Sequence[AdoptedEndpoint], new: AdoptedEndpoint
) -> list[AdoptedEndpoint]:
    """``endpoints`` plus ``new``; ``ConflictError`` when its name or address is taken."""
    for endpoint in endpoints:
        if endpoint.name == new.name:
            raise ConflictError(f"an adopted endpoint is already named {new.name!r}")
        if (endpoint.host, endpoint.port) == (new.host, new.port):
            raise ConflictError(f"{new.host}:{new.port} is already adopted as {endpoint.name!r}")
    return [*endpoints, new]


def without_endpoint(endpoints: Sequence[AdoptedEndpoint], name: str) -> list[AdoptedEndpoint]:
    """``endpoints`` less the one named ``name``; ``NotFoundError`` when there is none."""
    kept = [e for e in endpoints if e.name != name]
    if len(kept) == len(endpoints):
        raise NotFoundError("adopted endpoint", name)
    return kept


def fetch_model_ids(
    host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S, *, api_key: str | None = None
) -> list[str]:
    """The model ids ``GET http://host:port/v1/models`` lists (the OpenAI list shape),
    asked with ``api_key`` as a Bearer token when given.

    Raises ``ConfigError`` saying why when nothing answers there, the answer is not 200
    (401: the key is missing or wrong), or it is not an OpenAI model list.
    """
    url = f"http://{host}:{port}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    try:
        with httpx.Client(trust_env=False, timeout=timeout_s, headers=headers) as client:
            response = client.get(url)
    except httpx.ConnectError as exc:
        raise ConfigError(f"nothing answers at {url}: {_reason(exc)}") from None
    except httpx.HTTPError as exc:
        raise ConfigError(f"{url} did not answer: {_reason(exc)}") from None
    if response.status_code == 401:
        hint = "the API key is wrong" if api_key else "it needs an API key (--api-key-file)"
        raise ConfigError(f"{url} answered 401: {hint}")
    if response.status_code != 200:
        raise ConfigError(f"{url} answered {response.status_code}, not 200")
    try:
        data = response.json()["data"]
        return [str(item["id"]) for item in data]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{url} is not an OpenAI-compatible model list") from None


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return "connection refused" if "refused" in text.lower() else text


def adopted_endpoint(
    *,
    name: str | None,
    host: str,
    port: int,
    model: str | None,
    served_model_name: str | None,
    gpus: Sequence[int] = (),
    vram_mb: int | None = None,
    container: str | None = None,
    model_ids: Sequence[str],
    api_key_file: str | None = None,
) -> AdoptedEndpoint:
    """The endpoint to adopt, from the operator's flags and what the server lists.

    ``engine_model`` is ``model`` or the server's first model id; the served name is
    ``served_model_name`` or the server's first model id (else ``model``); the name is
    ``name`` or the served name made safe.  Raises ``ConfigError`` when the server lists no
    model and none is given, or ``model`` is not one the server lists.
    """
    if model is not None and model_ids and model not in model_ids:
        listed = ", ".join(model_ids[:5])
        raise ConfigError(
            f"the server at {host}:{port} does not serve {model!r} (it lists {listed})"
        )
    first = model_ids[0] if model_ids else None
    engine_model = model or first
    if engine_model is None:
        raise ConfigError(f"the server at {host}:{port} lists no model: pass --model")
    served = served_model_name or first or engine_model
    label = name or re.sub(r"[^A-Za-z0-9._-]+", "-", served.strip("/")).strip("-.")[-63:]
    return AdoptedEndpoint(
        name=check_name(label or f"port-{port}"),
        host=host,
        port=port,
        served_model_name=served,
        engine_model=engine_model,
        gpus=tuple(gpus),
        vram_mb=vram_mb,
        container=container,
        api_key_file=api_key_file,
    )


class AdoptedWatcher:
    """Keeps one home's adopted set current and knows which endpoints answer.

    ``path`` is the home's ``adopted.yaml``.  ``on_change()`` is called (on the loop) when
    the set or an endpoint's liveness changes.  A malformed file is logged with its path and
    the last good set is kept.
    """

    def __init__(
        self,
        path: Path,
        *,
        probe_interval_s: float = PROBE_INTERVAL_S,
        reload_interval_s: float = RELOAD_INTERVAL_S,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._path = path
        self._probe_interval_s = probe_interval_s
        self._reload_interval_s = reload_interval_s
        self.on_change = on_change
        self._endpoints: dict[str, AdoptedEndpoint] = {}
        #: the ``authorization`` header of each endpoint that has a key
        self._auth: dict[str, tuple[bytes, bytes]] = {}
        self._alive: dict[str, bool] = {}
        self._probed_at: dict[str, float] = {}
        self._mtime: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._prober = HealthProber()  # one HTTP client for every probe, not one per probe

    def states(self) -> list[AdoptedState]:
        """Every adopted endpoint with its liveness, as the agent reports it."""
        return [
            AdoptedState(
                name=e.name,
                served_model_name=e.served_model_name,
                engine_model=e.engine_model,
                host=e.host,
                port=e.port,
                gpus=list(e.gpus),
                vram_mb=e.vram_mb,
                alive=self._alive.get(e.name, False),
            )
            for e in self._endpoints.values()
        ]

    def origin(self, endpoint_id: str) -> tuple[str, int] | None:
        """``(host, port)`` of the adopted endpoint whose id is ``endpoint_id``."""
        endpoint = self._endpoints.get(endpoint_id.removeprefix(ADOPTED_ID_PREFIX))
        if endpoint is None or not endpoint_id.startswith(ADOPTED_ID_PREFIX):
            return None
        return endpoint.host, endpoint.port

    def auth(self, endpoint_id: str) -> tuple[bytes, bytes] | None:
        """The ``authorization`` header requests to the adopted endpoint ``endpoint_id``
        carry; ``None`` when it has no key (or there is no such endpoint)."""
        if not endpoint_id.startswith(ADOPTED_ID_PREFIX):
            return None
        return self._auth.get(endpoint_id.removeprefix(ADOPTED_ID_PREFIX))

    def start(self) -> None:
        """Read the file and probe every endpoint now, then keep doing so in the background."""
        self._task = asyncio.create_task(self._run(), name="berth-adopted")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def check_once(self) -> None:
        """Reload the file if it changed and probe the endpoints whose probe is due."""
        changed = await asyncio.to_thread(self._reload)
        now = time.monotonic()
        due = [e for e in self._endpoints.values()
               if now - self._probed_at.get(e.name, -1e9) >= self._probe_interval_s]  # fmt: skip
        results = await asyncio.gather(*(self._probe(e) for e in due))
        for endpoint, alive in zip(due, results, strict=True):
            self._probed_at[endpoint.name] = now
            if self._alive.get(endpoint.name) != alive:
                log.info("adopted endpoint %s (%s) %s", endpoint.name, endpoint.base_url,
                         "answers" if alive else "does not answer")  # fmt: skip
                self._alive[endpoint.name] = alive
                changed = True
        if changed and self.on_change is not None:
            self.on_change()

    async def _run(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # the watcher must survive; the log keeps why
                log.exception("checking the adopted endpoints of %s failed", self._path)
            await asyncio.sleep(self._reload_interval_s)

    def _reload(self) -> bool:
        try:
            mtime: float | None = self._path.stat().st_mtime_ns / 1e9
        except FileNotFoundError:
            mtime = None
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        try:
            endpoints = load_adopted(self._path)
        except ConfigError as exc:
            log.error("%s; keeping the adopted endpoints read before", exc)
            return False
        auth: dict[str, tuple[bytes, bytes]] = {}
        for endpoint in endpoints:
            if endpoint.api_key_file is None:
                continue
            try:
                auth[endpoint.name] = bearer_header(read_api_key(Path(endpoint.api_key_file)))
            except ConfigError as exc:  # probed without it: it does not answer 200
                log.error("adopted endpoint %s: %s", endpoint.name, exc)
        previous = self._endpoints
        self._endpoints = {e.name: e for e in endpoints}
        self._auth = auth
        for name in list(self._alive):
            if name not in self._endpoints or previous.get(name) != self._endpoints[name]:
                self._alive.pop(name, None)
                self._probed_at.pop(name, None)  # new or changed: probed at once
        return previous != self._endpoints

    async def _probe(self, endpoint: AdoptedEndpoint) -> bool:
        found = self._auth.get(endpoint.name)
        headers = {"Authorization": found[1].decode("ascii")} if found is not None else None
        url = f"{endpoint.base_url}/v1/models"
        return await self._prober.probe(url, PROBE_TIMEOUT_S, headers=headers)


def describe(endpoint: AdoptedEndpoint, alive: bool | None = None) -> dict[str, Any]:
    """``endpoint`` as a JSON-ready mapping (``alive`` added when known)."""
    data = asdict(replace(endpoint))
    data["gpus"] = list(endpoint.gpus)
    if alive is not None:
        data["alive"] = alive
    return data
