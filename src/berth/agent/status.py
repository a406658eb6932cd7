"""What the status panel and ``berth agent status`` show of a running agent, rewritten to
``agent-status.json`` on every change: the link's state, recent activity, and the agent's
certificate with the state of its renewal (:mod:`berth.agent.renewal`)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from berth.atomic import write_atomic

log = logging.getLogger("berth.agent.dialer")

#: How many recent activity lines the status keeps.
RECENT_LINES = 8


@dataclass
class AgentStatus:
    """What the status panel and ``berth agent status`` show; written to a JSON file."""

    leader_url: str
    node_id: str
    label: str
    #: starting | connecting | connected | backoff | expired (the certificate) | stopped
    state: str = "starting"
    started_at: float = field(default_factory=time.time)
    connected_since: float | None = None
    operation: str = ""
    last_error: str = ""
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_LINES))
    pid: int = field(default_factory=os.getpid)
    path: Path | None = None
    #: the agent's certificate: serial (hex) and notAfter (epoch s), once read
    cert_serial: str = ""
    cert_not_after: float | None = None
    #: one line on the renewal: when the next is due, or why the last failed
    renewal_state: str = ""
    renewal_failing: bool = False
    #: the command that fixes an agent the leader refused for good ("": none needed)
    fix: str = ""

    def certificate(self, serial: str, not_after: float) -> None:
        """The certificate on disk now (read at start and after each renewal)."""
        self.cert_serial, self.cert_not_after = serial, not_after
        self.save()

    def renewal(self, line: str, *, error: bool = False) -> None:
        """The renewal's state, in a line (``error``: the last attempt failed)."""
        self.renewal_state, self.renewal_failing = line, error
        self.save()

    def needs_reenrollment(self, command: str) -> None:
        """The leader refused this node for good: ``command`` enrolls it again."""
        self.fix = command
        self.save()

    def activity(self, line: str) -> None:
        self.recent.append(f"{time.strftime('%H:%M:%S')} {line}")
        self.operation = line
        log.info("%s", line)
        self.save()

    def set(self, state: str, *, error: str | None = None) -> None:
        self.state = state
        if error is not None:
            self.last_error = error
        elif state == "connected":
            self.last_error = ""  # an error from before this link is history now
        self.connected_since = time.time() if state == "connected" else None
        self.save()

    @property
    def connected(self) -> bool:
        """Whether the link to the leader is up now (every other state is disconnected)."""
        return self.state == "connected"

    def as_json(self) -> dict[str, object]:
        return {
            "state": self.state,
            "connected": self.connected,
            "leader_url": self.leader_url,
            "node_id": self.node_id,
            "label": self.label,
            "pid": self.pid,
            "started_at": self.started_at,
            "connected_since": self.connected_since,
            "operation": self.operation,
            "last_error": self.last_error,
            "fix": self.fix,
            "recent": list(self.recent),
            "certificate": {
                "serial": self.cert_serial,
                "not_after": self.cert_not_after,
                "renewal": self.renewal_state,
                "renewal_failing": self.renewal_failing,
            },
        }

    def save(self) -> None:
        if self.path is None:
            return
        # A snapshot rewritten at every change: not synced to disk (losing the last one in a
        # power cut is harmless), so a write on the event loop stays short.
        write_atomic(self.path, json.dumps(self.as_json(), indent=1), mode=0o644, durable=False)
