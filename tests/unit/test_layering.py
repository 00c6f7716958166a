"""Imports go one way: protocol <- peer, coordinator <- scripts, tests; and no production module reaches the test
harness (protocol.testing) except the peer's one opt-in point, peer.training.harness_hooks."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def _modules(path: Path) -> set[str]:
    """Every module a file imports, by full dotted name (lazy imports inside functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_production_code_never_reaches_the_test_harness() -> None:
    harness = ROOT / "protocol" / "testing"
    offenders = []
    for package in ("protocol", "peer", "coordinator", "scripts"):
        for path in (ROOT / package).rglob("*.py"):
            if harness in path.parents:
                continue
            if any(m.startswith("protocol.testing") for m in _modules(path)):
                offenders.append(str(path.relative_to(ROOT)))
    # The peer's one opt-in point: it loads the fault injector only when a harness sets SWARMLOCO_FAULTS.
    assert offenders == ["peer/training.py"], offenders
    assert "protocol.testing" not in "".join((ROOT / "peer" / "training.py").read_text().split("def harness_hooks")[0])
