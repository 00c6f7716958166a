"""The wheel, as a user gets it: built from the working tree, installed into a fresh virtual environment that
already holds two unrelated top-level packages named `scripts` and `protocol`, and run from outside the checkout.

- the wheel installs one top-level name, `swarmloco` (plus its dist-info): no `scripts`, `protocol`, `peer`,
  `coordinator` or `tests` of ours to clobber someone else's; every module, the .proto and the dashboard's static
  files are inside;
- the installed `swarmloco` console script runs, the unrelated packages still import as themselves, and
  `swarmloco.protocol` comes from the fresh environment, not from the checkout;
- `swarmloco swarm` (what `make demo` runs) trains 2 peers for 2 rounds on 127.0.0.1 from the installed code alone,
  every peer committing the same state.

No download: the wheel is built without build isolation (setuptools comes from the test's own environment), and the
fresh environment gets the project's dependencies through a .pth file naming the test environment's site-packages.
A directory named in a .pth file is appended to sys.path, but the .pth files inside it are not run, so the
checkout's editable install (a .pth finder there) stays invisible; the test checks that before installing.

Named apart from tests/unit/test_packaging.py (the unit checks of the same package list): the suite imports test
files by their base name, and two files of one name do not collect together.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from swarmloco.proc_memory import descendants

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
FOREIGN = {"scripts": "someone else's scripts", "protocol": "someone else's protocol"}  # name -> MARKER value
OURS_ONLY_IN_A_CHECKOUT = ("scripts", "protocol", "peer", "coordinator", "tests")
STEP_TIMEOUT_S = 180  # any one build, install or short command on a loaded 2-core machine
SWARM_TIMEOUT_S = 420  # the launcher gives up by itself at --timeout 300; this is the backstop


@dataclass
class Installed:
    """The built wheel and the fresh environment it is installed in."""

    wheel: Path
    venv: Path
    site_packages: Path
    workdir: Path  # outside the checkout: commands run here

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def swarmloco(self) -> str:
        return str(self.venv / "bin" / "swarmloco")


def _clean_env(venv: Path | None = None) -> dict[str, str]:
    """This environment minus whatever points Python at the checkout or at another environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", OMP_NUM_THREADS="1")
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = STEP_TIMEOUT_S
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _checked(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = _run(argv, cwd, env)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc.stdout


def _setuptools_config() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"])


def _build_wheel(base: Path) -> Path:
    """Build from a copy of the working tree, so the build's build/ and egg-info never land in the checkout."""
    src = base / "src"
    src.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", src)
    shutil.copy2(ROOT / "README.md", src)
    for folder in set(_setuptools_config()["package-dir"].values()):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    dist = base / "dist"
    _checked([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
              "-w", str(dist), str(src)], base, _clean_env())
    wheels = list(dist.glob("swarmloco-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, built {[w.name for w in dist.iterdir()]}"
    return wheels[0]


def _dependencies_dir() -> Path:
    """The site-packages this test runs with, which holds the project's dependencies (found without importing)."""
    spec = importlib.util.find_spec("hivemind")
    assert spec is not None and spec.origin is not None, "hivemind is not installed in the test environment"
    deps = Path(spec.origin).parents[1]
    assert (deps / "torch").is_dir(), f"torch is not beside hivemind in {deps}"
    return deps


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("packaging")
    assert not base.resolve().is_relative_to(ROOT), "the fresh environment must live outside the checkout"
    wheel = _build_wheel(base)
    venv = base / "venv"
    workdir = base / "work"
    workdir.mkdir()
    # pip comes from the interpreter's bundled ensurepip wheel: no download.
    _checked([sys.executable, "-m", "venv", str(venv)], base, _clean_env())
    site_packages = Path(_checked([str(venv / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                  workdir, _clean_env(venv)).strip())
    for name, marker in FOREIGN.items():
        (site_packages / name).mkdir()
        (site_packages / name / "__init__.py").write_text(f'"""Not swarmloco\'s."""\nMARKER = {marker!r}\n')
    (site_packages / "zz_swarmloco_test_dependencies.pth").write_text(f"{_dependencies_dir()}\n")
    env = _clean_env(venv)

    # The assumption the whole test rests on: dependencies visible, the checkout's swarmloco not.
    probe = _run([str(venv / "bin" / "python"), "-c",
                  "from importlib.util import find_spec\n"
                  "assert find_spec('hivemind') and find_spec('torch'), 'the dependencies are not visible'\n"
                  "import swarmloco"], workdir, env)
    assert probe.returncode != 0 and "No module named 'swarmloco'" in probe.stderr, (
        "before the wheel is installed, the fresh environment must see the dependencies but not swarmloco:\n"
        f"{probe.stderr[-2000:]}"
    )
    # --ignore-installed: the dependencies' site-packages holds the editable install's dist-info, same name and
    # version; pip must neither take it for this wheel nor try to uninstall it.
    _checked([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
              "--no-warn-script-location", "-q", str(wheel)], workdir, env)
    return Installed(wheel=wheel, venv=venv, site_packages=site_packages, workdir=workdir)


def test_wheel_installs_one_top_level_name_with_its_data(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        names = zf.namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("swarmloco-"), dist_info
    assert top - dist_info == {"swarmloco"}, f"the wheel installs more than swarmloco: {sorted(top)}"
    assert not top & set(OURS_ONLY_IN_A_CHECKOUT)

    config = _setuptools_config()
    expected = []
    for package, folder in config["package-dir"].items():
        for path in (ROOT / folder).rglob("*"):
            rel = path.relative_to(ROOT / folder)
            if path.is_file() and "__pycache__" not in rel.parts and (path.suffix == ".py" or "static" in rel.parts):
                expected.append("/".join([*package.split("."), *rel.parts]))
    expected.append("swarmloco/protocol/base/swarmloco_wire.proto")
    missing = sorted(set(expected) - set(names))
    assert not missing, "in the checkout but not in the wheel:\n" + "\n".join(missing)

    entry_points = zipfile.Path(installed.wheel, f"{next(iter(dist_info))}/entry_points.txt").read_text()
    assert "swarmloco = swarmloco.cli:main" in entry_points


def test_console_script_runs_and_leaves_unrelated_packages_alone(installed: Installed) -> None:
    env = _clean_env(installed.venv)
    assert "swarm" in _checked([installed.swarmloco, "--help"], installed.workdir, env)
    probe = (
        "import json, scripts, protocol, swarmloco, swarmloco.protocol, swarmloco.coordinator\n"
        "from importlib.util import find_spec\n"
        "from pathlib import Path\n"
        "static = Path(swarmloco.coordinator.__file__).parent / 'static' / 'index.html'\n"
        "print(json.dumps({'scripts': scripts.MARKER, 'protocol': protocol.MARKER,\n"
        "                  'swarmloco': swarmloco.__file__, 'swarmloco.protocol': swarmloco.protocol.__file__,\n"
        "                  'static': static.is_file(), 'peer': find_spec('peer') is not None,\n"
        "                  'coordinator': find_spec('coordinator') is not None}))\n"
    )
    seen = json.loads(_checked([installed.python, "-c", probe], installed.workdir, env))
    assert seen["scripts"] == FOREIGN["scripts"] and seen["protocol"] == FOREIGN["protocol"], seen
    for name in ("swarmloco", "swarmloco.protocol"):
        assert Path(seen[name]).is_relative_to(installed.site_packages), f"{name} from {seen[name]}"
    assert seen["static"], "the dashboard's index.html is not installed beside swarmloco.coordinator"
    assert not seen["peer"] and not seen["coordinator"], f"a bare top-level name is importable: {seen}"


def _alive_descendants() -> set[int]:
    """Our live descendants; a zombie (exited, not yet reaped by us, the session's subreaper) is not one."""
    alive = set()
    for pid in descendants(os.getpid()):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launcher_output(out: str, err: str, workdir: Path) -> str:
    """What to show when the swarm fails: the launcher's own lines, and the coordinator's log if it wrote one."""
    log = workdir / "coordinator.log"
    coordinator = log.read_text()[-2000:] if log.exists() else "(none)"
    return f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}\ncoordinator.log:\n{coordinator}"


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Every process the test starts is gone when it ends (the launcher stops its own); stragglers are killed and
    fail the test."""
    before = _alive_descendants()
    yield
    deadline = time.monotonic() + 15
    left = _alive_descendants() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _alive_descendants() - before
    _kill(left)
    assert not left, f"processes outlived `swarmloco swarm`: {sorted(left)}"


def test_two_peer_swarm_runs_from_the_wheel(installed: Installed, no_leftovers: None) -> None:
    run = installed.workdir / "swarm"
    summary_path = installed.workdir / "summary.json"
    argv = [installed.swarmloco, "swarm", "--peers", "2", "--preset", "tiny", "--rounds", "2", "--inner-steps", "10",
            "--workdir", str(run), "--summary-json", str(summary_path), "--timeout", "300"]
    proc = subprocess.Popen(argv, cwd=installed.workdir, env=_clean_env(installed.venv), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=SWARM_TIMEOUT_S)
    finally:
        if proc.poll() is None:  # timed out: its peers, coordinator and p2pd daemons go with it
            _kill(set(descendants(proc.pid)) | {proc.pid})
            proc.wait(10)
    shown = _launcher_output(out, err, run)
    assert proc.returncode == 0, f"`swarmloco swarm` exited {proc.returncode}\n{shown}"
    summary = json.loads(summary_path.read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2], f"{summary['rounds']}\n{shown}"
    for rnd in summary["rounds"]:
        assert rnd["outcome"] == "committed" and rnd["members"] == 2, rnd
        assert len(rnd["hashes"]) == 2 and len(set(rnd["hashes"].values())) == 1, rnd
    finals = summary["final_state_hashes"]
    assert set(finals) == {"peer-0", "peer-1"} and len(set(finals.values())) == 1 and None not in finals.values()
    assert finals["peer-0"] == summary["rounds"][-1]["hashes"]["peer-0"]
    assert math.isfinite(summary["initial_eval_loss"]) and math.isfinite(summary["final_eval_loss"])
