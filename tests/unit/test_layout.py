"""The folders say what they hold (docs/architecture.md "Layers"): every module's file name is
unique across the product's packages, so a name says which module it is, and no module imports
another module's private names (`_name`): what crosses a module boundary is public and documented.
The import directions themselves are the import-linter contracts (test_import_contracts.py)."""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = tuple(name for name in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
                 ["root_packages"] if name != "schemas")


def _modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


def test_the_layout_names_every_package():
    assert {"domain", "tapeline", "cli", "regions", "devstack", "processors", "producers", "projections"} <= set(PACKAGES)
    assert len(_modules()) > 100


def test_no_two_modules_share_a_file_name():
    where: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        if path.name != "__init__.py":
            where[path.name].append(str(path.relative_to(REPO)))
    twins = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twins, f"modules with the same file name: {twins}"


def private_imports(source: str) -> list[str]:
    """`from package.module import _name` statements (absolute imports of a project package) in
    `source`, as "module:_name" strings; dunder names are not private."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PACKAGES:
            found += [f"{node.module}:{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_private_imports_are_found():
    assert private_imports("from tapeline.home import _paths, locked\nfrom os import _exit\n") == ["tapeline.home:_paths"]
    assert private_imports("from tapeline.settings import __doc__\n") == []


def test_no_module_imports_another_modules_private_names():
    offenders = {str(path.relative_to(REPO)): names for path in _modules()
                 if (names := private_imports(path.read_text()))}
    assert not offenders, f"imports of private names: {offenders}"
