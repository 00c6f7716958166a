"""The authority's checkpoints: the heaviest certified chain it can vouch for, and each member's seniority on it.

Every `every_s` seconds the coordinator reads the certified rounds peers reported (each certificate verified on
arrival) and signs a `swarmloco.protocol.trust.checkpoints.Checkpoint` for the heaviest state whose chain of
certificates (each one's previous hash the state of the one before) reaches back to its previous checkpoint, or to
round 1 for the first. Along that chain it checks what no single certificate shows:
- each statement's work is its parent's plus its own credit, so a chain cannot claim work it did not certify;
- after the first checkpoint, each round's signers hold at least a third of the seniority of the seniors active lately
  (seen within three checkpoint periods, at least the online window): identities nobody credited cannot extend
  the chain while seniors are around. With every senior gone that long, any certified extension is taken: the
  run goes on without them rather than stopping;
- before the first checkpoint, where the operator named *founders* (`CheckpointConfig.founders`: peers it trusts,
  such as its own machines), each round's valid signers include at least a third of the founders active lately,
  and at least one: identities that report a fabricated chain from round 1 before the honest swarm's first
  checkpoint cannot have it vouched for. With no founder active, no first checkpoint is signed (peers keep the
  count-based rules meanwhile). Founders start past probation: their first credited round makes them senior.
  Without founders the first checkpoint takes the heaviest chain whose work adds up.
Seniority is carried forward: the previous checkpoint's (tokens, rounds) per peer plus the credit of every round
after it on the chain. The newest checkpoint is kept in the store, so a restarted coordinator goes on from it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from swarmloco.protocol.trust.admission import Gate
from swarmloco.protocol.trust.certificates import Certificate
from swarmloco.protocol.trust.checkpoints import (
    MAX_SENIORS,
    PROBATION_ROUNDS,
    Checkpoint,
    CheckpointError,
    supports_by_seniority,
)
from swarmloco.protocol.trust.identity import Identity

logger = logging.getLogger(__name__)
MAX_ROUNDS_READ = 20_000  # certified rounds read per checkpoint (those after the previous checkpoint)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_s: float = 120.0  # how often the authority signs a checkpoint (0: never)
    founders: frozenset[str] = frozenset()  # peer ids whose signatures the first checkpoint's chain needs

    def __post_init__(self) -> None:
        if not (self.every_s == 0 or 5 <= self.every_s <= 86_400):
            raise ValueError(f"checkpoint every_s: got {self.every_s}, allowed 0 (off) or 5 .. 86400")
        if len(self.founders) > MAX_SENIORS:
            raise ValueError(f"at most {MAX_SENIORS} founders, got {len(self.founders)}")


class Checkpointer:
    """Builds and keeps the run's newest checkpoint; `store` provides `certified_after(run_id, round, limit)`,
    `online_peers(run_id, since)`, `latest_checkpoint(run_id)` and `save_checkpoint(run_id, value)`."""

    def __init__(self, store, identity: Identity, run_id: str, *, active_window_s: float,  # type: ignore[no-untyped-def]
                 gate: Callable[[], Gate], founders: frozenset[str] = frozenset(),
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.identity, self.run_id, self.clock = store, identity, run_id, clock
        self.founders = founders
        self._gate = gate  # how signers are checked now (tickets, revocations)
        self._lock = threading.Lock()  # the publisher thread and HTTP requests may both refresh
        self.active_window_s = active_window_s
        self.latest: Checkpoint | None = None
        saved = store.latest_checkpoint(run_id)
        if saved is not None:
            try:
                self.latest = Checkpoint.parse(saved, run_id=run_id, authority=identity.peer_id)
            except CheckpointError as exc:
                logger.warning("ignoring the stored checkpoint: %s", exc)

    @property
    def gate(self) -> Gate:
        return self._gate()

    def refresh(self) -> Checkpoint | None:
        """Sign a checkpoint for the heaviest chain that extends the previous one, if there is a newer state;
        returns the newest checkpoint (re-signed with a fresh time when the chain has not moved)."""
        with self._lock:
            return self._refresh()

    def _refresh(self) -> Checkpoint | None:
        prev = self.latest
        found = self._extend(prev)
        if found is None and prev is None:
            return None
        if found is None:
            assert prev is not None
            head, seniors = (prev.round, prev.state_hash, prev.work), {p: (t, r) for p, t, r in prev.seniors}
        else:
            head, seniors = found
        cp = Checkpoint.issue(self.identity, run_id=self.run_id, round=head[0], state_hash=head[1], work=head[2],
                              seniors=seniors, now=self.clock())
        if prev is None or (cp.round, cp.state_hash) != (prev.round, prev.state_hash):
            logger.info("checkpoint: round %d %s… (work %d, %d seniors)", cp.round, cp.state_hash[:12], cp.work,
                        len(cp.seniors))
        self.store.save_checkpoint(self.run_id, cp.to_value())
        self.latest = cp
        return cp

    def _extend(self, prev: Checkpoint | None) -> tuple[tuple[int, str, int], dict[str, tuple[int, int]]] | None:
        """The heaviest certified state whose chain reaches `prev` (or round 1), and the seniority along it. One
        pass in round order: a certificate is on a valid chain when its parent is (or it starts at `prev`), its work
        is its parent's plus its own credit, and its signers are senior enough. Per state, the heaviest valid
        certificate is kept, so the pass is linear in the rounds read however many certificates a state has."""
        after = prev.round if prev is not None else 0
        certs = []
        for text in self.store.certified_after(self.run_id, after, MAX_ROUNDS_READ):
            try:
                certs.append(Certificate.from_bytes(text.encode()))
            except ValueError:
                continue
        certs.sort(key=lambda c: c.statement.round)
        online = set(self.store.online_peers(self.run_id, self.clock() - self.active_window_s))
        # (round, state) -> (the heaviest valid certificate of it, its parent's)
        valid: dict[tuple[int, str], tuple[Certificate, Certificate | None]] = {}
        for cert in certs:
            s = cert.statement
            if prev is not None and s.round == prev.round + 1 and s.prev_hash == prev.state_hash:
                parent, base = None, prev.work
            elif prev is None and s.round == 1:
                parent, base = None, 0
            elif (s.round - 1, s.prev_hash) in valid:
                parent = valid[(s.round - 1, s.prev_hash)][0]
                base = parent.statement.work
            else:
                continue
            if s.work != base + sum(s.credited) or not self._senior_enough(cert, prev, online):
                continue
            key = (s.round, s.new_hash)
            if key not in valid or s.work > valid[key][0].statement.work:
                valid[key] = (cert, parent)
        if not valid:
            return None
        head = max((c for c, _ in valid.values()), key=lambda c: (c.statement.work, c.statement.round))
        chain, cursor = [], head
        while cursor is not None:
            chain.append(cursor)
            cursor = valid[(cursor.statement.round, cursor.statement.new_hash)][1]
        seniors = ({p: (t, r) for p, t, r in prev.seniors} if prev is not None
                   else dict.fromkeys(self.founders, (0, PROBATION_ROUNDS)))
        for c in reversed(chain):
            for member, credit in zip(c.statement.members, c.statement.credited, strict=True):
                tokens, rounds = seniors.get(member, (0, 0))
                seniors[member] = (tokens + credit, rounds + (credit > 0))
        s = head.statement
        return (s.round, s.new_hash, s.work), seniors

    def _senior_enough(self, cert: Certificate, prev: Checkpoint | None, online: Iterable[str]) -> bool:
        # only signatures that count: a junk signature under a senior's id weighs nothing
        signers = cert.valid_signers(self.gate)
        if prev is None:
            if not self.founders:
                return True
            present = self.founders & set(online)
            signed = self.founders & signers
            return bool(signed) and 3 * len(signed) >= len(present)
        return supports_by_seniority(prev, signers, online) is not False
