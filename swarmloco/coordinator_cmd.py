"""`swarmloco coordinator`: the coordinator's own command, after checking --run-config against the peer's settings.

The coordinator package does not import the peer's; this command does. Settings a run may not fix (the device, the
workdir, the network), unknown keys and malformed values are refused at start, in one line, instead of in every
peer that later tries to join. The keys are served in their canonical names (a TOML may use a flag's name, such as
`inner_lr` for [train] lr).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from swarmloco.coordinator.cli import run_coordinator


def run(args: argparse.Namespace) -> int:
    if getattr(args, "run_config", None) is not None and not getattr(args, "coordinator_action", None):
        from swarmloco.peer import config as config_mod
        from swarmloco.peer.join import JoinError, check_run_settings

        try:
            settings = config_mod.load_toml(str(args.run_config))
            check_run_settings(settings, {name: {f.name for f in fields(cls)}
                                          for name, cls in config_mod.SECTIONS.items()})
            config_mod.build_config(None, {}, fixed=settings)  # every value of the right type and in range
        except (config_mod.ConfigError, JoinError) as exc:
            print(f"swarmloco coordinator: --run-config {args.run_config}: {exc}", file=sys.stderr)
            return 2
        args.run_settings = settings
    return run_coordinator(args)
