"""Peer configuration: small keyword-only dataclasses, filled from defaults < TOML file < SWARMLOCO_* env < flags.

One table (`OPTIONS`) names every setting once: its flag, its TOML section/key, its env var and its help, so the
three sources cannot drift apart. Validation lives in each dataclass's `__post_init__`; a bad value becomes a
one-line `ConfigError` naming the field, the value and what is allowed.
"""
from __future__ import annotations

import argparse
import os
import tomllib
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from peer.model import PRESETS
from peer.outer import OuterConfig

ENV_PREFIX = "SWARMLOCO_"


class ConfigError(ValueError):
    """A user-facing configuration problem; its message is one actionable line."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Inner optimisation (AdamW) — DiLoCo defaults: lr 4e-4, wd 0.1, betas (0.9, 0.95)."""

    lr: float = 4e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 50
    decay_steps: int = 0  # cosine decay length in global steps; 0 = constant after warm-up
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 0  # 0 = the task's default
    inner_steps: int = 50  # H: inner steps per round when no token/second budget is set

    def __post_init__(self) -> None:
        _check(0 < self.lr <= 1, "inner_lr", self.lr, "0 < lr <= 1")
        _check(0 <= self.weight_decay <= 1, "weight_decay", self.weight_decay, "0 <= wd <= 1")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "betas", (self.beta1, self.beta2), "0 <= beta < 1")
        _check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0")
        _check(self.decay_steps >= 0, "decay_steps", self.decay_steps, ">= 0")
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "0 <= ratio <= 1")
        _check(self.grad_clip >= 0, "grad_clip", self.grad_clip, ">= 0 (0 disables clipping)")
        _check(0 <= self.batch_size <= 65536, "batch_size", self.batch_size, "0 (task default) .. 65536")
        _check(1 <= self.inner_steps <= 1_000_000, "inner_steps", self.inner_steps, "1 .. 1000000")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    device: str = "auto"
    threads: int = 0  # 0 = leave torch's default
    seed: int = 0

    def __post_init__(self) -> None:
        ok = self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        _check(ok, "device", self.device, "auto, cpu, cuda or cuda:N")
        _check(0 <= self.threads <= 1024, "threads", self.threads, "0 (default) .. 1024")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What this peer process does and where it writes."""

    preset: str = "tiny"
    task: str | None = None
    solo: bool = False
    max_steps: int = 0  # 0 = unbounded
    max_rounds: int = 0  # 0 = unbounded
    shard_index: int = 0
    num_shards: int = 1
    workdir: str = "runs/peer"
    resume: bool = False
    checkpoint_every: int = 1  # rounds
    eval_every: int = 1  # rounds
    summary_json: str | None = None
    log_format: str = "text"
    slowdown: float = 1.0  # artificial slowdown factor for demos and tests (sleeps after each step)
    linger_s: float = 0.0  # swarm: keep serving state this long after the last round, for late peers
    coordinator: str | None = None  # URL of a coordinator to report to (never needed for training)
    wait_for_peers: int = 0  # swarm: do not start training until this many compatible peers (us included) are up
    train_while_waiting: bool = True  # swarm: keep taking inner steps while a group forms (False = idle, lock-step)

    def __post_init__(self) -> None:
        _check(self.preset in PRESETS, "preset", self.preset, ", ".join(PRESETS))
        _check(self.max_steps >= 0, "max_steps", self.max_steps, ">= 0 (0 = unbounded)")
        _check(self.max_rounds >= 0, "max_rounds", self.max_rounds, ">= 0 (0 = unbounded)")
        _check(self.num_shards >= 1, "num_shards", self.num_shards, ">= 1")
        _check(0 <= self.shard_index < self.num_shards, "shard_index", self.shard_index, f"0 .. {self.num_shards - 1}")
        _check(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every, ">= 0 (0 = only at exit)")
        _check(self.eval_every >= 1, "eval_every", self.eval_every, ">= 1")
        _check(self.log_format in ("text", "json"), "log_format", self.log_format, "text, json")
        _check(1.0 <= self.slowdown <= 100.0, "slowdown", self.slowdown, "1 .. 100")
        _check(0 <= self.wait_for_peers <= 10_000, "wait_for_peers", self.wait_for_peers, "0 .. 10000")
        _check(0.0 <= self.linger_s <= 3600.0, "linger", self.linger_s, "0 .. 3600 seconds")
        _check(self.coordinator is None or self.coordinator.startswith(("http://", "https://")), "coordinator",
               self.coordinator, "an http:// or https:// URL")


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: got {value!r}, allowed {allowed}")


@dataclass(frozen=True)
class Option:
    flag: str
    section: str
    field: str
    help: str
    repeat: bool = False  # list-valued: the flag may repeat; the env var is comma-separated

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.lstrip("-").replace("-", "_").upper()

    @property
    def dest(self) -> str:
        return f"{self.section}__{self.field}"


SECTIONS: dict[str, type] = {"run": RunConfig, "train": TrainConfig, "outer": OuterConfig, "runtime": RuntimeConfig}

OPTIONS: list[Option] = [
    Option("--preset", "run", "preset", f"model size of the default task: {', '.join(PRESETS)}"),
    Option("--task", "run", "task", "custom task as 'package.module:factory' (see README)"),
    Option("--solo", "run", "solo", "train alone, without any network (M=1 DiLoCo)"),
    Option("--max-steps", "run", "max_steps", "stop after this many inner steps (0 = no limit)"),
    Option("--max-rounds", "run", "max_rounds", "stop after this many outer rounds (0 = no limit)"),
    Option("--shard-index", "run", "shard_index", "which data shard this peer reads"),
    Option("--num-shards", "run", "num_shards", "how many disjoint data shards the corpus is split into"),
    Option("--workdir", "run", "workdir", "directory for checkpoints and logs"),
    Option("--resume", "run", "resume", "continue from the checkpoint in --workdir"),
    Option("--checkpoint-every", "run", "checkpoint_every", "write a checkpoint every N rounds (0 = at exit only)"),
    Option("--eval-every", "run", "eval_every", "evaluate the global model every N rounds"),
    Option("--summary-json", "run", "summary_json", "write a JSON summary of the run to this path at the end"),
    Option("--log-format", "run", "log_format", "progress output: text (live bar) or json (one object per line)"),
    Option("--slowdown", "run", "slowdown", "artificial slowdown factor (>=1) to emulate slower hardware"),
    Option("--linger", "run", "linger_s", "swarm: seconds to keep serving state after the last round"),
    Option("--coordinator", "run", "coordinator", "coordinator URL to report progress to (optional)"),
    Option("--wait-for-peers", "run", "wait_for_peers", "swarm: start training only once this many peers (us included) are up"),
    Option("--train-while-waiting", "run", "train_while_waiting", "swarm: keep training while the group forms (default on)"),
    Option("--inner-lr", "train", "lr", "inner AdamW learning rate"),
    Option("--weight-decay", "train", "weight_decay", "inner AdamW weight decay"),
    Option("--beta1", "train", "beta1", "inner AdamW beta1"),
    Option("--beta2", "train", "beta2", "inner AdamW beta2"),
    Option("--warmup-steps", "train", "warmup_steps", "linear learning-rate warm-up, in global inner steps"),
    Option("--decay-steps", "train", "decay_steps", "cosine decay length in global inner steps (0 = constant)"),
    Option("--min-lr-ratio", "train", "min_lr_ratio", "final learning rate as a fraction of the peak"),
    Option("--grad-clip", "train", "grad_clip", "gradient norm clipping (0 disables)"),
    Option("--batch-size", "train", "batch_size", "sequences per inner step (0 = the task's default)"),
    Option("--inner-steps", "train", "inner_steps", "H: inner steps per round (when no token/second budget is set)"),
    Option("--outer-lr", "outer", "lr", "outer Nesterov learning rate"),
    Option("--outer-momentum", "outer", "momentum", "outer Nesterov momentum"),
    Option("--device", "runtime", "device", "auto (CUDA if available), cpu, cuda or cuda:N"),
    Option("--threads", "runtime", "threads", "torch CPU threads (0 = torch's default)"),
    Option("--seed", "runtime", "seed", "seed for model init and data order (must match across the swarm)"),
]


def register_section(name: str, cls: type, options: list[Option]) -> None:
    """Lets other peer modules (the swarm) add their own dataclass and flags to the same loader."""
    SECTIONS[name] = cls
    OPTIONS.extend(options)


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(scalar type, is_list) for int/float/str/bool, `X | None` and tuple[str, ...]."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (tuple, list):
        return typing.get_args(tp)[0], True
    return tp, False


def _coerce(value: Any, tp: Any, name: str) -> Any:
    base, is_list = _base_type(tp)
    if is_list:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name}: got {value!r}, allowed a list of {base.__name__}")
        return tuple(_coerce(v, base, name) for v in items if v != "")
    if value is None:
        return None
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            lowered = str(value).strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off", ""):
                return False
            raise ValueError
        if base is int and isinstance(value, float) or isinstance(value, bool) and base is not bool:
            raise ValueError
        return base(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: got {value!r}, allowed a value of type {base.__name__}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", help="TOML file with [run], [train], [outer], [runtime], ... sections")
    for opt in OPTIONS:
        tp = _field_type(SECTIONS[opt.section], opt.field)
        base, _ = _base_type(tp)
        help_text = f"{opt.help} [env {opt.env}]"
        if base is bool:
            parser.add_argument(opt.flag, dest=opt.dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif opt.repeat:
            parser.add_argument(opt.flag, dest=opt.dest, action="append", default=None, metavar="VALUE", help=help_text)
        else:
            parser.add_argument(opt.flag, dest=opt.dest, default=None, metavar=opt.field.upper(), help=help_text)


def load_toml(path: str) -> dict[str, dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config: file not found: {p.resolve()}")
    try:
        raw = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config: {p} is not valid TOML: {exc}") from None
    for section, values in raw.items():
        if section not in SECTIONS or not isinstance(values, dict):
            raise ConfigError(f"config: unknown section [{section}] in {p}, allowed {', '.join(SECTIONS)}")
        known = {f.name for f in fields(SECTIONS[section])}
        for key in values:
            if key not in known:
                raise ConfigError(f"config: unknown key {section}.{key} in {p}, allowed {', '.join(sorted(known))}")
    return raw


def build_config(args: argparse.Namespace | None = None, env: typing.Mapping[str, str] | None = None) -> dict[str, Any]:
    """Merge all sources and return {section: dataclass instance}. Raises ConfigError."""
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    config_path = getattr(args, "config", None) or env.get(ENV_PREFIX + "CONFIG")
    if config_path:
        for section, entries in load_toml(config_path).items():
            values[section].update(entries)
    for opt in OPTIONS:
        if opt.env in env:
            values[opt.section][opt.field] = env[opt.env]
        if args is not None and getattr(args, opt.dest, None) is not None:
            values[opt.section][opt.field] = getattr(args, opt.dest)
    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        kwargs = {}
        for key, value in values[section].items():
            label = next((o.flag.lstrip("-").replace("-", "_") for o in OPTIONS if o.section == section and o.field == key), key)
            kwargs[key] = _coerce(value, _field_type(cls, key), label)
        try:
            built[section] = cls(**kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from None
    return built
