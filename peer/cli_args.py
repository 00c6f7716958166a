"""The `swarmloco peer` command line, built without importing torch or hivemind.

A flag's kind (on/off, repeatable, one value) and its default come from the config dataclasses (peer/config.py),
whose modules import torch and hivemind: several seconds before `--help` could answer. So they are read once and
kept in a small JSON cache (like __pycache__), valid while no .py file under peer/ or protocol/ changed; a miss
costs one slow start and rewrites it. A new row of the option table needs nothing else.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from swarmloco.peer.options import CONFIG_ENV, OPTIONS

logger = logging.getLogger(__name__)
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
SPEC_VERSION = 1


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarmloco"


def sources_key(root: Path = PACKAGE_ROOT) -> str:
    """A hash of every .py file's path, size and mtime under peer/ and protocol/: any edit changes it."""
    h = hashlib.sha256(f"{SPEC_VERSION}:{root}".encode())
    for package in ("peer", "protocol"):
        for path in sorted((root / package).rglob("*.py")):
            st = path.stat()
            h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:24]


def option_spec(*, cache_dir: Path | None = None) -> dict[str, Any]:
    """{"sections": [...], "options": {flag: {"kind": "bool"|"list"|"value", "default": text}}}, cached."""
    # one file per checkout (its path's hash first), replaced when that checkout's sources change
    checkout = hashlib.sha256(str(PACKAGE_ROOT).encode()).hexdigest()[:8]
    path = (cache_dir or _cache_dir()) / f"peer-options-{checkout}-{sources_key()}.json"
    try:
        spec = json.loads(path.read_text())
        if isinstance(spec, dict) and {o.flag for o in OPTIONS} <= set(spec.get("options", {})):
            return spec
    except (OSError, ValueError):
        pass
    from swarmloco.peer.config import option_spec as from_dataclasses  # the slow path: torch and hivemind

    spec = from_dataclasses()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(f"peer-options-{checkout}-*.json"):
            old.unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(spec))
        tmp.replace(path)
    except OSError as exc:  # a read-only home only costs speed
        logger.debug("cannot cache the option table in %s: %s", path.parent, exc)
    return spec


def add_arguments(parser: argparse.ArgumentParser, spec: dict[str, Any] | None = None) -> None:
    """One flag per row of the option table, with its default and its env var, grouped by TOML section.

    Every default is None on the parser itself: build_config merges flags over env over TOML over the dataclass
    defaults, so a flag only counts when it was given."""
    spec = spec or option_spec()
    parser.add_argument("--config", metavar="PATH",
                        help=f"TOML file with [{'], ['.join(spec['sections'])}] sections; keys are the fields or "
                             f"the flags' names (inner_lr or lr), see examples/run.toml [env {CONFIG_ENV}]")
    groups = {name: parser.add_argument_group(f"[{name}]") for name in spec["sections"]}
    for opt in OPTIONS:
        entry = spec["options"][opt.flag]
        help_text = f"{opt.help} (default: {entry['default']}) [env {opt.env}]".replace("%", "%%")
        group = groups[opt.section]
        if entry["kind"] == "bool":
            group.add_argument(opt.flag, dest=opt.dest, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif opt.repeat:
            group.add_argument(opt.flag, dest=opt.dest, action="append", default=None, metavar="VALUE", help=help_text)
        else:
            metavar = "N|auto" if opt.auto else opt.label.upper()
            group.add_argument(opt.flag, dest=opt.dest, default=None, metavar=metavar, help=help_text)
