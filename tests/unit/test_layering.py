"""The import rules that keep the architecture readable, checked on the source:

- one installed name: product code imports `swarmloco.*`, never a bare `peer`, `coordinator` or `protocol`;
- packages import one way: protocol <- peer, coordinator <- the commands (swarmloco/) <- scripts, tests;
- protocol's layers import downwards only: base <- trust <- network <- chain <- round <- testing;
- no import circles between modules;
- no production module reaches the test harness (swarmloco.protocol.testing) except the peer's one opt-in point,
  peer.training.harness_hooks.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"protocol": "protocol", "peer": "peer", "coordinator": "coordinator", "swarmloco": "commands",
           "scripts": "scripts"}
ALLOWED = {
    "protocol": {"protocol"},
    "peer": {"peer", "protocol"},
    "coordinator": {"coordinator", "protocol"},
    "commands": {"commands", "peer", "coordinator", "protocol"},
    "scripts": {"scripts", "commands", "peer", "coordinator", "protocol"},
}
LAYERS = ["base", "trust", "network", "chain", "round", "testing"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in ("peer", "coordinator", "protocol"):
        parts.insert(0, "swarmloco")
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = {}
    for folder in FOLDERS:
        found = list((ROOT / folder).rglob("*.py"))
        assert found, f"{folder}/ is missing"
        files.update({_module_name(p): p for p in found})
    return files


def _imports(path: Path) -> set[str]:
    """Every module a file imports, by full dotted name (imports inside functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _group(module: str) -> str | None:
    """Which package a dotted module name belongs to, by the rules above (None: not ours)."""
    parts = module.split(".")
    if parts[0] == "scripts":
        return "scripts"
    if parts[0] != "swarmloco":
        return None
    if len(parts) > 1 and parts[1] in ("protocol", "peer", "coordinator"):
        return parts[1]
    return "commands"


def test_product_code_imports_only_the_installed_name() -> None:
    bare = []
    for _name, path in _sources().items():
        for imported in _imports(path):
            if imported.split(".")[0] in ("peer", "coordinator", "protocol"):
                bare.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not bare, "import these as swarmloco.<package>:\n" + "\n".join(bare)


def test_imports_go_one_way() -> None:
    violations = []
    for name, path in _sources().items():
        mine = _group(name)
        for imported in _imports(path):
            theirs = _group(imported)
            if theirs is not None and theirs not in ALLOWED[mine]:
                violations.append(f"{path.relative_to(ROOT)} ({mine}) imports {imported} ({theirs})")
    assert not violations, "layering violations:\n" + "\n".join(violations)


def test_protocol_layers_import_downwards_only() -> None:
    violations = []
    modules = [p for p in (ROOT / "protocol").rglob("*.py") if p.parent != ROOT / "protocol"]
    assert {p.parent.name for p in modules} == set(LAYERS), "protocol/ holds exactly these layers: " + str(LAYERS)
    assert [p.name for p in (ROOT / "protocol").glob("*.py")] == ["__init__.py"], "protocol's modules live in layers"
    for path in modules:
        mine = LAYERS.index(path.parent.name)
        for imported in _imports(path):
            parts = imported.split(".")
            if parts[:2] == ["swarmloco", "protocol"] and len(parts) > 2 and parts[2] in LAYERS:
                if LAYERS.index(parts[2]) > mine:
                    violations.append(f"{path.relative_to(ROOT)} ({LAYERS[mine]}) imports {imported}")
    assert not violations, "protocol layer violations:\n" + "\n".join(violations)


def test_no_import_circles() -> None:
    sources = _sources()
    graph = {name: {m for m in _imports(path) if m in sources and m != name}
             for name, path in sources.items()}
    # a package's own __init__ is imported on the way to its modules; it is not an edge a reader follows
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_production_code_never_reaches_the_test_harness() -> None:
    harness = ROOT / "protocol" / "testing"
    offenders = []
    for name, path in _sources().items():
        if harness in path.parents or _group(name) == "scripts":
            continue
        if any(m.startswith("swarmloco.protocol.testing") for m in _imports(path)):
            offenders.append(str(path.relative_to(ROOT)))
    # The peer's one opt-in point: it loads the fault injector only when a harness sets SWARMLOCO_FAULTS.
    assert offenders == ["peer/training.py"], offenders
    before = (ROOT / "peer" / "training.py").read_text().split("def harness_hooks")[0]
    assert "protocol.testing" not in before
