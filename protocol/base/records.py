"""DHT key layout and the per-peer status record, validated on read (records come from untrusted peers).

Every key lives under the run id. Each peer keeps one record, under its own subkey of the run's status key:
    swarmloco/<run_id>/peers  ->  {peer_id: PeerRecord}
A record says which global round the peer holds (its hash and the certified work of its chain), whether it is ready
to average that round and in which view of the round's schedule (`swarmloco.protocol.round.schedule`), and when it
expects to be ready (so leaders can size the grace window; once ready, when it became ready), and whether other
peers can dial it (a peer behind NAT cannot lead a view: nobody could join it). A record is a claim:
it is signed by its peer (swarmloco.protocol.trust.signed_records), and a state it names is adopted only with a
commit certificate (swarmloco.protocol.chain.chain).
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

PROTOCOL_VERSION = 10  # 10: one audit probe for all shards (peers of 9 draw others and convict honest reducers)
MAX_VIEW = 2**20  # views of one round; at the capped view length, weeks
MAX_CONFIG_JSON = 4096
MAX_RECORD_TTL_S = 300.0  # a record lives at most this long past its signing: a silent peer drops out in minutes


def peers_key(run_id: str) -> str:
    return f"swarmloco/{run_id}/peers"


def revocations_key(run_id: str) -> str:
    """Where the run's authority publishes its signed revocation list (subkey: the authority's peer id)."""
    return f"swarmloco/{run_id}/revoked"


def checkpoint_key(run_id: str) -> str:
    """Where the run's authority publishes its newest signed checkpoint (subkey: the authority's peer id)."""
    return f"swarmloco/{run_id}/checkpoint"


def fingerprint(task_config: dict[str, Any], layout: list[tuple[str, tuple[int, ...]]]) -> str:
    """Model fingerprint: the task config plus every parameter's name and shape, hashed."""
    blob = json.dumps({"config": task_config, "layout": [[n, list(s)] for n, s in layout]}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def describe_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Human-readable list of config keys that differ, for refusal messages."""
    keys = sorted(set(ours) | set(theirs))
    diffs = [f"{k}: ours {ours.get(k)!r} vs theirs {theirs.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)]
    return "; ".join(diffs) if diffs else "same config, different parameter layout"


@dataclass(frozen=True, kw_only=True)
class PeerRecord:
    version: int
    fingerprint: str
    config_json: str
    round: int  # global round r whose θ_r the peer holds
    state_hash: str
    work: int  # cumulative certified tokens of the chain that ends in θ_r (0 at θ_0): the fork-choice weight
    ready: bool  # done with its budget, waiting to average round r
    view: int  # the view of round r this peer is in (meaningful while ready)
    eta: float  # unix time it expects to be ready (its last estimate)
    updated: float
    reachable: bool = True  # others can dial it (False behind NAT): the transport stamps it, and only such peers lead

    def to_value(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def announce(cls, *, fingerprint: str, config_json: str, round: int, state_hash: str, work: int = 0,
                 ready: bool = False, eta: float | None = None, now: float | None = None) -> PeerRecord:
        """This peer's own record for a state it now holds: our protocol version, view 0, ready time `eta`
        (unix seconds; `now` when omitted, which is the machine's time unless given)."""
        now = time.time() if now is None else now
        return cls(version=PROTOCOL_VERSION, fingerprint=fingerprint, config_json=config_json, round=round,
                   state_hash=state_hash, work=work, ready=ready, view=0, eta=now if eta is None else eta,
                   updated=now)

    @classmethod
    def parse(cls, value: Any) -> PeerRecord | None:
        """A validated record, or None for anything malformed (wrong types, huge or non-finite values)."""
        if not isinstance(value, dict) or set(value) != {f for f in cls.__dataclass_fields__}:
            return None
        try:
            rec = cls(**value)
        except TypeError:
            return None
        ints_ok = all(
            isinstance(getattr(rec, k), int) and not isinstance(getattr(rec, k), bool)
            for k in ("version", "round", "view", "work")
        )
        strs_ok = all(isinstance(getattr(rec, k), str) for k in ("fingerprint", "config_json", "state_hash"))
        floats_ok = all(
            isinstance(getattr(rec, k), (int, float)) and math.isfinite(getattr(rec, k)) for k in ("eta", "updated")
        )
        if not (ints_ok and strs_ok and floats_ok and isinstance(rec.ready, bool) and isinstance(rec.reachable, bool)):
            return None
        if not (0 <= rec.round < 2**40 and 0 <= rec.view <= MAX_VIEW and 0 <= rec.work < 2**62
                and len(rec.config_json) <= MAX_CONFIG_JSON):
            return None
        if len(rec.state_hash) != 64 or len(rec.fingerprint) > 64:
            return None
        return rec

    def config(self) -> dict[str, Any]:
        try:
            value = json.loads(self.config_json)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}

