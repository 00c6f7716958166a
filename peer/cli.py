"""`swarmloco peer`: run one peer (solo, or in a swarm) from flags, a TOML file and SWARMLOCO_* env vars.

The order of startup: build the config (no I/O), resolve what depends on where the peer runs (bootstrap ready file,
compose replica shard), build the replica, then hand over to the solo or swarm runner.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmloco.peer import bootstrap, preflight
from swarmloco.peer import config as config_mod
from swarmloco.peer.config import ConfigError, PeerConfig
from swarmloco.peer.run_model import expected_model, task_context
from swarmloco.peer.signals import StopFlag
from swarmloco.protocol.trust.identity import IdentityError

if TYPE_CHECKING:
    from swarmloco.peer.replica import Replica

logger = logging.getLogger(__name__)


def build_replica(cfg: PeerConfig, *, data_seed: int = 0) -> Replica:
    from swarmloco.peer.replica import Replica  # torch
    from swarmloco.peer.task import load_task

    run = cfg.run
    if run.shard_index is None:
        raise ConfigError("shard_index: still 'auto'; resolve the config with swarmloco.peer.bootstrap.resolve first")
    task = load_task(run.task, task_context(cfg, data_seed=data_seed))
    return Replica(task, cfg.train, cfg.outer, cfg.runtime)


def swarm_data_seed(cfg: PeerConfig) -> int:
    """Per-peer data order, derived from the stable peer id: peers that share a shard still see different batches."""
    from swarmloco.protocol.trust.identity import load_or_create_identity

    path = Path(cfg.identity_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    peer_id = load_or_create_identity(path).peer_id
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "little")


def write_summary(path: str | None, summary: dict[str, Any]) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
    tmp.replace(target)


def joined_config(args: argparse.Namespace) -> PeerConfig:
    """The peer's config; with --join, filled in from the run's manifest (swarmloco.peer.join)."""
    cfg = config_mod.build_config(args)
    if not cfg.run.join:
        return cfg
    from dataclasses import fields

    from swarmloco.peer import join

    try:
        manifest, origin = join.fetch_manifest(cfg.run.join)
        join.check_compatible(manifest)
        join.check_run_settings(manifest.settings, {name: {f.name for f in fields(cls)}
                                                    for name, cls in config_mod.SECTIONS.items()})
    except join.JoinError as exc:
        raise ConfigError(str(exc)) from None
    logger.info("%s", join.describe(manifest, origin))
    cfg = config_mod.build_config(args, fixed=join.fixed_values(manifest, origin),
                                  added={"network": {"initial_peers": manifest.bootstrap}})
    if manifest.task or manifest.fingerprint:  # the model these settings build here is the one the run trains
        try:
            join.check_model(manifest, expected_model(cfg))
        except join.JoinError as exc:
            raise ConfigError(str(exc)) from None
    return cfg


def run_peer(args: argparse.Namespace) -> int:
    """The peer command: a bad setting ends in one line (exit 2) before torch is even imported."""
    try:
        cfg = bootstrap.resolve(joined_config(args))
        run = cfg.run
        lock = preflight.lock_workdir(cfg)  # noqa: F841 - held until the process exits
        if not run.solo:
            preflight.check_network(cfg)
        preflight.check_resume(cfg)
        # only once nothing else refuses to start: a mistyped flag must not move the old checkpoint aside
        moved = preflight.set_aside_checkpoint(cfg)
        if moved is not None:
            logger.warning("%s/checkpoint holds an earlier run: moved it to %s (pass --resume to continue from a "
                           "checkpoint instead)", run.workdir, moved)
        return _train(cfg)
    except (ConfigError, FileNotFoundError, IdentityError) as exc:
        logger.error("%s", exc)
        return 2


def _train(cfg: PeerConfig) -> int:
    from swarmloco.peer.checkpoint import CheckpointError  # torch, as everything from here on

    run = cfg.run
    try:
        replica = build_replica(cfg, data_seed=0 if run.solo else swarm_data_seed(cfg))
        stop = StopFlag().install()
        if run.solo:
            from swarmloco.peer.solo import run_solo

            summary = run_solo(replica, cfg, stop=stop)
        else:
            from swarmloco.peer.swarm_sync import IncompatibleSwarm, run_swarm_peer
            from swarmloco.peer.tickets import AdmissionSetupError

            try:
                summary = run_swarm_peer(replica, cfg, stop=stop)
            except IncompatibleSwarm as exc:
                logger.error("refused: %s", exc)
                return 3
            except AdmissionSetupError as exc:
                logger.error("not admitted: %s", exc)
                return 3
            except Exception as exc:
                explained = preflight.explain_start_failure(exc, cfg)
                if explained is None:
                    raise
                logger.error("%s", explained)
                return 3
    except CheckpointError as exc:
        logger.error("%s", exc)
        return 2
    write_summary(run.summary_json, summary)
    return 0
