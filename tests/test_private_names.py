"""No test, e2e or benchmark module reaches another module's private name: neither `from M import _x` nor `m._x`
for a module or class `m` it imported. What a test needs of a module is its interface; a helper shared between
test modules is public in the module that defines it. The standard library's underscore names (`os._exit`) are
its public interface and are allowed."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("tests", "e2e", "benchmarks")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def reaches(source: str) -> list[str]:
    """The private names SOURCE takes from the modules (and their members) it imports, as `line: what`."""
    tree = ast.parse(source)
    imported: set[str] = set()   # names bound by an import, other than the standard library's
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names
                            if a.name.split(".")[0] not in sys.stdlib_module_names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in sys.stdlib_module_names:
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                imported.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in imported):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(found)


def test_the_check_finds_both_ways_of_reaching_a_private_name() -> None:
    source = ("import os\nimport launcher\nfrom test_pods import _runner, runner\nfrom tensorfleet.sim import calibrate\n"
              "os._exit(0)\nlauncher._gpu_side()\ncalibrate._Client\ncalibrate.Client\nself._own\n")
    assert reaches(source) == ["3: from test_pods import _runner", "6: launcher._gpu_side", "7: calibrate._Client"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_reaches_a_private_name_of_another(folder: str) -> None:
    found = {str(path.relative_to(ROOT)): hits for path in sorted((ROOT / folder).glob("*.py"))
             if (hits := reaches(path.read_text()))}
    assert not found, found
