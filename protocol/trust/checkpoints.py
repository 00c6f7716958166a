"""Authority checkpoints: the run authority's signed word on which certified state is the run's, and whose work
built it.

Identities are free in an open run, so a certificate signed by enough of them proves nothing about the run: a few
identities on one machine can sign a chain of their own and claim more work than the honest one. The authority
(the coordinator, holding the key that signs tickets) follows the certified rounds peers report and, every few
minutes, signs a `Checkpoint`: the heaviest certified state it verified that extends its previous checkpoint, and
each member's *seniority* along that chain, the tokens certified rounds credited it as verified work
(`swarmloco.protocol.round.credit`). Peers read the newest checkpoint from the DHT and then:
- never adopt a state at an earlier round than the checkpoint, or another state at its round;
- weigh a certificate's signers by seniority: a state ahead of the checkpoint is adopted only when its signers hold
  at least a third of the seniority of the other peers the verifier sees (`supports_by_seniority`). An identity
  nobody credited weighs nothing, however many there are.

A member is senior only once `PROBATION_ROUNDS` certified rounds on the checkpointed chain credited it. Training
never waits for a checkpoint: without one, or when nobody the verifier sees is senior yet, the count-based rule
(`swarmloco.protocol.trust.certificates.supports`) applies as before.
"""
from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from swarmloco.protocol.trust.identity import Identity, verify

__all__ = ["Checkpoint", "CheckpointError", "PROBATION_ROUNDS", "supports_by_seniority"]

PROBATION_ROUNDS = 3  # certified rounds that must credit a peer before its signature weighs anything
MAX_SENIORS = 256  # the heaviest peers a checkpoint lists (one DHT value); the rest weigh nothing
SENIORITY_CAP = 4  # one peer's seniority counts at most this × the median senior's
MAX_CHECKPOINT_TTL_S = 900.0  # a checkpoint is kept in the DHT at most this long past its signing
_DOMAIN = b"swarmloco-checkpoint-v1\n"
_HASH = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    run_id: str
    authority: str  # the peer id whose key signed it: the run's authority
    round: int
    state_hash: str
    work: int  # the chain's cumulative credited tokens at this state, as its certificate says
    seniors: tuple[tuple[str, int, int], ...]  # (peer, credited tokens, credited rounds) along the chain, by peer
    issued_at: float
    signature: str = ""

    def body(self) -> bytes:
        fields = asdict(self)
        fields.pop("signature")
        fields["seniors"] = [list(s) for s in self.seniors]
        return _DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def issue(cls, authority: Identity, *, run_id: str, round: int, state_hash: str, work: int,
              seniors: Mapping[str, tuple[int, int]], now: float | None = None) -> Checkpoint:
        """Sign a checkpoint; `seniors` maps peer -> (credited tokens, credited rounds), the heaviest
        `MAX_SENIORS` are kept."""
        kept = sorted(seniors.items(), key=lambda kv: (-kv[1][0], kv[0]))[:MAX_SENIORS]
        unsigned = cls(run_id=run_id, authority=authority.peer_id, round=round, state_hash=state_hash, work=work,
                       seniors=tuple(sorted((p, int(t), int(r)) for p, (t, r) in kept)),
                       issued_at=round_time(time.time() if now is None else now))
        problem = unsigned.problem()
        if problem:
            raise CheckpointError(problem)
        return cls(**{**asdict(unsigned), "seniors": unsigned.seniors,
                      "signature": authority.sign(unsigned.body()).hex()})

    def problem(self) -> str:
        """Why the fields are malformed ("" when well formed); the signature is checked by `parse`."""
        if not (isinstance(self.round, int) and not isinstance(self.round, bool) and 1 <= self.round < 2**40):
            return "round outside 1 .. 2^40"
        if not (isinstance(self.state_hash, str) and _HASH.fullmatch(self.state_hash)):
            return "state hash must be 64 hex digits"
        if not (isinstance(self.work, int) and not isinstance(self.work, bool) and 0 <= self.work < 2**62):
            return "work outside 0 .. 2^62"
        if not (isinstance(self.issued_at, (int, float)) and math.isfinite(self.issued_at)):
            return "issued_at must be a finite number"
        if len(self.seniors) > MAX_SENIORS:
            return f"at most {MAX_SENIORS} seniors"
        peers = [s[0] for s in self.seniors]
        if peers != sorted(set(peers)) or not all(
            isinstance(p, str) and 0 < len(p) <= 128 and _count(t) and _count(r) for p, t, r in self.seniors
        ):
            return "seniors must be (peer id, tokens, rounds) sorted by peer, without repeats"
        return ""

    def to_value(self) -> dict[str, Any]:
        return {**asdict(self), "seniors": [list(s) for s in self.seniors]}

    @classmethod
    def parse(cls, value: Any, *, run_id: str, authority: str) -> Checkpoint:
        """A verified checkpoint; raises CheckpointError for anything malformed or not signed by `authority`."""
        names = set(cls.__dataclass_fields__)
        if not isinstance(value, dict) or set(value) != names:
            raise CheckpointError(f"checkpoint must have exactly the fields {sorted(names)}")
        seniors = value["seniors"]
        if not (isinstance(seniors, list) and len(seniors) <= MAX_SENIORS
                and all(isinstance(s, list) and len(s) == 3 for s in seniors)):
            raise CheckpointError("checkpoint seniors must be a list of [peer, tokens, rounds]")
        if not all(isinstance(value[k], str) for k in ("run_id", "authority", "state_hash", "signature")):
            raise CheckpointError("checkpoint fields have the wrong types")
        cp = cls(**{**value, "seniors": tuple(tuple(s) for s in seniors)})
        problem = cp.problem()
        if problem:
            raise CheckpointError(f"malformed checkpoint: {problem}")
        if cp.run_id != run_id or cp.authority != authority:
            raise CheckpointError("checkpoint is for another run or authority")
        try:
            signature = bytes.fromhex(cp.signature)
        except ValueError:
            raise CheckpointError("checkpoint signature is not hex") from None
        if not verify(authority, cp.body(), signature):
            raise CheckpointError("checkpoint signature is invalid")
        return cp

    def seniority(self, peer: str) -> int:
        """What `peer`'s signature weighs: its credited tokens, at most `SENIORITY_CAP` × the (lower) median of the
        seniors past probation, so that no one peer's long history outweighs the rest; 0 while on probation."""
        return self._table.get(peer, 0)

    def weight(self, peers: Iterable[str]) -> int:
        table = self._table
        return sum(table.get(p, 0) for p in set(peers))

    @functools.cached_property
    def _table(self) -> dict[str, int]:  # computed once: matchmaking weighs every active peer on every look
        past = {p: t for p, t, r in self.seniors if r >= PROBATION_ROUNDS and t > 0}
        if not past:
            return {}
        cap = SENIORITY_CAP * sorted(past.values())[(len(past) - 1) // 2]
        return {p: min(t, cap) for p, t in past.items()}

    def precedes(self, round_number: int, state_hash: str) -> bool:
        """Whether a state at (round, hash) is one no peer may adopt: before the checkpoint, or beside it."""
        return round_number < self.round or (round_number == self.round and state_hash != self.state_hash)

    def newer_than(self, other: Checkpoint | None) -> bool:
        return other is None or (self.issued_at, self.round) > (other.issued_at, other.round)


def supports_by_seniority(checkpoint: Checkpoint | None, signers: Iterable[str], seen: Iterable[str]) -> bool | None:
    """Whether a certificate's `signers` hold at least a third of the seniority of the peers `seen` (the others a
    verifier sees; not itself: a peer that fell behind must still follow the others); None when that cannot be
    judged (no checkpoint, or nobody seen is senior): the caller then falls back to the count-based rule.

    A third, not a half: a round is certified by a majority of the peers that were *there*, and the heaviest senior
    may be the one missing; identities nobody credited weigh nothing under any threshold."""
    if checkpoint is None:
        return None
    total = checkpoint.weight(seen)
    if total <= 0:
        return None
    return 3 * checkpoint.weight(signers) >= total


def round_time(t: float) -> float:
    return round(t, 3)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62
