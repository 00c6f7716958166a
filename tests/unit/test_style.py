"""The house rules a reviewer would otherwise check by hand: ruff passes with the project's config, no source file
outgrows 400 lines (split it by idea first), and no two test modules share a name."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
GENERATED = {"protocol/base/swarmloco_wire_pb2.py"}


def test_ruff_passes() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is missing: it is in the test extra (pip install -e '.[test]')"
    proc = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_source_file_over_400_lines() -> None:
    long = {}
    for package in ("swarmloco", "protocol", "peer", "coordinator", "scripts", "tests"):
        for path in (ROOT / package).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel not in GENERATED and (n := len(path.read_text().splitlines())) > MAX_LINES:
                long[rel] = n
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_test_modules_have_unique_names() -> None:
    """pytest imports every test file as a top-level module (the test folders are not packages): two files of one
    name in different folders stop the whole suite's collection, which a run of one tier alone does not show."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a name: {clashes}"
