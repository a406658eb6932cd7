"""The vocabulary is a leaf (``berth/vocab/``, ``docs/architecture.md``): the pure deciders and
the admin API's contract import it without the store's SQLAlchemy or the GPU inventory's NVML,
and the vocabulary itself loads nothing beyond the standard library (and, of berth, only the
base layer's modules, which load nothing more either).

Each probe runs in a fresh interpreter: this test process has imported most of berth already,
which would hide what an import pulls in.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import berth.vocab

#: Imports the modules named on its command line and prints, as JSON, every module then loaded.
PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""

#: What a process that decides or serves must not pay for at import.
MACHINERY = ("sqlalchemy", "pynvml")


def _loaded(*modules: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *modules],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded: list[str] = json.loads(done.stdout)
    return loaded


def _top(name: str) -> str:
    return name.partition(".")[0]


@pytest.mark.parametrize(
    "module",
    ["berth.placement", "berth.scaling.decisions", "berth.routing.router", "berth.api"],
)
def test_deciders_and_the_api_load_no_store_and_no_nvml(module: str) -> None:
    loaded = _loaded(module)
    assert [name for name in loaded if _top(name) in MACHINERY] == []
    assert not [name for name in loaded if name == "berth.store" or name == "berth.runtime.gpu"]


def test_the_vocabulary_loads_only_the_standard_library() -> None:
    modules = [f"berth.vocab.{info.name}" for info in pkgutil.iter_modules(berth.vocab.__path__)]
    assert "berth.vocab.records" in modules
    loaded = _loaded(*modules)
    berth_modules = {name for name in loaded if _top(name) == "berth"}
    # Beside itself, only the base layer's errors (a key's Tier and Role are the vocabulary's
    # own since issue 39, so the key hashing and the atomic file writes stay out).
    assert berth_modules <= {"berth", "berth.errors", *modules, "berth.vocab"}
    bare = set(_loaded())  # what the interpreter itself starts with
    foreign = [
        name
        for name in set(loaded) - bare
        if _top(name) not in sys.stdlib_module_names and _top(name) != "berth"
    ]
    assert foreign == []
