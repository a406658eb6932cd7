"""Real parts for the desk tests: the ``berth`` CLI on a leader's home, ``berth desk serve`` as
a process, and a TLS certificate for the stand-in desk on 127.0.0.1.

The stand-in desk's certificate is issued by a throwaway berth CA; the desk processes trust
it through ``SSL_CERT_FILE`` (which httpx honours), as an operator would for a private pool.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from berth.cluster.ca import CertificateAuthority


def loopback_tls(folder: Path) -> tuple[ssl.SSLContext, Path]:
    """A server TLS context for 127.0.0.1 and the CA file that verifies it."""
    ca = CertificateAuthority.load_or_create(folder / "ca")
    cert, key = folder / "desk.pem", folder / "desk.key"
    ca.issue_server_certificate(["127.0.0.1"], cert, key)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ca.cert_path


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This environment without berth's settings, plus ``extra``; ``COLUMNS`` fixed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERTH_", "HF_"))}
    env["COLUMNS"] = "160"
    env.update(extra)
    return env


class Berth:
    """The real ``berth`` CLI on one home."""

    def __init__(self, home: Path, *, env: Mapping[str, str], cwd: Path) -> None:
        self.home = home
        self.env = dict(env)
        self.cwd = cwd

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "berth", "--home", str(self.home), *args]

    def __call__(
        self, *args: str, check: bool = True, timeout_s: float = 300
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(self.argv(*args), capture_output=True, text=True,
                                timeout=timeout_s, env=self.env, cwd=self.cwd)  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(
                f"berth {' '.join(args)} exited {result.returncode}\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def fails(self, *args: str, exit_code: int) -> str:
        """Run a command that must fail with exactly one ``error:`` line; return it."""
        result = self(*args, check=False)
        assert result.returncode == exit_code, (result.returncode, result.stderr)
        assert result.stdout == ""
        assert result.stderr.startswith("error: "), result.stderr
        assert result.stderr.count("\n") == 1, f"not one line: {result.stderr!r}"
        return result.stderr.strip()


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
