"""Checkpoint round trip and exact resume (bit-identical next-step loss on CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarmloco.peer import checkpoint
from swarmloco.peer.cli import build_replica
from swarmloco.peer.config import PeerConfig, RunConfig, RuntimeConfig, TrainConfig
from swarmloco.peer.outer_config import OuterConfig
from swarmloco.peer.solo import run_solo


def _cfg(workdir: Path, max_steps: int, resume: bool = False) -> PeerConfig:
    return PeerConfig(
        run=RunConfig(
            preset="tiny", solo=True, max_steps=max_steps, workdir=str(workdir), resume=resume, checkpoint_every=0
        ),
        train=TrainConfig(inner_steps=8, warmup_steps=4, batch_size=4),
        outer=OuterConfig(),
        runtime=RuntimeConfig(device="cpu", seed=3),
    )


def test_stop_mid_round_and_resume_is_exact(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    uninterrupted = build_replica(_cfg(tmp_path / "a", 20))
    run_solo(uninterrupted, _cfg(tmp_path / "a", 20))
    assert uninterrupted.round_steps == 4  # stopped in the middle of round 2 (H = 8)
    expected_next = uninterrupted.inner_step().loss

    stopped = build_replica(_cfg(tmp_path / "b", 20))
    run_solo(stopped, _cfg(tmp_path / "b", 20))
    resumed = build_replica(_cfg(tmp_path / "b", 30, resume=True))
    checkpoint.load(resumed, tmp_path / "b" / "checkpoint")
    assert resumed.step == 20 and resumed.round == 2 and resumed.round_steps == 4
    assert resumed.state_hash() == stopped.state_hash()
    assert resumed.inner_step().loss == expected_next  # bit for bit

    # and the runs stay identical through the next outer steps
    for replica in (uninterrupted, resumed):
        run_solo(replica, _cfg(tmp_path / "c", 30))
    assert uninterrupted.state_hash() == resumed.state_hash()


def test_corrupt_or_mismatched_checkpoint_is_refused(tmp_path: Path) -> None:
    replica = build_replica(_cfg(tmp_path, 2))
    path = checkpoint.save(replica, tmp_path)
    meta = json.loads((tmp_path / "state.json").read_text())
    assert meta["state_hash"] == replica.state_hash()
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(checkpoint.CheckpointError, match="sha256"):
        checkpoint.load(build_replica(_cfg(tmp_path, 2)), tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.load(replica, tmp_path / "missing")


def test_checkpoint_files_are_not_pickles(tmp_path: Path) -> None:
    replica = build_replica(_cfg(tmp_path, 2))
    path = checkpoint.save(replica, tmp_path)
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])  # safetensors: u64 length + JSON header
    assert "global/tok.weight" in header and "momentum/tok.weight" in header
