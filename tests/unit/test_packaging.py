"""pyproject.toml lists every package the wheel must hold, by hand: a new subpackage nobody adds there is importable
in a checkout (and by an editable install) but missing from the wheel. These checks read the list against the disk,
without building anything; tests/integration/test_packaging_wheel.py builds and installs the wheel itself.

The mapping under test: [tool.setuptools.package-dir] maps `swarmloco` and its parts (`swarmloco.peer` = peer/, ...)
to top-level folders of the checkout, and [tool.setuptools] packages names every package by its installed name.
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The checkout's folders that the one installed name, swarmloco, is made of.
MAPPED = {"swarmloco": "swarmloco", "swarmloco.peer": "peer", "swarmloco.coordinator": "coordinator",
          "swarmloco.protocol": "protocol"}


def _setuptools() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"])


def _folder(package: str, package_dir: dict[str, str]) -> Path:
    """The folder a listed package is built from: its longest mapped prefix's folder, then the rest of its name."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / Path(*parts[cut:])
    return ROOT / Path(*parts)


def _packages_on_disk(package_dir: dict[str, str]) -> dict[str, Path]:
    """Every folder with an __init__.py under a mapped folder, by the name it is installed under."""
    found = {}
    for prefix, folder in package_dir.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            found[".".join([prefix, *rel.parts])] = init.parent
    return found


def test_the_mapped_folders_are_the_products_parts() -> None:
    assert _setuptools()["package-dir"] == MAPPED, (
        "pyproject.toml's [tool.setuptools.package-dir] changed: update MAPPED here, and check that the wheel "
        "still installs one top-level name (tests/integration/test_packaging_wheel.py)"
    )


def test_every_package_folder_is_listed_and_every_listed_package_exists() -> None:
    config = _setuptools()
    listed = set(config["packages"])
    on_disk = _packages_on_disk(config["package-dir"])
    unlisted = sorted(f"{name} ({path.relative_to(ROOT)})" for name, path in on_disk.items() if name not in listed)
    assert not unlisted, "add these to [tool.setuptools] packages in pyproject.toml:\n" + "\n".join(unlisted)
    missing = sorted(f"{name} (expected {_folder(name, config['package-dir']).relative_to(ROOT)}/__init__.py)"
                     for name in listed - set(on_disk))
    assert not missing, "listed in [tool.setuptools] packages but not on disk:\n" + "\n".join(missing)


def test_every_folder_of_python_modules_is_a_package() -> None:
    """A folder of modules without an __init__.py imports in a checkout (as a namespace package) yet is never
    listed, so never installed: it needs an __init__.py, then a line in pyproject.toml."""
    bare = []
    for folder in MAPPED.values():
        for module in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in module.parts and not (module.parent / "__init__.py").exists():
                bare.append(str(module.relative_to(ROOT)))
    assert not bare, "modules in a folder without __init__.py:\n" + "\n".join(sorted(bare))


def test_package_data_belongs_to_listed_packages_and_matches_files() -> None:
    config = _setuptools()
    for package, patterns in config["package-data"].items():
        assert package in config["packages"], f"package-data for {package}, which is not a listed package"
        folder = _folder(package, config["package-dir"])
        for pattern in patterns:
            matched = [p for p in folder.glob(pattern) if p.is_file()]
            assert matched, f"package-data {package}: {pattern!r} matches no file under {folder.relative_to(ROOT)}"
