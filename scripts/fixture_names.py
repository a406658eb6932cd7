"""List pytest fixture names defined in more than one file under ``tests/``.

A fixture shared by modules belongs in ``tests/conftest.py``; a module's own fixture has a
name of its own (docs/testing.md). Prints the count of fixtures and each name defined in two
or more files, with the files; exits 1 when there is one. Run:
``.venv/bin/python scripts/fixture_names.py``.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tests"


def is_fixture(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
    return False


def main() -> int:
    files_of: dict[str, list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and is_fixture(node):
                files_of[node.name].append(str(path.relative_to(ROOT)))
    repeated = {name: files for name, files in files_of.items() if len(files) > 1}
    total = sum(len(files) for files in files_of.values())
    print(f"{total} fixtures, {len(files_of)} names, {len(repeated)} defined in 2+ files")
    for name, files in sorted(repeated.items(), key=lambda item: -len(item[1])):
        print(f"  {name}: {', '.join(files)}")
    return 1 if repeated else 0


if __name__ == "__main__":
    sys.exit(main())
