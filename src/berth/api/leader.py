"""The leader itself: health, readiness, ``/admin/info``, ``/admin/config``, shutdown."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from berth.api.base import ApiInput, ApiModel, Timestamp
from berth.vocab.engines import RuntimeName
from berth.vocab.setting_values import JsonScalar, SettingSource


class Health(ApiModel):
    """``GET /healthz``: the process answers."""

    status: Literal["ok"] = "ok"


class Readiness(ApiModel):
    """``GET /readyz``: ``ready`` (200) once the leader serves what it routes (it leads,
    its ready table is loaded, its agents' deployments are routed again or the wait for
    their links is over); ``starting`` (503) before, with a ``detail`` while it waits for
    links; ``standby`` (503) on a leader that shares leadership and is not the active one;
    ``draining`` (503) on a leader that stops or steps down and still serves until its
    drain is over (docs/ha.md)."""

    status: Literal["ready", "starting", "standby", "draining"]
    detail: str | None = None


class LeaderStatus(ApiModel):
    """``GET /admin/leader``: this leader's ``role`` and ``id``, the lease's ``epoch`` (0
    without ``leader_ha``), the URL of the active leader (``None`` while no lease is live)
    and whether leadership is shared (``ha``: the ``leader_ha`` setting)."""

    role: Literal["active", "standby"]
    id: str
    epoch: int
    active_address: str | None
    ha: bool


class ListenerInfo(ApiModel):
    """One address the leader serves on: ``public``, ``cluster`` or ``socket``, and its URL;
    for a TLS listener, the serial (upper-case hex) and ``notAfter`` of the certificate new
    connections get now (it changes on a reload)."""

    name: str
    url: str
    certificate_serial: str | None = None
    certificate_not_after: Timestamp | None = None


class RuntimeInfo(ApiModel):
    """Whether a runtime can start engines on the leader's host, and a line saying why."""

    name: RuntimeName
    available: bool
    detail: str


class DaemonInfo(ApiModel):
    """``GET /admin/info``: the running leader.

    ``started_at`` is epoch seconds, ``uptime_s`` seconds (one decimal).  ``ca_file`` is the
    berth CA's certificate, which clients must trust when ``public_cert_from_ca`` (no
    ``--public-cert``); ``leader_only``: no engines on the leader's host.  ``runtimes`` are
    the leader's own (empty when ``leader_only``).
    """

    version: str
    pid: int
    home: str
    started_at: float
    uptime_s: float
    ca_fingerprint: str
    ca_file: str
    listeners: list[ListenerInfo]
    cluster_url: str
    public_cert_from_ca: bool
    ready: bool
    leader_only: bool
    runtimes: list[RuntimeInfo]
    simulated_gpus_mb: list[int] = Field(default_factory=list)


class SettingValue(ApiModel):
    """One resolved setting and where its value came from."""

    value: JsonScalar
    source: SettingSource


#: ``GET /admin/config``: every setting the daemon runs with, by name.
SettingsReport = dict[str, SettingValue]


class StepDownIn(ApiInput):
    """``POST /admin/leader/step-down``: ``force`` steps down even when no other leader was
    seen within the lease (the cluster is then left with no active leader)."""

    force: bool = False


class StepDownAccepted(ApiModel):
    """``POST /admin/leader/step-down`` (202): the active leader drains (``/readyz`` 503 for
    the ``drain_s`` setting while it serves on), hands its lease back (a standby takes new
    requests at its next look), finishes what is in flight, and exits.
    ``standbys`` are the cluster URLs of the other leaders seen within the lease (empty
    only with ``force``).  Refused (409) on a standby, without ``leader_ha``, and, without
    ``force``, when no other leader was seen within the lease, naming what was checked."""

    status: Literal["stepping down"] = "stepping down"
    standbys: list[str] = Field(default_factory=list)


class ShutdownAccepted(ApiModel):
    """``POST /admin/shutdown`` (202): the leader stops its engines and exits."""

    status: Literal["stopping"] = "stopping"
