"""Peer configuration: one typed tree (`PeerConfig`) of small frozen dataclasses, filled from
defaults < TOML file < SWARMLOCO_* env < flags by `build_config`.

Which flag, TOML key and env var feed which field is the static table in peer/options.py. Validation lives in each
dataclass's `__post_init__`; a bad value becomes a one-line `ConfigError` naming the setting, the value and what is
allowed. Nothing here touches the network or waits: startup decisions that do (the bootstrap ready file, the shard
of a compose replica) are made afterwards by peer/bootstrap.py.

This module and the config modules it imports (peer/outer_config.py, protocol/network/config.py,
protocol/round/config.py, ...) import neither torch nor hivemind: peer/cli_args.py reads each flag's kind and
default from these dataclasses, and `swarmloco peer --help` answers without loading either.
"""
from __future__ import annotations

import argparse
import difflib
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from swarmloco.peer.options import CONFIG_ENV, ENV_PREFIX, OPTIONS, OTHER_ENV, Option
from swarmloco.peer.outer_config import OuterConfig
from swarmloco.peer.presets import PRESETS
from swarmloco.peer.tickets import AdmissionConfig
from swarmloco.protocol.network.config import NetworkConfig
from swarmloco.protocol.round.config import MAX_TOKENS, RoundConfig


class ConfigError(ValueError):
    """A user-facing configuration problem; its message is one actionable line."""


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: got {value!r}, allowed {allowed}")


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
    """The local machine: which device, how many CPU threads, and the seed every peer of a swarm shares."""

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
    shard_index: int | None = 0  # None ("auto"): chosen at startup from the compose replica number (peer/bootstrap.py)
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
    join: str | None = None  # a run's manifest: coordinator URL, manifest URL or file (swarmloco.peer.join)
    wait_for_peers: int = 0  # swarm: do not start training until this many compatible peers (us included) are up
    train_while_waiting: bool = True  # swarm: keep taking inner steps while a group forms (False = idle, lock-step)

    def __post_init__(self) -> None:
        _check(self.preset in PRESETS, "preset", self.preset, ", ".join(PRESETS))
        _check(self.max_steps >= 0, "max_steps", self.max_steps, ">= 0 (0 = unbounded)")
        _check(self.max_rounds >= 0, "max_rounds", self.max_rounds, ">= 0 (0 = unbounded)")
        _check(self.num_shards >= 1, "num_shards", self.num_shards, ">= 1")
        _check(self.shard_index is None or 0 <= self.shard_index < self.num_shards, "shard_index", self.shard_index,
               f"0 .. {self.num_shards - 1} or auto")
        _check(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every, ">= 0 (0 = only at exit)")
        _check(self.eval_every >= 1, "eval_every", self.eval_every, ">= 1")
        _check(self.log_format in ("text", "json"), "log_format", self.log_format, "text, json")
        _check(1.0 <= self.slowdown <= 100.0, "slowdown", self.slowdown, "1 .. 100")
        _check(0 <= self.wait_for_peers <= 10_000, "wait_for_peers", self.wait_for_peers, "0 .. 10000")
        _check(0.0 <= self.linger_s <= 3600.0, "linger", self.linger_s, "0 .. 3600 seconds")
        _check(self.coordinator is None or self.coordinator.startswith(("http://", "https://")), "coordinator",
               self.coordinator, "an http:// or https:// URL")


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """When a peer's round of local training is over."""

    round_tokens: int = 0  # budget per round in tokens (0 = use train.inner_steps)
    round_seconds: float = 0.0  # budget per round in seconds (0 = use train.inner_steps)
    # End the round's local training early to join a group already forming for our round: a slow peer then
    # contributes fewer tokens instead of missing the round.
    close_early: bool = True

    def __post_init__(self) -> None:
        # the same bound the round code puts on a contribution's token claim, so a budget never exceeds it
        _check(0 <= self.round_tokens <= MAX_TOKENS, "round_tokens", self.round_tokens, f"0 .. {MAX_TOKENS}")
        _check(0 <= self.round_seconds <= 86400, "round_seconds", self.round_seconds, "0 .. 86400")


@dataclass(frozen=True, kw_only=True)
class AdoptConfig:
    """What a state offered by others (a join, a re-sync, a fork switch) must pass before this peer adopts it, however
    valid its certificate: its loss on held-out batches of this peer's own choosing, and, when it is one round past
    ours, its distance from ours (peer/adoption.py)."""

    tolerance: float = 0.1  # refuse a state whose loss exceeds our own state's by more than this fraction
    # one round ahead: refuse a state farther than this many of our recent outer steps. 8, not 4: a round that
    # merges a peer's progress from rounds that failed moves the state several of a slow peer's own steps (4.8 seen)
    step_factor: float = 8.0

    def __post_init__(self) -> None:
        _check(0.0 <= self.tolerance <= 10.0, "adopt_tolerance", self.tolerance, "0 .. 10 (a fraction of our loss)")
        _check(self.step_factor == 0.0 or 1.0 <= self.step_factor <= 1000.0, "adopt_step_factor", self.step_factor,
               "0 (no distance check) or 1 .. 1000")


@dataclass(frozen=True, kw_only=True)
class BootstrapConfig:
    """Where a peer finds its first contact when no --initial-peer is given: the ready file a coordinator writes."""

    file: str | None = None  # the coordinator's --ready-file (JSON with dht_peer_id and dht_maddrs)
    wait_s: float = 300.0  # the coordinator may still be starting: wait this long for the file to name its DHT node
    host: str | None = None  # dial /dns4/HOST/tcp/PORT/p2p/ID; None: the multiaddrs written in the file
    port: int = 31337

    def __post_init__(self) -> None:
        _check(0 <= self.wait_s <= 86400, "bootstrap_wait", self.wait_s, "0 .. 86400 seconds")
        _check(1 <= self.port <= 65535, "bootstrap_port", self.port, "1 .. 65535")
        ok = self.host is None or (0 < len(self.host) <= 253 and all(c.isalnum() or c in "-._:" for c in self.host))
        _check(ok, "bootstrap_host", self.host, "a host name or an IP address")


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """Everything one `swarmloco peer` process is configured with; each field is one TOML section."""

    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    round: RoundConfig = field(default_factory=RoundConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    adopt: AdoptConfig = field(default_factory=AdoptConfig)

    @property
    def identity_path(self) -> str:
        """The peer's identity file: --identity, or WORKDIR/identity.key (created on first use, so ids are stable)."""
        return self.network.identity or str(Path(self.run.workdir) / "identity.key")


# section name -> its dataclass, in PeerConfig's order (the TOML sections and the order of --help)
SECTIONS: dict[str, type] = {name: cls for name, cls in typing.get_type_hints(PeerConfig).items()}
_BY_FIELD: dict[tuple[str, str], Option] = {(o.section, o.field): o for o in OPTIONS}


def field_type(cls: type, name: str) -> Any:
    """The type annotation of field `name` of dataclass `cls`, resolved."""
    return typing.get_type_hints(cls)[name]


def base_type(tp: Any) -> tuple[Any, bool]:
    """(scalar type, is_list) for int/float/str/bool, `X | None` and tuple[str, ...]."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return base_type(args[0])
    if origin in (tuple, list):
        return typing.get_args(tp)[0], True
    return tp, False


def _coerce(value: Any, tp: Any, name: str, *, auto: bool = False) -> Any:
    base, is_list = base_type(tp)
    if is_list:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name}: got {value!r}, allowed a list of {base.__name__}")
        return tuple(_coerce(v, base, name) for v in items if v != "")
    if value is None or auto and isinstance(value, str) and value.strip().lower() == "auto":
        return None
    allowed = f"a value of type {base.__name__}" + (" or auto" if auto else "")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            lowered = str(value).strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        # TOML gives real numbers and booleans: refuse 2.5 for an int and `true` for a number instead of truncating
        if base is int and isinstance(value, float) or isinstance(value, bool):
            raise ValueError
        return base(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: got {value!r}, allowed {allowed}") from None


def load_toml(path: str) -> dict[str, dict[str, Any]]:
    """The file's sections, with every section and key checked against the dataclasses (a typo is an error)."""
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
        # the flag's name works as a key too: --inner-lr is [train] inner_lr as well as [train] lr
        aliases = {o.label: o.field for o in OPTIONS if o.section == section and o.label != o.field}
        keys: dict[str, Any] = {}
        written: dict[str, str] = {}  # field -> the key the file used for it
        for key, value in values.items():
            name = aliases.get(key, key)
            if name not in known:
                allowed = ", ".join(sorted(known | set(aliases)))
                raise ConfigError(f"config: unknown key {section}.{key} in {p}, allowed {allowed}")
            if name in keys:
                raise ConfigError(f"config: {section}.{written[name]} and {section}.{key} in {p} are one setting; "
                                  "keep one")
            keys[name], written[name] = value, key
        raw[section] = keys
    return raw


def _set_env(env: Mapping[str, str]) -> dict[str, str]:
    """The SWARMLOCO_* variables that are set. An empty one counts as unset, because docker compose passes an
    unset `${VAR:-}` through as ""."""
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIX) and v.strip()}


def check_env(env: Mapping[str, str]) -> None:
    """Refuse an unknown SWARMLOCO_* variable: a misspelt setting would otherwise be silently ignored."""
    known = sorted({o.env for o in OPTIONS} | OTHER_ENV)
    for name in sorted(_set_env(env)):
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}?" if close else "`swarmloco peer --help` lists every SWARMLOCO_* variable"
            raise ConfigError(f"{name}: unknown setting; {hint}")


def _construct(cls: type, kwargs: dict[str, Any]) -> Any:
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # the protocol's dataclasses raise plain ValueError, in the same style
        raise ConfigError(str(exc)) from None


def build_config(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None, *,
                 fixed: Mapping[str, Mapping[str, Any]] | None = None,
                 added: Mapping[str, Mapping[str, tuple[Any, ...]]] | None = None) -> PeerConfig:
    """Merge defaults < TOML (--config or SWARMLOCO_CONFIG) < SWARMLOCO_* env < flags. Raises ConfigError.

    `fixed`: settings a joined run fixes (swarmloco.peer.join); any layer setting one of them to another value is
    an error. `added`: list settings the run extends (its bootstrap addresses after the user's own)."""
    set_env = _set_env(os.environ if env is None else env)
    check_env(set_env)
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    config_path = getattr(args, "config", None) or set_env.get(CONFIG_ENV)
    if config_path:
        for section, entries in load_toml(config_path).items():
            values[section].update(entries)
    for opt in OPTIONS:
        if opt.env in set_env:
            values[opt.section][opt.field] = set_env[opt.env]
        if args is not None and getattr(args, opt.dest, None) is not None:
            values[opt.section][opt.field] = getattr(args, opt.dest)
    sections: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        kwargs = {}
        for key, value in values[section].items():
            kwargs[key] = _coerce_field(cls, section, key, value)
        for key, value in (fixed or {}).get(section, {}).items():
            if key not in {f.name for f in fields(cls)}:
                raise ConfigError(f"the run fixes an unknown setting {section}.{key}")
            want = _coerce_field(cls, section, key, value)
            if key in kwargs and kwargs[key] != want:
                opt = _BY_FIELD.get((section, key))
                raise ConfigError(f"{opt.flag if opt else f'{section}.{key}'} is fixed by the run you join at "
                                  f"{value!r}; leave it out (you set {values[section][key]!r})")
            kwargs[key] = want
        for key, extra in (added or {}).get(section, {}).items():
            kwargs[key] = tuple(kwargs.get(key, ())) + tuple(x for x in extra if x not in kwargs.get(key, ()))
        sections[section] = _construct(cls, kwargs)
    return PeerConfig(**sections)


def _coerce_field(cls: type, section: str, key: str, value: Any) -> Any:
    opt = _BY_FIELD.get((section, key))
    return _coerce(value, field_type(cls, key), opt.label if opt else key, auto=opt is not None and opt.auto)
