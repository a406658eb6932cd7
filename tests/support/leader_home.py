"""The start every in-process cluster leader of the tests shares: a leader's home under
``tmp_path / "leader"`` with its CA, its migrated SQLite store (node ``local`` in it), and
the cluster listener's socket bound on loopback, with the URL agents dial."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from berth.cluster.pki.ca import CertificateAuthority
from berth.http_server.sockets import bind_tcp
from berth.paths import BerthHome
from berth.store import Store


@dataclass
class LeaderHome:
    """What :func:`leader_home` made; the caller closes ``store`` and hands ``sock`` to a
    listener (which closes it)."""

    home: BerthHome
    ca: CertificateAuthority
    store: Store
    sock: socket.socket
    url: str


def leader_home(tmp_path: Path) -> LeaderHome:
    """A fresh leader's home, CA, store and bound cluster socket (see the module doc)."""
    home = BerthHome(tmp_path / "leader")
    home.ensure()
    ca = CertificateAuthority.load_or_create(home.ca_dir)
    store = Store(f"sqlite:///{home.db_file}")
    store.migrate()
    store.ensure_local_node()
    sock = bind_tcp("cluster", "127.0.0.1", 0)
    return LeaderHome(home, ca, store, sock, f"https://127.0.0.1:{sock.getsockname()[1]}")
