"""The layout of ``$BERTH_HOME``: one place that knows where every file lives."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_HOME = "~/.berth"

#: Who owns an engine journal: an agent (``agent-engines.json``) or the leader, for the
#: engines of node ``local`` (``local-engines.json``).
JournalOwner = Literal["agent", "leader"]


def resolve_home(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Return the berth home: ``explicit``, else ``$BERTH_HOME`` (unless empty), else
    ``~/.berth``."""
    raw = explicit if explicit is not None else (os.environ.get("BERTH_HOME") or DEFAULT_HOME)
    return Path(raw).expanduser().resolve()


@dataclass(frozen=True)
class WardenFiles:
    """The files of one engine journal's owner and of its warden (``berth.agent.warden``):
    the journal, the lock its running owner holds (``flock``) for its whole life, the
    warden's pid file (pid and start time) and its log (one line per action)."""

    journal: Path
    owner_lock: Path
    pid_file: Path
    log: Path


@dataclass(frozen=True)
class BerthHome:
    """Paths under one ``$BERTH_HOME`` directory.  Nothing is created until :meth:`ensure`."""

    root: Path

    @property
    def config_file(self) -> Path:
        return self.root / "config.toml"

    @property
    def db_file(self) -> Path:
        return self.root / "berth.db"

    @property
    def ca_dir(self) -> Path:
        return self.root / "ca"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def socket_file(self) -> Path:
        return self.root / "berth.sock"

    @property
    def pid_file(self) -> Path:
        return self.root / "daemon.pid"

    @property
    def daemon_log(self) -> Path:
        return self.logs_dir / "daemon.log"

    @property
    def pepper_file(self) -> Path:
        return self.root / "key_pepper"

    def restart_record(self, service: str) -> Path:
        """The record of ``service``'s last start (``leader``, ``agent``) that
        ``--restart-backoff`` keeps (:mod:`berth.restart_backoff`)."""
        return self.root / f"restarts-{service}.json"

    @property
    def audit_log(self) -> Path:
        """One JSON line per security-relevant event (node registrations) and per deployment
        the scaling controller unloaded or evicted."""
        return self.logs_dir / "audit.log"

    @property
    def agent_config(self) -> Path:
        """The agent's identity: leader URL, node id, label, pinned CA fingerprint."""
        return self.root / "agent.yaml"

    @property
    def agent_cert(self) -> Path:
        return self.root / "agent.crt"

    @property
    def agent_key(self) -> Path:
        """The agent's private key (mode 0600); it never leaves the host."""
        return self.root / "agent.key"

    @property
    def agent_ca(self) -> Path:
        """The leader's CA certificate, pinned by fingerprint at registration."""
        return self.root / "ca.pem"

    @property
    def agent_spec_keys(self) -> Path:
        """The cluster's spec signing keys (public, PEM), pinned at registration and
        replaced by renewals (:mod:`berth.agent.spec_keys`)."""
        return self.root / "spec-keys.pem"

    @property
    def agent_log(self) -> Path:
        """The agent's full log (``berth agent logs``)."""
        return self.logs_dir / "agent.log"

    @property
    def agent_status_file(self) -> Path:
        """The running agent's status, rewritten on every change (``berth agent status``)."""
        return self.root / "agent-status.json"

    @property
    def adopted_file(self) -> Path:
        """The OpenAI-compatible servers this host adopted (``berth agent adopt``)."""
        return self.root / "adopted.yaml"

    @property
    def agent_engines_file(self) -> Path:
        """The engines the agent runs (deployment, pid, port), to take them back after the
        agent restarts."""
        return self.root / "agent-engines.json"

    @property
    def local_engines_file(self) -> Path:
        """The engines the leader runs on its own host (node ``local``): the agent journal's
        format, so a restarted leader takes them back with their API keys."""
        return self.root / "local-engines.json"

    @property
    def engine_keys_dir(self) -> Path:
        """Files holding engines' API keys while they start (mode 0600), for engines that
        read their key from a file (SGLang)."""
        return self.root / "engine-keys"

    @property
    def adopted_keys_dir(self) -> Path:
        """The API keys of adopted servers (``berth agent adopt --api-key-file``), one
        ``<name>.key`` each, mode 0600."""
        return self.root / "adopted-keys"

    def warden_files(self, owner: JournalOwner) -> WardenFiles:
        """The journal of ``owner``'s engines and its warden's files (``agent.lock``,
        ``warden-agent.pid``, ``logs/warden-agent.log``; ``leader.*`` for the leader)."""
        journal = self.agent_engines_file if owner == "agent" else self.local_engines_file
        return WardenFiles(
            journal=journal,
            owner_lock=self.root / f"{owner}.lock",
            pid_file=self.root / f"warden-{owner}.pid",
            log=self.logs_dir / f"warden-{owner}.log",
        )

    def engine_log(self, deployment_id: str) -> Path:
        """The log file of one deployment's engine."""
        return self.logs_dir / f"engine-{deployment_id}.log"

    def ensure(self) -> None:
        """Create the home and its folders, private to the owner (mode 0700)."""
        for folder in (self.root, self.ca_dir, self.logs_dir, self.models_dir):
            folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        os.chmod(self.ca_dir, 0o700)
