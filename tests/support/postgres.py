"""A throwaway PostgreSQL server for the store's tests on both engines.

:class:`PostgresServer` runs Debian's server binaries (``/usr/lib/postgresql/N/bin``, the
``postgresql`` package that ``scripts/setup.sh`` installs) in a temporary folder: ``initdb``
with trust authentication for one superuser, ``pg_ctl start`` on a free loopback port with
the socket in that folder, and :meth:`PostgresServer.stop` (``pg_ctl stop -m immediate``).
PostgreSQL refuses to run as root, so under root the server runs as the unprivileged
``postgres`` user, who owns the folder.  Durability is switched off (``fsync``,
``synchronous_commit``, ``full_page_writes``): the data lives one test session.

:meth:`PostgresServer.create_database` makes a fresh empty database (``CREATE DATABASE``
copies ``template1``: milliseconds) and returns its ``postgresql+psycopg://`` URL.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psycopg

#: Where Debian puts each major version's server binaries.
DEBIAN_ROOT = Path("/usr/lib/postgresql")
#: The superuser ``initdb`` creates (trust authentication: no password).
SUPERUSER = "berth"
#: Seconds ``pg_ctl`` waits for the server to start or stop.
PG_CTL_WAIT_S = 60


def server_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/N/bin`` holding ``initdb`` and ``pg_ctl``, else the
    folder of ``initdb`` on ``PATH``, else ``None``."""
    found: list[tuple[int, Path]] = []
    if DEBIAN_ROOT.is_dir():
        for child in DEBIAN_ROOT.iterdir():
            bin_dir = child / "bin"
            tools = (bin_dir / "initdb", bin_dir / "pg_ctl")
            if child.name.isdigit() and all(tool.exists() for tool in tools):
                found.append((int(child.name), bin_dir))
    if found:
        return max(found)[1]
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb is not None else None


def missing() -> str | None:
    """Why no PostgreSQL server can be started here, or ``None`` when one can."""
    if server_bin_dir() is None:
        return (
            "PostgreSQL's server binaries (initdb, pg_ctl) are not installed "
            "(apt-get install postgresql; scripts/setup.sh does)"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no unprivileged postgres user to run the server"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class PostgresServer:
    """One running server: ``port`` on 127.0.0.1, data and socket under ``folder``."""

    bin_dir: Path
    folder: Path
    port: int
    user: str | None
    databases: int = 0

    @classmethod
    def start(cls) -> PostgresServer:
        """Initialise and start a server (see the module doc).  Raises ``RuntimeError``
        naming the step and its output when ``initdb`` or ``pg_ctl`` fails."""
        bin_dir = server_bin_dir()
        if bin_dir is None:
            raise RuntimeError(missing() or "no PostgreSQL binaries")
        folder = Path(tempfile.mkdtemp(prefix="berth-pg-"))
        user = "postgres" if os.geteuid() == 0 else None
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(folder, entry.pw_uid, entry.pw_gid)
        server = cls(bin_dir=bin_dir, folder=folder, port=_free_port(), user=user)
        data = folder / "data"
        server._run(
            "initdb", "-D", str(data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8",
            "--locale=C", "--no-sync",
        )  # fmt: skip
        options = (
            f"-c listen_addresses=127.0.0.1 -p {server.port} -k {folder} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        server._run(
            "pg_ctl", "-D", str(data), "-l", str(folder / "server.log"), "-o", options,
            "-w", "-t", str(PG_CTL_WAIT_S), "start",
        )  # fmt: skip
        return server

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin_dir / tool), *args]
        result = subprocess.run(
            command,
            user=self.user,
            cwd=self.folder,
            capture_output=True,
            text=True,
            timeout=PG_CTL_WAIT_S + 30,
            check=False,
        )
        if result.returncode != 0:
            log = self.folder / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"{tool} failed ({result.returncode}): {result.stdout}{result.stderr}{tail}"
            )

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` on this server."""
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres", autocommit=True
        )

    def create_database(self) -> str:
        """A fresh, empty database; its URL."""
        self.databases += 1
        name = f"t{self.databases}"
        with self._admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template1')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Drop the database of ``url``, closing whatever connections it still has."""
        name = url.rsplit("/", 1)[1]
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        """Stop the server (immediately: nothing in it is kept) and remove its folder."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)
