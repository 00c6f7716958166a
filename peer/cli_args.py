"""The `swarmloco peer` command line: one flag per row of the option table (peer/options.py), with the kind (on/off,
repeatable, one value) and the default of the config field it sets, read from the dataclasses (peer/config.py).

Those dataclasses import neither torch nor hivemind, so building this parser is quick: `swarmloco peer --help` and
a mistyped flag answer at once (tests/unit/test_cli_startup.py checks that torch stays unimported).
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

from swarmloco.peer.config import SECTIONS, base_type, field_type
from swarmloco.peer.options import CONFIG_ENV, OPTIONS, Option


def _default(opt: Option) -> Any:
    """The default of the field the option sets (None when the field has none)."""
    spec = next(f for f in fields(SECTIONS[opt.section]) if f.name == opt.field)
    if spec.default is not MISSING:
        return spec.default
    return spec.default_factory() if spec.default_factory is not MISSING else None


def _shown(value: Any, opt: Option) -> str:
    """A default as --help shows it."""
    if value is None:
        return "auto" if opt.auto else "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "none"
    return str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per row of the option table, with its default and its env var, grouped by TOML section.

    Every default is None on the parser itself: build_config merges flags over env over TOML over the dataclass
    defaults, so a flag only counts when it was given."""
    parser.add_argument("--config", metavar="PATH",
                        help=f"TOML file with [{'], ['.join(SECTIONS)}] sections; keys are the fields or "
                             f"the flags' names (inner_lr or lr), see examples/run.toml [env {CONFIG_ENV}]")
    groups = {name: parser.add_argument_group(f"[{name}]") for name in SECTIONS}
    for opt in OPTIONS:
        help_text = f"{opt.help} (default: {_shown(_default(opt), opt)}) [env {opt.env}]".replace("%", "%%")
        group = groups[opt.section]
        scalar, _ = base_type(field_type(SECTIONS[opt.section], opt.field))
        if scalar is bool:
            group.add_argument(opt.flag, dest=opt.dest, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif opt.repeat:
            group.add_argument(opt.flag, dest=opt.dest, action="append", default=None, metavar="VALUE", help=help_text)
        else:
            metavar = "N|auto" if opt.auto else opt.label.upper()
            group.add_argument(opt.flag, dest=opt.dest, default=None, metavar=metavar, help=help_text)
