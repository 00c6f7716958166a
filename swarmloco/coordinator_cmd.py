"""`swarmloco coordinator`: the coordinator's own command, after checking --run-config against the peer's settings.

The coordinator package does not import the peer's; this command does. Settings a run may not fix (the device, the
workdir, the network), unknown keys and malformed values are refused at start, in one line, instead of in every
peer that later tries to join. The keys are served in their canonical names (a TOML may use a flag's name, such as
`inner_lr` for [train] lr). It also names the task those settings train and the model fingerprint its peers will
announce (`swarmloco.peer.run_model`, which loads torch), for the run manifest: `args.run_task` and
`args.run_fingerprint`, both "" when the task cannot be loaded here (a plug-in this machine lacks).
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from swarmloco.coordinator.cli import run_coordinator

if TYPE_CHECKING:
    from swarmloco.peer.config import PeerConfig

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "run_config", None) is not None and not getattr(args, "coordinator_action", None):
        from swarmloco.peer import config as config_mod
        from swarmloco.peer.join import JoinError, check_run_settings

        try:
            settings = config_mod.load_toml(str(args.run_config))
            check_run_settings(settings, {name: {f.name for f in fields(cls)}
                                          for name, cls in config_mod.SECTIONS.items()})
            cfg = config_mod.build_config(None, {}, fixed=settings)  # every value of the right type and in range
        except (config_mod.ConfigError, JoinError) as exc:
            print(f"swarmloco coordinator: --run-config {args.run_config}: {exc}", file=sys.stderr)
            return 2
        args.run_settings = settings
        args.run_task, args.run_fingerprint = run_model(cfg)
    return run_coordinator(args)


def run_model(cfg: PeerConfig) -> tuple[str, str]:
    """(task, model fingerprint) of the peers a run with `cfg` has; ("", "") when this machine cannot
    load the run's task: the manifest then names neither, and peers check neither."""
    from swarmloco.peer.run_model import expected_model

    try:
        model = expected_model(cfg)
    except Exception as exc:  # a plug-in's own code runs here: whatever it raises, the run is still served
        logger.warning("the run's task %s cannot be loaded here (%s: %s): the manifest names no task and no model "
                       "fingerprint, so joining peers check neither", cfg.run.task, type(exc).__name__, exc)
        return "", ""
    return model.task, model.fingerprint
