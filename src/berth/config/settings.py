"""Settings resolution: flag > environment (``BERTH_*``) > ``config.toml`` > autodetect >
default.

:meth:`Settings.load` resolves each setting of :data:`~berth.config.table.SETTINGS` from the
highest source that supplies it, converts and validates the raw value, and remembers which
source won, so ``berth config show`` can say why a value is what it is.  Nothing here reads
the environment or the disk at import time; :meth:`Settings.load` does, and only from the
``env`` mapping and the home it is given.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from berth.config.convert import convert_value
from berth.config.file import FileValue, read_config_file
from berth.config.table import SETTINGS, SettingDef, setting_definition
from berth.config.tiers import TierTable, read_tiers
from berth.errors import ConfigError
from berth.http_server.limits import ListenerLimits
from berth.paths import BerthHome
from berth.runtime.trees import TreeMode
from berth.vocab.agent_policy import AgentPolicy, default_agent_policy, policy_from_fields
from berth.vocab.engines import EngineName
from berth.vocab.policies import RoutingPolicy
from berth.vocab.setting_values import JsonScalar, SettingSource

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

    Build it with :meth:`load`; the fields mirror :data:`SETTINGS` one to one, and ``tiers``
    holds the key tiers of ``config.toml`` (:mod:`berth.config.tiers`).
    """

    home: BerthHome
    sources: Mapping[str, SettingSource]
    tiers: TierTable
    database_url: str
    leader_ha: bool
    leader_lease_s: float
    cluster_secret: str | None
    public_host: str
    public_bind: str
    public_port: int
    public_cert: Path | None
    public_key: Path | None
    tls_reload_interval_s: float
    max_body_bytes: int
    max_body_elements: int
    max_messages: int
    max_content_parts: int
    max_body_bytes_per_key: int
    max_attempts: int
    routing_policy: RoutingPolicy
    prefix_load_factor: float
    prefix_cache_entries: int
    prefix_cache_mb: int
    first_byte_timeout_s: float
    stream_idle_timeout_s: float
    read_timeout_s: float
    relay_buffer_chunks: int
    queue_max_requests: int
    queue_timeout_s: float
    default_slots: int
    cors_origins: str | None
    max_head_bytes: int
    max_header_count: int
    head_timeout_s: float
    keepalive_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_connections_per_address: int
    discard_bytes_per_s: int
    auth_failure_burst: int
    auth_failure_rate_per_s: float
    auth_refusal_delay_s: float
    leader_only: bool
    log_level: str
    health_timeout_s: float
    stop_grace_s: float
    drain_s: float
    orphan_grace_s: float
    probe_interval_s: float
    probe_timeout_s: float
    probes_to_fail: int
    restart_backoff_s: float
    restart_backoff_max_s: float
    restart_reset_after_s: float
    crashloop_restarts: int
    default_runtime: str
    llama_server_bin: Path | None
    vllm_bin: Path | None
    sglang_python: Path
    process_tree: TreeMode
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
    link_timeout_s: float
    agent_cert_lifetime_s: float
    require_agent_spec_check: bool
    direct_probe_interval_s: float
    direct_probe_timeout_s: float
    agent_advertise: str | None
    agent_ingress_bind: str
    redial_max_s: float
    policy_engines: str | None
    policy_images: str | None
    policy_model_roots: str | None
    policy_gpus: str | None
    policy_allow_args: str | None
    policy_refuse_args: str | None
    load_wait_s: float
    load_queue_max: int
    min_residency_s: float
    scale_out_after_s: float
    scaling_interval_s: float
    simulated_gpus: str | None
    desk_pool_url: str
    desk_tier: str
    tracing_endpoint: str | None
    tracing_headers: str | None
    tracing_sample_ratio: float | None
    tracing_queue_spans: int

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
        (with file and line), an unknown section or key in it, a malformed ``[tiers.*]``
        table (:func:`~berth.config.tiers.read_tiers`), a value that does not convert
        or is out of range (naming the flag, the environment variable, or file and line), or
        ``public_cert`` without ``public_key`` (or the reverse).
        """
        environ: Mapping[str, str] = os.environ if env is None else env
        given_flags = {k: v for k, v in (flags or {}).items() if v is not None}
        for name in given_flags:
            setting_definition(name)
        file_values = read_config_file(home.config_file)
        tiers = read_tiers(home.config_file)

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
        if timeout_s < 2 * heartbeat_s:
            raise ConfigError(
                f"node_timeout_s ({timeout_s}, {sources['node_timeout_s']}) must be at least "
                f"twice heartbeat_interval_s ({heartbeat_s}, {sources['heartbeat_interval_s']}), "
                "or healthy nodes would flap"
            )

        interval_s, probe_s = values["probe_interval_s"], values["probe_timeout_s"]
        if probe_s >= interval_s:
            raise ConfigError(
                f"probe_timeout_s ({probe_s}, {sources['probe_timeout_s']}) must be below "
                f"probe_interval_s ({interval_s}, {sources['probe_interval_s']}): "
                "each round of health probes ends before the next begins"
            )

        try:  # an unknown tier is refused when it is given, not at the first desk job
            values["desk_tier"] = tiers.require(values["desk_tier"]).name
        except ConfigError as exc:
            raise ConfigError(f"desk_tier ({sources['desk_tier']}): {exc}") from None

        if (values["public_cert"] is None) != (values["public_key"] is None):
            given = "public_cert" if values["public_cert"] is not None else "public_key"
            raise ConfigError(
                f"{given} is set ({sources[given]}) but its pair is not: "
                "set both public_cert and public_key, or neither"
            )
        return cls(home=home, sources=sources, tiers=tiers, **values)

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
            discard_bytes_per_s=self.discard_bytes_per_s,
        )

    def docker_images(self) -> dict[EngineName, str]:
        """The image the docker runtime runs for each engine (the ``*_image`` settings)."""
        return {
            "llamacpp": self.llamacpp_image,
            "vllm": self.vllm_image,
            "sglang": self.sglang_image,
        }

    def agent_policy(self, env: Mapping[str, str]) -> AgentPolicy:
        """The leader's policy for its own node (``[agent_policy]``): the default policy
        (:func:`~berth.vocab.agent_policy.default_agent_policy`, its Hugging Face cache
        read from ``env``) with each setting given in its place.  Each setting was checked
        when loaded."""
        given = {
            "engines": self.policy_engines,
            "images": self.policy_images,
            "model_roots": self.policy_model_roots,
            "gpus": self.policy_gpus,
            "allow_args": self.policy_allow_args,
            "refuse_args": self.policy_refuse_args,
        }
        base = default_agent_policy(self.home.models_dir, env)
        return policy_from_fields({k: v for k, v in given.items() if v is not None}, base)

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

        Settings marked secret are masked (:meth:`SettingDef.shown`): the password in
        ``database_url``, the values of ``tracing_headers``, the ``cluster_secret``.
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
    typed = [f.name for f in fields(Settings) if f.name not in ("home", "sources", "tiers")]
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
        return convert_value(defn, flags[defn.name], f"flag {defn.flag}", Path.cwd()), "flag"
    if defn.env_var in env:
        where = f"environment variable {defn.env_var}"
        return convert_value(defn, env[defn.env_var], where, Path.cwd()), "env"
    if defn.name in file_values:
        found = file_values[defn.name]
        try:
            return convert_value(defn, found.raw, f"[{defn.section}]", found.path.parent), "file"
        except ConfigError as exc:
            raise ConfigError(str(exc), path=found.path, line=found.line) from None
    if defn.autodetect is not None:
        detected = defn.autodetect(env)
        if detected is not None:
            return detected, "autodetect"
    if defn.default_factory is not None:
        return defn.default_factory(home), "default"
    return defn.default, "default"


def _jsonable(name: str, value: object) -> JsonScalar:
    if value is None or isinstance(value, bool | int | float):
        return value
    return setting_definition(name).shown(str(value))  # a secret setting masked


_check_registry_matches_settings()
