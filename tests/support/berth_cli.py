"""The real ``berth`` CLI as a user runs it (``python -m berth --home HOME ...`` in a
subprocess), for the tests that drive one leader daemon through it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from berth.runtime.engines import find_free_port


class Berth:
    """The real ``berth`` CLI for one home, with a fixed environment and working folder.

    ``timeout_s`` bounds each command (a ``berth run`` of the real engine waits for it to
    load).
    """

    def __init__(
        self, home: Path, *, env: Mapping[str, str], cwd: Path, timeout_s: float = 120
    ) -> None:
        self.home = home
        self.env = dict(env)
        self.cwd = cwd
        self.timeout_s = timeout_s

    def argv(self, *args: str) -> list[str]:
        """The command line of ``berth --home HOME ARGS...`` with this interpreter."""
        return [sys.executable, "-m", "berth", "--home", str(self.home), *args]

    def __call__(
        self,
        *args: str,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            env={**self.env, **(env or {})},
            cwd=cwd or self.cwd,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"berth {' '.join(args)} exited {result.returncode}\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "--json").stdout)

    def admin(self, method: str, path: str, **kwargs: Any) -> Any:
        """Call the daemon's admin API over its socket (to set up or check state quickly)."""
        transport = httpx.HTTPTransport(uds=str(self.home / "berth.sock"), verify=False)
        with httpx.Client(transport=transport, base_url="http://berth", timeout=30.0) as api:
            response = api.request(method, path, **kwargs)
        response.raise_for_status()
        return response.json()

    def add_model(self, name: str, path: Path) -> None:
        self.admin("POST", "/admin/models", json={"name": name, "path": str(path)})

    def deployments(self) -> list[dict[str, Any]]:
        """Every deployment, stopped and failed ones included."""
        records: list[dict[str, Any]] = self.admin("GET", "/admin/deployments")
        return records

    def fails(
        self, *args: str, exit_code: int | None = None, env: Mapping[str, str] | None = None
    ) -> str:
        """Run a command that must fail with one ``error:`` line; return that line."""
        result = self(*args, check=False, env=env)
        assert result.returncode != 0, f"berth {' '.join(args)} succeeded: {result.stdout}"
        if exit_code is not None:
            assert result.returncode == exit_code, result.stderr
        assert result.stdout == ""
        assert result.stderr.startswith("error: "), result.stderr
        assert result.stderr.count("\n") == 1, f"not one line: {result.stderr!r}"
        return result.stderr.strip()


@contextlib.contextmanager
def running_daemon(berth: Berth) -> Iterator[int]:
    """``berth daemon start`` on free ports; yields the public port; ``berth daemon stop``
    on exit (also when the start failed half-way)."""
    port = find_free_port()
    try:
        started = berth(
            "daemon", "start", "--public-port", str(port), "--cluster-port", str(find_free_port())
        )
        assert "berth leader running" in started.stdout, started.stdout
        yield port
    finally:
        berth("daemon", "stop", check=False)
