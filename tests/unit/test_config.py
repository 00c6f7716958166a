"""Config validation: one line naming the field, the value and what is allowed; sources merge in order."""
from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest

from swarmloco.peer.cli_args import add_arguments
from swarmloco.peer.config import (
    SECTIONS,
    BudgetConfig,
    ConfigError,
    PeerConfig,
    RunConfig,
    build_config,
    check_env,
)
from swarmloco.peer.options import OPTIONS, OTHER_ENV
from swarmloco.protocol.round.config import RoundConfig


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-steps", "ten"], "max_steps: got 'ten', allowed a value of type int"),
        (["--max-steps", "-1"], "max_steps: got -1, allowed >= 0"),
        (["--preset", "huge"], "preset: got 'huge', allowed nano, tiny, small, base"),
        (["--inner-lr", "2"], "inner_lr: got 2.0, allowed 0 < lr <= 1"),
        (["--outer-momentum", "1.5"], "outer momentum: got 1.5, allowed 0 <= momentum < 1"),
        (["--log-format", "xml"], "log_format: got 'xml', allowed text, json"),
        (["--device", "tpu"], "device: got 'tpu', allowed auto, cpu, cuda or cuda:N"),
        (["--num-shards", "2", "--shard-index", "2"], "shard_index: got 2, allowed 0 .. 1 or auto"),
        (["--shard-index", "automatic"], "shard_index: got 'automatic', allowed a value of type int or auto"),
        (["--quorum", "0"], "quorum: got 0, allowed 1 .. 10000"),
        (["--control-timeout", "0.1"], "control_timeout_s: got 0.1, allowed 0.5 .. 600"),
        (["--codec", "zip"], "codec"),
        (["--round-tokens", "-5"], "round_tokens: got -5, allowed 0 .. 1099511627776"),
        (["--round-tokens", str(2**40 + 1)], f"round_tokens: got {2**40 + 1}, allowed 0 .. 1099511627776"),
        (["--round-seconds", "90000"], "round_seconds: got 90000.0, allowed 0 .. 86400"),
        (["--bootstrap-wait", "-1"], "bootstrap_wait: got -1.0, allowed 0 .. 86400 seconds"),
        (["--bootstrap-port", "70000"], "bootstrap_port: got 70000, allowed 1 .. 65535"),
        (["--bootstrap-host", "a/b"], "bootstrap_host: got 'a/b', allowed a host name or an IP address"),
        (["--initial-peer", "1.2.3.4:5"], "multiaddr: got '1.2.3.4:5'"),
    ],
)
def test_bad_values_get_one_clear_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(_parse(*argv), env={})
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_defaults_are_one_typed_tree() -> None:
    cfg = build_config(_parse(), env={})
    assert cfg == PeerConfig()
    assert cfg.round == RoundConfig()
    assert cfg.budget == BudgetConfig(round_tokens=0, round_seconds=0.0, close_early=True)
    assert (cfg.run.max_steps, cfg.run.shard_index, cfg.network.initial_peers, cfg.bootstrap.file) == (0, 0, (), None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.max_steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        RunConfig(0)  # type: ignore[misc]  # keyword-only: a positional mix-up cannot pass silently


def test_every_option_names_a_real_field_once() -> None:
    flags = [o.flag for o in OPTIONS]
    envs = [o.env for o in OPTIONS]
    assert len(set(flags)) == len(flags) and len(set(envs)) == len(envs)
    assert not set(envs) & OTHER_ENV
    assert list(SECTIONS) == [f.name for f in dataclasses.fields(PeerConfig)]
    for opt in OPTIONS:
        assert opt.field in {f.name for f in dataclasses.fields(SECTIONS[opt.section])}, opt
    assert "round_tokens" not in {f.name for f in dataclasses.fields(RoundConfig)}  # the budget owns it now
    assert {(o.section, o.field) for o in OPTIONS} >= {("budget", "round_tokens"), ("budget", "round_seconds"),
                                                         ("budget", "close_early"), ("round", "control_timeout_s")}


def test_help_lists_every_flag_with_its_env_var() -> None:
    parser = argparse.ArgumentParser(prog="swarmloco peer")
    add_arguments(parser)
    text = " ".join(parser.format_help().split())  # argparse wraps lines anywhere between words
    for opt in OPTIONS:
        assert opt.flag in text and f"[env {opt.env}]" in text, opt.flag
    assert "--no-close-early" in text and "SWARMLOCO_CONFIG" in text


def test_new_flags_reach_their_sections() -> None:
    cfg = build_config(_parse("--round-tokens", "4096", "--round-seconds", "2.5", "--no-close-early",
                              "--control-timeout", "3", "--shard-index", "auto", "--num-shards", "4",
                              "--bootstrap-file", "/b/c.json", "--bootstrap-host", "coordinator",
                              "--bootstrap-port", "4001", "--bootstrap-wait", "9"), env={})
    assert cfg.budget == BudgetConfig(round_tokens=4096, round_seconds=2.5, close_early=False)
    assert cfg.round.control_timeout_s == 3.0
    assert (cfg.run.shard_index, cfg.run.num_shards) == (None, 4)
    assert (cfg.bootstrap.file, cfg.bootstrap.host, cfg.bootstrap.port, cfg.bootstrap.wait_s) == (
        "/b/c.json", "coordinator", 4001, 9.0)
    env = {"SWARMLOCO_INITIAL_PEER": "/ip4/1.2.3.4/tcp/1/p2p/A,/ip4/1.2.3.5/tcp/1/p2p/B",
           "SWARMLOCO_CLOSE_EARLY": "off", "SWARMLOCO_SHARD_INDEX": "AUTO", "SWARMLOCO_NUM_SHARDS": "3"}
    cfg = build_config(_parse(), env=env)
    assert cfg.network.initial_peers == ("/ip4/1.2.3.4/tcp/1/p2p/A", "/ip4/1.2.3.5/tcp/1/p2p/B")
    assert cfg.budget.close_early is False and cfg.run.shard_index is None


def test_precedence_defaults_toml_env_flags(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[run]\nmax_steps = 11\npreset = "small"\n[train]\nlr = 0.001\n[budget]\nround_tokens = 64\n'
                    '[round]\nquorum = 3\n[network]\ninitial_peers = ["/ip4/1.2.3.4/tcp/1"]\n')
    cfg = build_config(_parse("--config", str(toml)), env={})
    assert (cfg.run.max_steps, cfg.run.preset, cfg.train.lr) == (11, "small", 0.001)
    assert (cfg.budget.round_tokens, cfg.round.quorum, cfg.network.initial_peers) == (64, 3, ("/ip4/1.2.3.4/tcp/1",))
    cfg = build_config(_parse("--config", str(toml)), env={"SWARMLOCO_MAX_STEPS": "12", "SWARMLOCO_ROUND_TOKENS": "65"})
    assert (cfg.run.max_steps, cfg.budget.round_tokens) == (12, 65)
    cfg = build_config(_parse("--config", str(toml), "--max-steps", "13"), env={"SWARMLOCO_MAX_STEPS": "12"})
    assert cfg.run.max_steps == 13
    assert build_config(_parse(), env={"SWARMLOCO_SOLO": "yes"}).run.solo is True
    cfg = build_config(_parse(), env={"SWARMLOCO_CONFIG": str(toml)})
    assert cfg.run.max_steps == 11


def test_empty_env_var_counts_as_unset(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[run]\nmax_steps = 11\n")
    env = {"SWARMLOCO_CONFIG": str(toml), "SWARMLOCO_MAX_STEPS": "", "SWARMLOCO_BOGUS": "",
           "SWARMLOCO_COORDINATOR": " "}
    cfg = build_config(_parse(), env=env)
    assert cfg.run.max_steps == 11  # the TOML value survives an empty variable
    assert cfg.run.coordinator is None  # whitespace only is empty too (not a bad URL)
    assert build_config(_parse(), env={"SWARMLOCO_USE_RELAY": ""}).network.use_relay is True  # not read as false
    assert build_config(_parse(), env={"SWARMLOCO_CONFIG": ""}) == PeerConfig()


@pytest.mark.parametrize(("name", "suggestion"), [
    ("SWARMLOCO_MAX_STEP", "SWARMLOCO_MAX_STEPS"), ("SWARMLOCO_QUOROM", "SWARMLOCO_QUORUM"),
    ("SWARMLOCO_INITIAL_PEERS", "SWARMLOCO_INITIAL_PEER"), ("SWARMLOCO_ROUND_TOKEN", "SWARMLOCO_ROUND_TOKENS"),
    ("SWARMLOCO_FAULT", "SWARMLOCO_FAULTS")])
def test_unknown_env_var_names_the_closest_setting(name: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(_parse(), env={name: "3"})
    assert str(info.value) == f"{name}: unknown setting; did you mean {suggestion}?"


def test_unknown_env_var_without_a_close_match_points_at_help() -> None:
    with pytest.raises(ConfigError, match=r"^SWARMLOCO_ZZZZZZZZZZZZ: unknown setting; `swarmloco peer --help` lists"):
        check_env({"SWARMLOCO_ZZZZZZZZZZZZ": "1"})


def test_env_vars_used_elsewhere_are_allowed() -> None:
    env = {"SWARMLOCO_FAULTS": "inner_step=kill@3", "SWARMLOCO_UPDATE_SCREENSHOT": "1", "OTHER_TOOL_MAX_STEP": "1",
           "SWARMLOCO_MAX_STEPS": "5"}
    assert build_config(_parse(), env=env).run.max_steps == 5


def test_toml_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found: .*nope.toml"):
        build_config(_parse("--config", str(tmp_path / "nope.toml")), env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nmax_stepz = 3\n")
    with pytest.raises(ConfigError, match="unknown key run.max_stepz"):
        build_config(_parse("--config", str(bad)), env={})
    bad.write_text("[round]\nround_tokens = 3\n")
    with pytest.raises(ConfigError, match="unknown key round.round_tokens"):
        build_config(_parse("--config", str(bad)), env={})
    bad.write_text("[swarm]\nquorum = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section \[swarm\].*budget, bootstrap"):
        build_config(_parse("--config", str(bad)), env={})
    bad.write_text("[train]\nlr = 'fast'\n")
    with pytest.raises(ConfigError, match="inner_lr: got 'fast'"):
        build_config(_parse("--config", str(bad)), env={})
    bad.write_text("[train]\ninner_steps = 2.5\n")
    with pytest.raises(ConfigError, match="inner_steps: got 2.5, allowed a value of type int"):
        build_config(_parse("--config", str(bad)), env={})


def test_section_types_are_fully_hinted() -> None:
    """Every field has a type the loader can coerce to: a new field with an odd type fails here, not at a user."""
    for cls in SECTIONS.values():
        for name, tp in typing.get_type_hints(cls).items():
            args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis] or [tp]
            assert all(a in (int, float, str, bool) for a in args), (cls.__name__, name, tp)
