"""berth's package graph is layered and has no import cycle.

:data:`LAYERS` is the one table of layers; ``docs/architecture.md`` mirrors it (a test below
keeps the two equal). Read bottom up, a module may import

* any module of its own unit (a package such as ``cluster.protocol``, or one module of the
  base layer), and
* any module of a unit in a lower layer.

Units that share a layer are independent: neither imports the other. The base layer is the
exception: its modules may use each other. Every import statement counts, wherever it is: at
module level, inside a function, or under ``if TYPE_CHECKING:`` (a type-only import still ties
the two modules together for a reader). Separately, no set of modules imports itself in a
circle, within a package or across them.

A new package or top-level module must be given a layer here before it can be imported.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "berth"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"

#: The modules every layer may use: no berth imports beyond each other.
BASE: tuple[str, ...] = (
    "__init__",
    "errors",
    "paths",
    "config_toml",
    "keys",
    "eventloop",
    "atomic",
    "humanize",
    "openai_errors",
    "anthropic_errors",
    "conforms",
    "redact",
    "unit_files",
    "backoff",
    "restart_backoff",
)

#: berth's layers, bottom up. A name is relative to ``berth``: a package (``cluster.protocol``
#: holds every module under it), a module (``config``), or ``__init__`` for ``berth`` itself.
#: A module belongs to the longest name that holds it, so ``cluster.protocol.frames`` is in
#: ``cluster.protocol``, not ``cluster``. Why this order: ``docs/architecture.md``, Layers.
LAYERS: tuple[tuple[str, ...], ...] = (
    BASE,
    ("vocab", "weights", "host"),
    ("runtime", "engine_http", "http_server", "cluster.protocol", "store", "api", "placement"),
    ("config", "cluster.link", "cluster.wire_forms"),
    ("admission", "observability", "cluster.pki"),
    ("cluster.leader", "cluster", "auth"),
    ("agent", "routing"),
    ("scaling",),
    ("doctor", "desk", "backup", "console"),
    ("deployments",),
    ("gateway", "admin"),
    ("daemon",),
    ("cli",),
    ("__main__",),
)


@dataclass(frozen=True)
class Import:
    """One imported berth module: ``importer`` (a module name relative to ``berth``) imports
    ``imported`` at ``line`` of ``path``."""

    importer: str
    imported: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_names(source: Path) -> dict[str, Path]:
    """Every module under ``source`` (the ``berth`` package folder), by its name relative to
    ``berth`` (``cluster.leader.hub``; a package by its own name; ``berth`` itself as
    ``__init__``)."""
    names: dict[str, Path] = {}
    for path in sorted(source.rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        names[".".join(parts)] = path
    return names


def _absolute(name: str) -> str:
    return "berth" if name == "__init__" else f"berth.{name}"


def _relative(dotted: str) -> str | None:
    if dotted == "berth":
        return "__init__"
    if dotted.startswith("berth."):
        return dotted[len("berth.") :]
    return None


def find_imports(source: Path) -> list[Import]:
    """Every import of a berth module by a module under ``source``, wherever it stands.

    ``from berth.x import y`` imports ``x.y`` when that is a module, else ``x``; relative
    imports are resolved against the importing module's package.
    """
    modules = module_names(source)
    found: list[Import] = []
    for importer, path in modules.items():
        shown = path.relative_to(source.parent.parent)  # src/berth/...
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        package_dotted = _absolute(package) if package else "berth"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package_dotted.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    dotted = ".".join([*base, node.module] if node.module else base)
                else:
                    dotted = node.module or ""
                for alias in node.names:
                    inner = _relative(f"{dotted}.{alias.name}")
                    targets.append(f"{dotted}.{alias.name}" if inner in modules else dotted)
            for target in dict.fromkeys(targets):  # once per module a statement imports
                imported = _relative(target)
                if imported is not None and imported != importer:
                    found.append(Import(importer, imported, shown, node.lineno))
    return found


def unit_of(name: str, layers: Sequence[tuple[str, ...]]) -> str | None:
    """The table's name that holds module ``name`` (the longest), or ``None``."""
    best: str | None = None
    for units in layers:
        for unit in units:
            holds = name == unit or name.startswith(unit + ".")
            if holds and (best is None or len(unit) > len(best)):
                best = unit
    return best


def _layer_of(unit: str, layers: Sequence[tuple[str, ...]]) -> int:
    return next(i for i, units in enumerate(layers) if unit in units)


def _label(unit: str, layers: Sequence[tuple[str, ...]], base: tuple[str, ...]) -> str:
    """``routing (layer 9: agent | routing)``, ``daemon (layer 11)``, ``errors (layer 1: base)``."""
    index = _layer_of(unit, layers)
    units = layers[index]
    shared = "base" if units is base else " | ".join(units) if len(units) > 1 else ""
    return f"{unit} (layer {index + 1}{': ' + shared if shared else ''})"


def layer_violations(
    imports: Iterable[Import],
    layers: Sequence[tuple[str, ...]] = LAYERS,
    base: tuple[str, ...] = BASE,
) -> list[str]:
    """One line per import that goes up the table, or across to an independent unit of the
    same layer, or that involves a module in no layer."""
    problems: list[str] = []
    for imp in imports:
        units = unit_of(imp.importer, layers), unit_of(imp.imported, layers)
        if units[0] is None or units[1] is None:
            stray = _absolute(imp.importer if units[0] is None else imp.imported)
            problems.append(
                f"{imp.where()}: {_absolute(imp.importer)} imports {_absolute(imp.imported)}, "
                f"but {stray} is in no layer: give its package a place in LAYERS "
                f"(tests/test_layers.py) and in docs/architecture.md"
            )
            continue
        if units[0] == units[1]:
            continue
        own, other = _layer_of(units[0], layers), _layer_of(units[1], layers)
        if other < own or (other == own and layers[own] is base):
            continue
        direction = "a higher layer" if other > own else "independent of it in the same layer"
        problems.append(
            f"{imp.where()}: {_absolute(imp.importer)} imports {_absolute(imp.imported)}: "
            f"{_label(units[0], layers, base)} may not import from "
            f"{_label(units[1], layers, base)}, {direction}"
        )
    return problems


def import_cycles(imports: Iterable[Import]) -> list[str]:
    """One line per set of modules that import each other in a circle, showing one circle
    through it edge by edge (``a (path:line) -> b (path:line) -> a``)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        edges.setdefault(imp.importer, {}).setdefault(imp.imported, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    lines = []
    for component in components:
        start = min(component)
        # The shortest way back to start inside the component is one concrete circle.
        previous: dict[str, Import] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for node in frontier:
                for nxt, imp in sorted(edges.get(node, {}).items()):
                    if nxt in component and nxt not in previous:
                        previous[nxt] = imp
                        following.append(nxt)
            frontier = following
        circle = [previous[start]]
        while circle[-1].importer != start:
            circle.append(previous[circle[-1].importer])
        circle.reverse()
        hops = " -> ".join(f"{_absolute(i.importer)} ({i.where()})" for i in circle)
        lines.append(f"import cycle among {len(component)} modules: {hops} -> {_absolute(start)}")
    return lines


def package_of(name: str, modules: dict[str, Path], *, top: bool) -> str:
    """The package that holds module ``name``: its folder (``cluster.leader.hub`` ->
    ``cluster.leader``; a package's ``__init__`` is its own), or with ``top`` the folder
    right under ``berth`` (``cluster``). A module directly under ``berth`` (``errors``,
    ``__main__``) is a unit of its own."""
    path = modules[name]
    if name == "__init__" or ("." not in name and path.name != "__init__.py"):
        return name
    folder = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return folder.partition(".")[0] if top else folder


def package_imports(
    imports: Iterable[Import], modules: dict[str, Path], *, top: bool
) -> list[Import]:
    """``imports`` with each module replaced by its package (:func:`package_of`), those
    inside one package dropped: the graph whose circles are package cycles."""
    found = []
    for imp in imports:
        importer = package_of(imp.importer, modules, top=top)
        imported = package_of(imp.imported, modules, top=top)
        if importer != imported:
            found.append(Import(importer, imported, imp.path, imp.line))
    return found


def documented_layers(doc: str) -> list[tuple[str, ...]]:
    """The layer table of ``docs/architecture.md``: the backticked names of the second column
    of each row of the first table under the heading ``## Layers``, bottom up."""
    section = doc.split("\n## Layers", 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= set("-: "):
            continue
        names = tuple(re.findall(r"`([^`]+)`", cells[1]))
        if names:
            rows.append(names)
    return rows


# -- the tree --------------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    stray = [name for name in module_names(SOURCE) if unit_of(name, LAYERS) is None]
    assert not stray, f"modules in no layer of LAYERS (tests/test_layers.py): {stray}"


def test_no_import_goes_up_the_layers() -> None:
    problems = layer_violations(find_imports(SOURCE))
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_no_modules_import_each_other_in_a_circle() -> None:
    cycles = import_cycles(find_imports(SOURCE))
    assert not cycles, "\n".join(cycles)


def test_no_packages_import_each_other_in_a_circle() -> None:
    """Counting every import, no folders use each other in a circle: neither the packages
    right under ``berth`` (``cluster`` with all its parts) nor any package folder
    (``cluster.leader``, ``cluster.pki`` ...)."""
    imports = find_imports(SOURCE)
    modules = module_names(SOURCE)
    for top in (True, False):
        cycles = import_cycles(package_imports(imports, modules, top=top))
        assert not cycles, "\n".join(cycles)


def test_the_architecture_doc_mirrors_the_table() -> None:
    assert documented_layers(ARCHITECTURE_DOC.read_text()) == [tuple(u) for u in LAYERS]


def test_every_package_opens_with_a_docstring_stating_its_job() -> None:
    missing = []
    for init in sorted(SOURCE.rglob("__init__.py")):
        package = ".".join(init.parent.relative_to(SOURCE.parent).parts)
        if not ast.get_docstring(ast.parse(init.read_text())):
            missing.append(package)
    assert not missing, f"packages without a docstring saying what they own: {missing}"


# -- the checks themselves, on a small tree ----------------------------------------------------

TINY_BASE = ("__init__", "errors")
TINY_LAYERS = (TINY_BASE, ("store",), ("api", "placement"), ("daemon",))


def _tree(root: Path, files: dict[str, str]) -> Path:
    source = root / "src" / "berth"
    for name, text in files.items():
        path = source / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return source


def test_the_check_sees_type_checking_function_and_relative_imports(tmp_path: Path) -> None:
    source = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "from berth import __version__\n",
            "store/__init__.py": "",
            "store/records.py": (
                "from typing import TYPE_CHECKING\n"
                "from berth.errors import ConfigError\n"
                "if TYPE_CHECKING:\n"
                "    from berth.daemon.lifecycle import LifecycleManager, Reconciler\n"
                "def later():\n"
                "    from ..daemon import lifecycle\n"
            ),
            "api/__init__.py": "import berth.placement.plan\n",
            "placement/__init__.py": "",
            "placement/plan.py": "",
            "daemon/__init__.py": "",
            "daemon/lifecycle.py": "from berth.store import records\n",
        },
    )
    problems = sorted(layer_violations(find_imports(source), TINY_LAYERS, TINY_BASE))
    assert problems == [
        "src/berth/api/__init__.py:1: berth.api imports berth.placement.plan: api (layer 3: "
        "api | placement) may not import from placement (layer 3: api | placement), "
        "independent of it in the same layer",
        "src/berth/store/records.py:4: berth.store.records imports berth.daemon.lifecycle: "
        "store (layer 2) may not import from daemon (layer 4), a higher layer",
        "src/berth/store/records.py:6: berth.store.records imports berth.daemon.lifecycle: "
        "store (layer 2) may not import from daemon (layer 4), a higher layer",
    ]


def test_the_check_names_a_module_in_no_layer(tmp_path: Path) -> None:
    source = _tree(tmp_path, {"__init__.py": "", "store/x.py": "import berth.unknown\n"})
    (problem,) = layer_violations(find_imports(source), TINY_LAYERS, TINY_BASE)
    assert "berth.unknown is in no layer" in problem


def test_the_check_finds_a_cycle_and_shows_it(tmp_path: Path) -> None:
    source = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "daemon/__init__.py": "",
            "daemon/a.py": "from berth.daemon.b import B\n",
            "daemon/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
            ),
            "daemon/c.py": "from berth.daemon import a\n",
        },
    )
    (cycle,) = import_cycles(find_imports(source))
    assert cycle == (
        "import cycle among 2 modules: berth.daemon.a (src/berth/daemon/a.py:1) -> "
        "berth.daemon.b (src/berth/daemon/b.py:3) -> berth.daemon.a"
    )


def test_the_daemon_split_is_layered_one_way(tmp_path: Path) -> None:
    """On the real table: the deployment manager may not reach up into the request path, the
    request path and the admin routes (independent, in one layer) may not use each other,
    and neither may reach into the daemon: not even its object graph (``daemon.graph``),
    since each admin router takes the objects it uses."""
    source = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "deployments/__init__.py": "",
            "deployments/lifecycle.py": "from berth.gateway.proxy import OpenAIProxy\n",
            "gateway/__init__.py": "",
            "gateway/proxy.py": "from berth.deployments import lifecycle\n",
            "gateway/auth.py": "from berth.admin.app import build_admin_app\n",
            "admin/__init__.py": "",
            "admin/app.py": "from berth.daemon.graph import LeaderGraph\n",
            "admin/keys.py": "from berth.daemon.server import serve\n",
            "daemon/__init__.py": "",
            "daemon/graph.py": "from berth.gateway import proxy\n",
            "daemon/server.py": "from berth.admin import app\nfrom berth.daemon import graph\n",
        },
    )
    problems = sorted(layer_violations(find_imports(source)))
    assert problems == [
        "src/berth/admin/app.py:1: berth.admin.app imports berth.daemon.graph: "
        "admin (layer 11: gateway | admin) may not import from daemon (layer 12), "
        "a higher layer",
        "src/berth/admin/keys.py:1: berth.admin.keys imports berth.daemon.server: "
        "admin (layer 11: gateway | admin) may not import from daemon (layer 12), "
        "a higher layer",
        "src/berth/deployments/lifecycle.py:1: berth.deployments.lifecycle imports "
        "berth.gateway.proxy: deployments (layer 10) may not import from gateway (layer 11: "
        "gateway | admin), a higher layer",
        "src/berth/gateway/auth.py:1: berth.gateway.auth imports berth.admin.app: "
        "gateway (layer 11: gateway | admin) may not import from admin (layer 11: gateway | "
        "admin), independent of it in the same layer",
    ]


def test_the_cluster_parts_are_layered_one_way(tmp_path: Path) -> None:
    """On the real table: the link adapter may use neither the certificates nor the leader's
    side, the certificates may not use the leader's side, and the wire forms (both ends') may
    not use the link adapter beside them; the leader's side may use them all."""
    source = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "cluster/__init__.py": "",
            "cluster/link/__init__.py": "",
            "cluster/link/connection.py": "from berth.cluster.pki import ca\n",
            "cluster/link/liveness.py": "from berth.cluster.leader.hub import NodeHub\n",
            "cluster/pki/__init__.py": "",
            "cluster/pki/ca.py": "from berth.cluster.leader import listener\n",
            "cluster/wire_forms.py": "from berth.cluster.link.connection import LinkConnection\n",
            "cluster/leader/__init__.py": "",
            "cluster/leader/listener.py": "",
            "cluster/leader/hub.py": (
                "from berth.cluster.link import connection\nfrom berth.cluster.pki import ca\n"
                "from berth.cluster import wire_forms\n"
            ),
        },
    )
    problems = sorted(layer_violations(find_imports(source)))
    assert problems == [
        "src/berth/cluster/link/connection.py:1: berth.cluster.link.connection imports "
        "berth.cluster.pki.ca: cluster.link (layer 4: config | cluster.link | "
        "cluster.wire_forms) may not import from cluster.pki (layer 5: admission | "
        "observability | cluster.pki), a higher layer",
        "src/berth/cluster/link/liveness.py:1: berth.cluster.link.liveness imports "
        "berth.cluster.leader.hub: cluster.link (layer 4: config | cluster.link | "
        "cluster.wire_forms) may not import from cluster.leader (layer 6: cluster.leader | "
        "cluster | auth), a higher layer",
        "src/berth/cluster/pki/ca.py:1: berth.cluster.pki.ca imports "
        "berth.cluster.leader.listener: cluster.pki (layer 5: admission | observability | "
        "cluster.pki) may not import from cluster.leader (layer 6: cluster.leader | cluster "
        "| auth), a higher layer",
        "src/berth/cluster/wire_forms.py:1: berth.cluster.wire_forms imports "
        "berth.cluster.link.connection: cluster.wire_forms (layer 4: config | cluster.link | "
        "cluster.wire_forms) may not import from cluster.link (layer 4: config | "
        "cluster.link | cluster.wire_forms), independent of it in the same layer",
    ]


def test_the_check_finds_a_package_cycle_with_no_module_cycle(tmp_path: Path) -> None:
    """Two packages that use each other through different modules: no module circle, but a
    package one, at the top and at the folder level."""
    source = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "",
            "cluster/__init__.py": "",
            "cluster/leader/__init__.py": "",
            "cluster/leader/hub.py": "from berth.observability.series import Series\n",
            "cluster/protocol/__init__.py": "",
            "cluster/protocol/frames.py": "from berth import errors\n",
            "observability/__init__.py": "",
            "observability/series.py": "from berth.cluster.protocol.frames import Heartbeat\n",
        },
    )
    imports = find_imports(source)
    modules = module_names(source)
    assert import_cycles(imports) == []
    assert import_cycles(package_imports(imports, modules, top=False)) == []
    (cycle,) = import_cycles(package_imports(imports, modules, top=True))
    assert cycle == (
        "import cycle among 2 modules: berth.cluster (src/berth/cluster/leader/hub.py:1) -> "
        "berth.observability (src/berth/observability/series.py:1) -> berth.cluster"
    )
