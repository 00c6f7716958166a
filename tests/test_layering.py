"""Imports go one way (DESIGN §2): protocol <- peer, coordinator <- scripts, tests."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "protocol": {"protocol"},
    "peer": {"peer", "protocol"},
    "coordinator": {"coordinator", "protocol"},
    "scripts": {"scripts", "peer", "coordinator", "protocol"},
}
PROJECT = set(ALLOWED) | {"tests"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & PROJECT


def test_imports_go_one_way() -> None:
    violations = []
    for package, allowed in ALLOWED.items():
        files = list((ROOT / package).rglob("*.py"))
        assert files, f"package {package}/ is missing"
        for path in files:
            for imported in _imports(path) - allowed:
                violations.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not violations, "layering violations:\n" + "\n".join(violations)
