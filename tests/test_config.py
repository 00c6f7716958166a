"""Config validation: one line naming the field, the value and what is allowed; sources merge in order."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from peer.config import ConfigError, add_arguments, build_config


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-steps", "ten"], "max_steps: got 'ten', allowed a value of type int"),
        (["--max-steps", "-1"], "max_steps: got -1, allowed >= 0"),
        (["--preset", "huge"], "preset: got 'huge', allowed tiny, small, base"),
        (["--inner-lr", "2"], "inner_lr: got 2.0, allowed 0 < lr <= 1"),
        (["--outer-momentum", "1.5"], "outer momentum: got 1.5, allowed 0 <= momentum < 1"),
        (["--log-format", "xml"], "log_format: got 'xml', allowed text, json"),
        (["--device", "tpu"], "device: got 'tpu', allowed auto, cpu, cuda or cuda:N"),
        (["--num-shards", "2", "--shard-index", "2"], "shard_index: got 2, allowed 0 .. 1"),
    ],
)
def test_bad_values_get_one_clear_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(_parse(*argv), env={})
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_precedence_defaults_toml_env_flags(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[run]\nmax_steps = 11\npreset = "small"\n[train]\nlr = 0.001\n')
    cfg = build_config(_parse("--config", str(toml)), env={})
    assert (cfg["run"].max_steps, cfg["run"].preset, cfg["train"].lr) == (11, "small", 0.001)
    cfg = build_config(_parse("--config", str(toml)), env={"SWARMLOCO_MAX_STEPS": "12"})
    assert cfg["run"].max_steps == 12
    cfg = build_config(_parse("--config", str(toml), "--max-steps", "13"), env={"SWARMLOCO_MAX_STEPS": "12"})
    assert cfg["run"].max_steps == 13
    assert build_config(_parse(), env={"SWARMLOCO_SOLO": "yes"})["run"].solo is True


def test_toml_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found: .*nope.toml"):
        build_config(_parse("--config", str(tmp_path / "nope.toml")), env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nmax_stepz = 3\n")
    with pytest.raises(ConfigError, match="unknown key run.max_stepz"):
        build_config(_parse("--config", str(bad)), env={})
    bad.write_text("[train]\nlr = 'fast'\n")
    with pytest.raises(ConfigError, match="inner_lr: got 'fast'"):
        build_config(_parse("--config", str(bad)), env={})
