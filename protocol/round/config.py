"""What a round is configured by, and what the protocol knows of the model: torch-free, so that a command line
can be parsed and validated without importing torch."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from swarmloco.protocol.base.codec_names import check_codec_name

AGGREGATORS = ("clip", "mean")
MAX_TOKENS = 2**40  # no honest peer trains on a trillion tokens in one round; larger claims are refused


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    """How groups form and how contributions are merged. Every deadline of a round derives from these numbers."""

    quorum: int = 2
    grace_min_s: float = 0.5
    grace_max_s: float = 10.0
    round_timeout_s: float = 60.0  # a ready peer waits this long for a group before giving the round up
    view_s: float = 0.0  # the first view's length (0: the shortest that fits a join, the grace window and a close)
    exchange_timeout_s: float = 60.0  # moving one contribution, or one result, over the wire
    control_timeout_s: float = 10.0  # one small control frame (join request and reply, group closed, abort)
    codec: str = "int8"
    max_group: int = 64
    weight_cap_factor: float = 4.0  # a member's token weight is capped at this × the group's median claim
    stale_discount: float = 0.5  # weight × discount**staleness for a Δ computed from an older θ
    max_staleness: int = 2
    aggregator: str = "clip"  # per shard: "clip" (median-norm clip, far outliers dropped) or "mean" (plain mean)
    clip_factor: float = 2.0  # clip radius: this × the median norm of the shard's parts
    reject_factor: float = 10.0  # parts longer than this × the median norm are dropped (0: clip only)
    audit_probes: int = 2  # random probes per shard in the audit of every result (0: no audit)

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.quorum <= 10_000, "quorum", self.quorum, "1 .. 10000"),
            (0 <= self.grace_min_s <= self.grace_max_s <= 3600, "grace", (self.grace_min_s, self.grace_max_s),
             "0 <= grace_min_s <= grace_max_s <= 3600"),
            (1 <= self.round_timeout_s <= 86400, "round_timeout_s", self.round_timeout_s, "1 .. 86400"),
            (self.view_s == 0 or 0.1 <= self.view_s <= 3600, "view_s", self.view_s, "0 (derived) or 0.1 .. 3600"),
            (1 <= self.exchange_timeout_s <= 3600, "exchange_timeout_s", self.exchange_timeout_s, "1 .. 3600"),
            (0.5 <= self.control_timeout_s <= 600, "control_timeout_s", self.control_timeout_s, "0.5 .. 600"),
            (2 <= self.max_group <= 10_000, "max_group", self.max_group, "2 .. 10000"),
            (1 <= self.weight_cap_factor <= 1e6, "weight_cap_factor", self.weight_cap_factor, "1 .. 1e6"),
            (0 < self.stale_discount <= 1, "stale_discount", self.stale_discount, "0 < discount <= 1"),
            (0 <= self.max_staleness <= 100, "max_staleness", self.max_staleness, "0 .. 100"),
            (0 <= self.audit_probes <= 16, "audit_probes", self.audit_probes, "0 .. 16"),
        ]
        for ok, name, value, allowed in checks:
            if not ok:
                raise ValueError(f"{name}: got {value!r}, allowed {allowed}")
        check_codec_name(self.codec)
        self.rule  # noqa: B018 - validates the aggregation settings

    @property
    def rule(self) -> Rule:
        return Rule(aggregator=self.aggregator, clip_factor=self.clip_factor, reject_factor=self.reject_factor)


@dataclass(frozen=True, kw_only=True)
class LocalModel:
    """What the protocol knows about the model: its fingerprint, its config (to name differences) and flat size."""

    fingerprint: str
    config: dict[str, Any]
    numel: int

    @property
    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True, default=str)


@dataclass(frozen=True)
class Deadlines:
    """Every wait of one round, in seconds, from one RoundConfig (no other literal timeouts in the protocol)."""

    control: float  # one control frame (a claim, the plan, a vote, the certificate; opening the shard pipes)
    transfer: float  # all parts of the shards on the wire, and again all reduced shards
    linger: float  # leader: how long a member's stream stays open after the certificate, for it to be read
    # the whole exchange as the training thread waits for it: claims, plan and pipes, then up to two passes of the
    # reduce (a second when a reduced shard was lost), each two transfers and two settlements
    exchange: float
    # the least a reduced shard is waited for once a majority of them is in (then twice the time they took). Short:
    # reducers' shards are cut to their claimed bandwidths, so honest ones arrive together, and a shard cut off
    # costs a second pass of the reduce, not the round; a withholding reducer costs this, not a control timeout
    result_grace: float

    @classmethod
    def of(cls, cfg: RoundConfig) -> Deadlines:
        transfer, control = cfg.exchange_timeout_s, cfg.control_timeout_s
        return cls(control=control, transfer=transfer, linger=transfer, exchange=4 * transfer + 9 * control,
                   result_grace=control / 4)


@dataclass(frozen=True)
class Rule:
    aggregator: str = "clip"
    clip_factor: float = 2.0
    reject_factor: float = 10.0  # 0: never reject, only clip

    def __post_init__(self) -> None:
        if self.aggregator not in AGGREGATORS:
            raise ValueError(f"aggregator: got {self.aggregator!r}, allowed {', '.join(AGGREGATORS)}")
        if not 1.0 <= self.clip_factor <= 1e3:
            raise ValueError(f"clip_factor: got {self.clip_factor}, allowed 1 .. 1000")
        if self.reject_factor != 0 and not self.clip_factor <= self.reject_factor <= 1e6:
            raise ValueError(f"reject_factor: got {self.reject_factor}, allowed 0 (off) or clip_factor .. 1e6")
