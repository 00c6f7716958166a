"""TOML files as a user writes them: the shipped examples/run.toml loads, and a flag's name works as its key."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from swarmloco.peer.config import ConfigError, build_config

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path) -> object:
    return build_config(argparse.Namespace(config=str(path)), env={})


def test_example_toml_loads_with_the_values_it_shows() -> None:
    cfg = _load(ROOT / "examples" / "run.toml")
    assert cfg.run.workdir == "runs/peer-a" and (cfg.run.shard_index, cfg.run.num_shards) == (0, 2)
    assert cfg.train.lr == 4e-4 and cfg.train.inner_steps == 30 and cfg.outer.lr == 0.7
    assert cfg.network.host_maddrs == ("/ip4/0.0.0.0/tcp/0",) and cfg.round.quorum == 2


def test_flag_name_and_field_name_are_both_keys(tmp_path: Path) -> None:
    path = tmp_path / "a.toml"
    path.write_text("[train]\ninner_lr = 0.002\n[outer]\nlr = 0.5\n")
    cfg = _load(path)
    assert cfg.train.lr == 0.002 and cfg.outer.lr == 0.5
    path.write_text("[train]\ninner_lr = 0.002\nlr = 0.001\n")
    with pytest.raises(ConfigError, match=r"train.inner_lr and train.lr in .* are one setting; keep one"):
        _load(path)
    path.write_text("[train]\ninner_rl = 0.002\n")
    with pytest.raises(ConfigError, match=r"unknown key train.inner_rl .* allowed .*inner_lr"):
        _load(path)
