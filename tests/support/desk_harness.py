"""Real parts for the desk tests: ``berth desk serve`` as a process and a TLS certificate for
the stand-in desk on 127.0.0.1 (the ``berth`` CLI itself is ``support.berth_cli.Berth``).

The stand-in desk's certificate is issued by a throwaway berth CA; the desk processes trust
it through ``SSL_CERT_FILE`` (which httpx honours), as an operator would for a private pool.
"""

from __future__ import annotations

import signal
import ssl
import subprocess
from pathlib import Path
from typing import IO, Any

from berth.cluster.pki.ca import CertificateAuthority
from support.berth_cli import Berth


def loopback_tls(folder: Path) -> tuple[ssl.SSLContext, Path]:
    """A server TLS context for 127.0.0.1 and the CA file that verifies it."""
    ca = CertificateAuthority.load_or_create(folder / "ca")
    cert, key = folder / "desk.pem", folder / "desk.key"
    ca.issue_server_certificate(["127.0.0.1"], cert, key)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ca.cert_path


class DeskServe:
    """``berth desk serve`` as a process; its output goes to ``output`` (outside the home)."""

    def __init__(self, berth: Berth, output: Path, *args: str) -> None:
        self.output = output
        self._log: IO[Any] = output.open("w")
        self.process = subprocess.Popen(berth.argv("desk", "serve", *args), env=berth.env,
                                        cwd=berth.cwd, stdout=self._log,
                                        stderr=subprocess.STDOUT)  # fmt: skip

    def stop(self, timeout_s: float = 30) -> int:
        """SIGINT, as Ctrl-C would; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._log.close()
        return code

    def text(self) -> str:
        return self.output.read_text()


def files_containing(root: Path, needle: str) -> list[Path]:
    """Every regular file under ``root`` whose bytes contain ``needle`` (UTF-8)."""
    raw = needle.encode()
    return [p for p in root.rglob("*") if p.is_file() and raw in p.read_bytes()]
