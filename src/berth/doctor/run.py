"""Which checks a home gets, in what order, and what they are given.

A home is a **leader** home unless it holds an agent identity (``agent.yaml``) and no CA
key; an agent home is checked against its leader instead of for ports and server
certificates.  ``leader_only`` (the flag, or a ``leader_only`` setting) leaves out what runs
engines: programs, Docker, images and GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlsplit

from cryptography import x509

from berth.api import DaemonInfo
from berth.cluster.pki.ca import CA_CERT_FILE, CA_KEY_FILE
from berth.config import Settings
from berth.doctor.agent import agent_checks
from berth.doctor.certs import (
    ServedCertificate,
    ca_check,
    load_certificate,
    server_certificate_check,
)
from berth.doctor.check import Check
from berth.doctor.engines import (
    docker_checks,
    gpu_check,
    llama_server_check,
    process_tree_check,
    sglang_check,
    vllm_check,
)
from berth.doctor.install import home_check, packages_check, python_check, secrets_check
from berth.doctor.ports import port_check
from berth.doctor.store import store_check
from berth.errors import BerthError, ConfigError
from berth.paths import BerthHome

#: Hosts the leader always puts in the certificates it issues itself (see
#: ``berth.daemon.public_tls.public_tls_files`` and
#: ``berth.cluster.leader.listener.cluster_tls_files``).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_FORWARDED_FP_ENV = "BERTH_TRUST_FORWARDED_FP"


@dataclass(frozen=True)
class DaemonState:
    """Whether the daemon of the home answers on its socket: its ``/admin/info`` or ``None``,
    and the check line that says so."""

    info: DaemonInfo | None
    check: Check

    @property
    def running(self) -> bool:
        return self.info is not None


def run_checks(
    home: BerthHome,
    *,
    leader_only: bool = False,
    env: Mapping[str, str] | None = None,
    now: datetime | None = None,
    timeout_s: float = 5.0,
) -> list[Check]:
    """Every check for ``home``, in report order; never raises for what it checks.

    ``env`` is the environment settings are read from (default ``os.environ``); ``now`` the
    aware datetime certificates are judged at (default: now); ``timeout_s`` bounds each
    network probe (the daemon's socket, the leader, a busy port).
    """
    now = now or datetime.now(UTC)
    checks = [python_check(), packages_check(), home_check(home), secrets_check(home)]
    try:
        settings = Settings.load(home, env=env)
    except BerthError as exc:
        hint = "fix it in config.toml or the environment; berth config show lists the settings"
        return [*checks, Check("settings", "fail", str(exc), hint)]
    checks.append(Check("settings", "ok", f"{home.config_file}" + _file_note(home)))
    is_agent = home.agent_config.exists()
    is_leader = not is_agent or (home.ca_dir / CA_KEY_FILE).exists()
    if is_leader:
        daemon = daemon_state(home, timeout_s=timeout_s)
        checks.append(daemon.check)
        checks.append(store_check(settings))
        checks.extend(listener_checks(home, settings, daemon_running=daemon.running))
        checks.extend(
            tls_checks(
                home,
                settings,
                daemon_running=daemon.running,
                now=now,
                cluster_tls_proxied=cluster_tls_proxied(os.environ if env is None else env),
            )
        )
    if is_agent:
        checks.extend(agent_checks(home, now=now, timeout_s=timeout_s))
    if not (leader_only or configured_leader_only(settings)):
        checks.extend(engine_checks(settings))
    return checks


def configured_leader_only(settings: Settings) -> bool:
    """The ``leader_only`` setting, where this berth has one (``False`` otherwise)."""
    try:
        return bool(settings.value("leader_only"))
    except ConfigError:
        return False


def daemon_state(home: BerthHome, *, timeout_s: float = 5.0) -> DaemonState:
    """Ask the daemon of ``home`` for ``/admin/info`` over its Unix socket."""
    from berth.api.client import DaemonClient

    try:
        with DaemonClient(home, timeout_s=timeout_s) as client:
            if not client.is_running():
                return DaemonState(
                    None, Check("daemon", "warn", "not running", "berth daemon start")
                )
            info = client.info()
    except BerthError as exc:
        return DaemonState(None, Check("daemon", "warn", str(exc), "berth daemon start"))
    detail = f"running, pid {info.pid}, v{info.version}"
    return DaemonState(info, Check("daemon", "ok", detail))


def listener_checks(
    home: BerthHome, settings: Settings, *, daemon_running: bool = True
) -> list[Check]:
    """Each listener's configured port (see :func:`berth.doctor.ports.port_check`); a busy
    port is this home's daemon only while it runs (``daemon_running``)."""
    public_cert = settings.public_cert or home.ca_dir / "public.pem"
    return [
        port_check(
            "public",
            settings.public_bind,
            settings.public_port,
            served_cert=public_cert,
            daemon_running=daemon_running,
        ),
        port_check(
            "cluster",
            settings.cluster_bind,
            settings.cluster_port,
            served_cert=home.ca_dir / "cluster.pem",
            daemon_running=daemon_running,
        ),
    ]


def cluster_tls_proxied(env: Mapping[str, str]) -> bool:
    """Whether a TLS-terminating proxy fronts the cluster listener (the reverse-proxy
    fingerprint mode, ``BERTH_TRUST_FORWARDED_FP``; see ``berth.cluster.pki.peer_identity``)."""
    return env.get(_FORWARDED_FP_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def tls_checks(
    home: BerthHome,
    settings: Settings,
    *,
    daemon_running: bool,
    now: datetime,
    cluster_tls_proxied: bool = False,
) -> list[Check]:
    """The CA, then the public and the cluster listener's certificates.

    The host of ``leader_url`` must be on the cluster certificate, since agents dial it and
    a pass-through proxy hands them the leader's own certificate, unless
    ``cluster_tls_proxied``: then the proxy presents its own certificate for that host.
    """
    ca_cert: x509.Certificate | None = None
    try:
        ca_cert = load_certificate(home.ca_dir / CA_CERT_FILE)
    except (OSError, ValueError):
        ca_cert = None  # ca_check says why
    if settings.public_cert is not None and settings.public_key is not None:
        public = ServedCertificate(
            "public",
            settings.public_cert,
            settings.public_key,
            (),
            {settings.public_host: "public_host"},
        )
    else:
        public = ServedCertificate(
            "public",
            home.ca_dir / "public.pem",
            home.ca_dir / "public.key",
            tuple(sorted({settings.public_host, *LOOPBACK_HOSTS})),
            {settings.public_host: "public_host"},
        )
    dialed = {settings.cluster_host: "cluster_host"}
    leader_host = urlsplit(settings.leader_url).hostname if settings.leader_url else None
    if leader_host and leader_host not in dialed and not cluster_tls_proxied:
        dialed[leader_host] = "leader_url"
    cluster = ServedCertificate(
        "cluster",
        home.ca_dir / "cluster.pem",
        home.ca_dir / "cluster.key",
        tuple(sorted({*settings.cluster_hosts(), *LOOPBACK_HOSTS})),
        dialed,
    )
    return [
        ca_check(home.ca_dir, now),
        *(
            server_certificate_check(
                served, ca_cert=ca_cert, daemon_running=daemon_running, now=now
            )
            for served in (public, cluster)
        ),
    ]


def engine_checks(settings: Settings) -> list[Check]:
    """Each engine's program, the Docker engine and images, the GPUs."""
    gpus = gpu_check(settings.simulated_gpus, settings.source("simulated_gpus"))
    return [
        llama_server_check(settings.llama_server_bin, settings.source("llama_server_bin")),
        vllm_check(settings.vllm_bin, settings.source("vllm_bin")),
        sglang_check(settings.sglang_python, settings.source("sglang_python")),
        process_tree_check(settings.process_tree),
        *docker_checks(
            _docker_host(settings),
            settings.docker_images(),
            default_runtime=settings.default_runtime == "docker",
            with_gpus=gpus.verdict == "ok",
        ),
        gpus,
    ]


def _docker_host(settings: Settings) -> str:
    from berth.runtime.docker import resolve_docker_host

    return resolve_docker_host(settings.docker_host)


def _file_note(home: BerthHome) -> str:
    return "" if home.config_file.exists() else " (absent: defaults apply)"
