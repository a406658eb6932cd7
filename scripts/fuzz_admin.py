"""Fuzz the admin API with schemathesis over its own schema, ``/admin/openapi.json``.

Issue 38 asks that schemathesis, with every phase and every check, finds nothing in the admin
API: no server error, no answer that breaks the schema, no schema-valid request refused, no
405 without ``Allow``, and no traceback in the leader's log. This script is that run, with
real parts set up by berth's own CLI in a throw-away home:

* a leader-only leader (``berth daemon start``: no engines are started, so a fuzzed
  deployment is refused by the leader instead of launching one), on free loopback ports,
  with ``HF_ENDPOINT`` on a closed loopback port (a fuzzed pull fails at once instead of
  reaching out);
* one admin key (``berth key create --tier admin``), sent by schemathesis in
  ``Authorization: Bearer``, over HTTPS with the home's CA trusted;
* ``st run`` (schemathesis' CLI, from this interpreter's ``bin``) with ``--checks all``, the
  hooks of ``scripts/fuzz_admin_hooks.py`` (the few rules JSON Schema cannot state), and
  the phases asked for (all four by default: examples, coverage, fuzzing, stateful), at most
  ``--examples`` cases an operation, its JSON report kept;
* then the leader's log, ``HOME/logs/daemon.log``, is searched for ``Traceback``.

Left out: ``POST /admin/shutdown`` and ``POST /admin/leader/step-down`` (each ends the
leader under test), and ``POST /admin/ca/rotate`` and ``/admin/ca/retire`` (a rotation makes
a new root that the fuzzer's trust store does not hold, so the rest of the run could not
connect); their refusals are tested in ``tests/test_ca_rotation.py`` and
``tests/test_leadership.py``.

Prints a table (operations, cases, phases, failures by check, tracebacks, seconds) and exits
0 only when every count of trouble is 0. ``--report-dir`` keeps schemathesis' JSON report
and the leader's log (by default in a temporary folder, removed afterwards).

Run: ``.venv/bin/python scripts/fuzz_admin.py [--examples 25] [--phases all] [--seed N]
[--workers 1] [--report-dir DIR]``. More than one worker thread can trip
python/cpython#106905 (a ``SystemError`` in ``ast.parse`` run in two threads at once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: Every schemathesis phase, in the order it runs them.
PHASES = ("examples", "coverage", "fuzzing", "stateful")
#: Operations the run leaves out, and why: see the module docstring.
EXCLUDED_PATHS = (
    "/admin/shutdown",
    "/admin/leader/step-down",
    "/admin/ca/rotate",
    "/admin/ca/retire",
)


@dataclass(frozen=True)
class FuzzResult:
    """What one run found: operations tested, cases generated, the phases and how each
    ended, failures by schemathesis' code and title, errors (a case that could not be sent),
    the tracebacks in the leader's log, and the run's seconds."""

    operations: int
    cases: int
    phases: dict[str, str]
    failures: dict[str, int]
    errors: int
    tracebacks: int
    seconds: float
    seed: int | None

    @property
    def clean(self) -> bool:
        """Whether the run found nothing at all."""
        return not self.failures and not self.errors and not self.tracebacks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERTH_", "HF_"))}
    env["BERTH_LEADER_ONLY"] = "1"
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    return env


def _berth(home: Path, env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "berth", "--home", str(home), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    if result.returncode != 0:
        raise SystemExit(f"berth {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result.stdout


@contextlib.contextmanager
def _leader(home: Path, env: dict[str, str]) -> Iterator[tuple[int, str]]:
    """A leader daemon on ``home``: yields its public port and an admin key's secret."""
    port = _free_port()
    _berth(
        home,
        env,
        "daemon",
        "start",
        "--public-port",
        str(port),
        "--cluster-port",
        str(_free_port()),
    )
    try:
        created = json.loads(
            _berth(home, env, "key", "create", "fuzz", "--tier", "admin", "--json")
        )
        yield port, str(created["secret"])
    finally:
        subprocess.run(
            [sys.executable, "-m", "berth", "--home", str(home), "daemon", "stop"],
            capture_output=True,
            timeout=60,
            env=env,
        )


def _model_file(folder: Path) -> Path:
    """A small file with the GGUF magic, for the hooks' valid model registrations."""
    path = folder / "fuzz.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def _schemathesis() -> str:
    found = Path(sys.executable).parent / "st"
    if not found.exists():
        raise SystemExit(f"schemathesis is not installed beside {sys.executable} (pip: '.[dev]')")
    return str(found)


def run_fuzz(
    *,
    examples: int,
    phases: tuple[str, ...],
    seed: int | None,
    workers: int,
    report_dir: Path,
    max_time_s: float | None = None,
) -> FuzzResult:
    """Start a leader in a temporary home, fuzz its admin API, stop it; see the module
    docstring. ``report_dir`` receives ``schemathesis.json`` (the run's JSON report),
    ``schemathesis.txt`` (its output) and ``daemon.log``."""
    report_dir.mkdir(parents=True, exist_ok=True)
    env = _environment()
    with tempfile.TemporaryDirectory(prefix="berth-fuzz-") as scratch:
        home = Path(scratch) / "home"
        with _leader(home, env) as (port, secret):
            argv = [
                _schemathesis(),
                "run",
                f"https://127.0.0.1:{port}/admin/openapi.json",
                "--header",
                f"Authorization: Bearer {secret}",
                "--tls-verify",
                str(home / "ca" / "ca.pem"),
                "--checks",
                "all",
                "--phases",
                ",".join(phases),
                "--max-examples",
                str(examples),
                "--workers",
                str(workers),
                "--continue-on-failure",
                "--report",
                "json",
                "--report-json-path",
                str(report_dir / "schemathesis.json"),
            ]
            for path in EXCLUDED_PATHS:
                argv += ["--exclude-path", path]
            if seed is not None:
                argv += ["--seed", str(seed)]
            if max_time_s is not None:
                argv += ["--max-time", str(max_time_s)]
            # The rules JSON Schema cannot state (scripts/fuzz_admin_hooks.py).
            hooks_env = {
                **env,
                "SCHEMATHESIS_HOOKS": "fuzz_admin_hooks",
                "BERTH_FUZZ_MODEL_FILE": str(_model_file(Path(scratch))),
                "PYTHONPATH": os.pathsep.join(
                    [str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]
                ),
            }
            _log(f"schemathesis: {len(phases)} phases, {examples} examples an operation")
            started = time.monotonic()
            with (report_dir / "schemathesis.txt").open("w") as output:
                subprocess.run(
                    argv,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=hooks_env,
                    cwd=scratch,
                    check=False,
                )
            seconds = time.monotonic() - started
        log = home / "logs" / "daemon.log"
        shutil.copyfile(log, report_dir / "daemon.log")
        tracebacks = log.read_text(errors="replace").count("Traceback")
    report = json.loads((report_dir / "schemathesis.json").read_text())
    return FuzzResult(
        operations=int(report["operations"]["tested"]),
        cases=int(report["test_cases"]["generated"]),
        phases={name: str(phase["status"]) for name, phase in report["phases"].items()},
        failures={f"{x['code']} {x['title']}": int(x["count"]) for x in report["failures"]},
        errors=len(report["errors"]),
        tracebacks=tracebacks,
        seconds=seconds,
        seed=report.get("seed"),
    )


def print_table(result: FuzzResult) -> None:
    """The run as a two-column table, then each failure kind on a line."""
    rows = [
        ("operations tested", str(result.operations)),
        ("cases generated", str(result.cases)),
        ("phases", ", ".join(f"{k} {v}" for k, v in result.phases.items())),
        ("failures", str(sum(result.failures.values()))),
        ("errors", str(result.errors)),
        ("tracebacks in the leader's log", str(result.tracebacks)),
        ("seconds", f"{result.seconds:.1f}"),
        ("seed", str(result.seed)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for kind, count in sorted(result.failures.items()):
        print(f"  {count:>4}  {kind}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=25, help="cases per operation")
    parser.add_argument(
        "--phases", default="all", help=f"comma-separated, of {', '.join(PHASES)}; or all"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-time-s", type=float, default=None)
    parser.add_argument("--report-dir", type=Path, default=None)
    args = parser.parse_args()
    phases = PHASES if args.phases == "all" else tuple(args.phases.split(","))
    with tempfile.TemporaryDirectory(prefix="berth-fuzz-report-") as fallback:
        report_dir = args.report_dir or Path(fallback)
        result = run_fuzz(
            examples=args.examples,
            phases=phases,
            seed=args.seed,
            workers=args.workers,
            report_dir=report_dir,
            max_time_s=args.max_time_s,
        )
        print_table(result)
        if not result.clean:
            print((report_dir / "schemathesis.txt").read_text()[-20000:], file=sys.stderr)
    sys.exit(0 if result.clean else 1)


if __name__ == "__main__":
    main()
