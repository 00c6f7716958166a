"""One averaging round, from the caller's side: the only entry point the peer (and the benchmarks) use.

    averager = Averager(transport, RoundConfig(...), model, credentials=..., gate=..., genesis_hash=...)
    averager.start()
    found = averager.find_group(r, state_hash)                   # a future: keep training while it resolves
    outcome = found.result()                                     # a Group, or Behind (fetch that state instead)
    result = averager.run_round(group, Contribution(delta=Δ, tokens=n, staleness=s), apply=outer_step,
                                rollback=undo_outer_step)

`run_round` hides who leads. Every member sends its leader a claim (tokens, staleness, bandwidth, how to reach
it); the leader bounds the weights and sends back the plan: the contributors, their weights, and which of them
reduces which shard of the vector (`swarmloco.protocol.round.plans`). The members then run a sharded reduce among
themselves (`swarmloco.protocol.round.shard_reduce`): each sends shard j of its Δ to member j and receives every reduced
shard back, so no link carries more than about twice the vector. Each member applies the average tentatively (`apply`,
the caller's outer step, returns the new state hash) and signs the round's statement (run, r+1, previous and new hash,
contributors and weights, swarm size, cumulative work) with its own hash in it. With signatures of a majority of the
active swarm on the leader's hash, the leader has a commit certificate (`swarmloco.protocol.trust.certificates`) and
sends it to every member; only then does θ_{r+1} exist. Without one — a lost shard, too few votes, a dead leader —
everyone who applied rolls back to θ_r (`rollback`), keeping its local progress for the next round. A member that
misses a certificate that did form sees the certified state in others' records and re-syncs to it.
"""
from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from swarmloco.protocol.base.codecs import get_codec
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.pauses import collector_paused
from swarmloco.protocol.base.text import bounded
from swarmloco.protocol.chain.chain import Chain
from swarmloco.protocol.chain.forks import Behind
from swarmloco.protocol.network.data_plane import DataPlane
from swarmloco.protocol.network.transport import Transport
from swarmloco.protocol.round.config import Deadlines, LocalModel, RoundConfig
from swarmloco.protocol.round.credit import round_credit
from swarmloco.protocol.round.groups import Group, RoundAborted
from swarmloco.protocol.round.matchmaking import Matchmaker
from swarmloco.protocol.round.pipes import ShardRouter
from swarmloco.protocol.round.steps import RoundSteps
from swarmloco.protocol.trust.admission import Credentials, Gate
from swarmloco.protocol.trust.certificates import Certificate, Head, Statement

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Contribution:
    delta: torch.Tensor  # flat fp32 pseudo-gradient Δ = θ_r − θ_local
    tokens: int  # tokens trained since θ_r: the merge weight the peer claims
    staleness: int = 0  # rounds between the Δ's base state and θ_r


@dataclass(frozen=True, kw_only=True)
class RoundResult:
    """How one round ended for this peer, and what it saw of it."""

    outcome: Outcome
    round: int  # the round that was closed (θ_r → θ_{r+1})
    leader: str
    role: str  # "leader" or "member"
    members: list[str] = field(default_factory=list)  # contributors whose Δ is in the average
    weights: list[int] = field(default_factory=list)  # their bounded token weights, same order
    excluded: dict[str, str] = field(default_factory=dict)  # peer -> why its contribution was dropped
    state_hash: str = ""  # our θ_{r+1} hash (empty when nothing was applied)
    leader_hash: str = ""  # the leader's θ_{r+1} hash
    reason: str = ""  # why the round was discarded
    blame: str = ""  # the peer whose failure discarded it, when one is to blame
    bytes_sent: int = 0
    bytes_received: int = 0
    direct: int = 0  # of this peer's shard connections, those on the TCP data plane
    pipes: int = 0  # this peer's shard connections (the other contributors)
    seconds: float = 0.0
    certify_s: float = 0.0  # of `seconds`: signing the statement, gathering votes, sending the certificate
    certificate: Certificate | None = None  # committed (or, on a mismatch, the state to re-sync to)
    cheaters: dict[str, str] = field(default_factory=dict)  # peers proven to have cheated (now banned), evidence
    audit_s: float = 0.0  # of `seconds`: the audit of every reduced shard
    passes: int = 1  # 2: a reduced shard was lost, and the round was reduced again without its reducer
    failed: dict[str, str] = field(default_factory=dict)  # reducers whose shard we lacked (first-hand), and why


class Averager:
    """Owns the round protocol of one peer: the join handler, the data plane and shard routing, matchmaking, the
    exchange and the certified chain it is on."""

    def __init__(self, transport: Transport, cfg: RoundConfig, model: LocalModel, *, credentials: Credentials,
                 gate: Gate, genesis_hash: str, hooks: Hooks | None = None,
                 probe: Callable[[bytes], torch.Tensor] | None = None) -> None:
        self.transport, self.cfg, self.model = transport, cfg, model
        self.clock = transport.clock  # every deadline and view end is read from it
        self.probe = probe  # the credit probe: g at θ_r on a batch drawn by the seed (None: credit unscored)
        self.credentials, self.gate = credentials, gate
        self.hooks = hooks or Hooks()
        self.codec = get_codec(cfg.codec)
        self.deadlines = Deadlines.of(cfg)
        self.chain = Chain(transport, gate=gate, credentials=credentials, fingerprint=model.fingerprint,
                           quorum=cfg.quorum, genesis_hash=genesis_hash, control_timeout=cfg.control_timeout_s)
        self.data_plane: DataPlane | None = None
        self.matchmaker: Matchmaker | None = None
        self.steps: RoundSteps | None = None

    def start(self, *, timeout: float = 30.0) -> None:
        self.transport.call(self._start(), timeout=timeout)

    async def _start(self) -> None:
        hosts = self.transport.data_plane_hosts()
        if hosts is not None:
            self.data_plane = DataPlane(bind_host=hosts[0], advertise_hosts=hosts[1])
            await self.data_plane.start()
        router = ShardRouter(self.transport, self.data_plane, max_group=self.cfg.max_group,
                             control_timeout=self.cfg.control_timeout_s, identity=self.credentials.identity)
        await router.register()
        self.steps = RoundSteps(self.transport, self.cfg, self.model, chain=self.chain, credentials=self.credentials,
                                codec=self.codec, router=router, hooks=self.hooks, use_tcp=hosts is not None,
                                probe=self.probe)
        self.matchmaker = Matchmaker(self.transport, self.cfg, self.model, chain=self.chain, gate=self.gate,
                                     credentials=self.credentials, hooks=self.hooks)
        await self.matchmaker.register()

    def close(self, *, timeout: float = 10.0) -> None:
        self.transport.loop.call_soon_threadsafe(self.chain.close)
        if self.data_plane is not None:
            self.transport.call(self.data_plane.close(), timeout=timeout)

    @property
    def head(self) -> Head:
        return self.chain.head

    def set_state(self, head: Head) -> None:
        """The certified state this peer now holds (thread-safe; in effect when it returns)."""
        assert self.matchmaker is not None, "call start() first"

        async def apply() -> None:
            assert self.matchmaker is not None
            self.chain.set_head(head)
            self.matchmaker.set_state(head.round, head.state_hash, head.seed, proven=head.signers)
            if self.steps is not None:  # every certified state we held: what a stale Δ may be based on
                self.steps.remember(head)

        self.transport.call(apply(), timeout=self.cfg.control_timeout_s)

    def find_group(self, round_number: int, state_hash: str) -> concurrent.futures.Future[Group | Behind]:
        """Start matchmaking for round r; the future resolves to a closed Group or a Behind, or raises RoundAborted
        after round_timeout_s. Cancelling it gives the round up."""
        assert self.matchmaker is not None, "call start() first"
        return self.transport.submit(self.matchmaker.form_group(round_number, state_hash))

    def run_round(self, group: Group, contribution: Contribution, *, apply: Callable[[torch.Tensor], str],
                  rollback: Callable[[], None] = lambda: None) -> RoundResult:
        """Exchange, apply and certify one round; called from the training thread, which `apply` and `rollback`
        run on. `apply` makes the outer step and returns the new state hash; `rollback` undoes it, and is called
        whenever the round ends without a certificate after `apply` ran. No automatic garbage collection runs
        meanwhile (`swarmloco.protocol.base.pauses`): a full pass here would stall every member of the group."""
        with collector_paused():
            return self._run_round(group, contribution, apply=apply, rollback=rollback)

    def _run_round(self, group: Group, contribution: Contribution, *, apply: Callable[[torch.Tensor], str],
                   rollback: Callable[[], None]) -> RoundResult:
        assert self.steps is not None, "call start() first"
        steps, d = self.steps, self.deadlines
        started = self.clock.monotonic()
        prev = self.chain.head
        role = "leader" if group.is_leader else "member"
        applied = False
        result: RoundResult | None = None
        try:
            if group.round != prev.round:
                raise RoundAborted(f"round {group.round} formed, but we hold round {prev.round}")
            delta, tokens = contribution.delta, contribution.tokens
            delta, tokens = self.hooks.contribution(group.round, delta, tokens, leader=group.is_leader)
            plan, reduced = self.transport.call(
                steps.exchange(group, delta, tokens, contribution.staleness, prev), timeout=d.exchange)
            if group.is_leader:
                self.hooks.before_commit(group.round)
            applied = True
            weight = dict(zip(plan.members, plan.weights, strict=True))
            weights = tuple(weight[p] for p in reduced.members)
            credit = round_credit(plan, reduced.members, weights, reduced.scores, self.cfg)
            statement = Statement(run_id=self.transport.run_id, round=plan.round + 1, prev_hash=plan.prev_hash,
                                  new_hash=apply(reduced.average), members=reduced.members, weights=weights,
                                  swarm=plan.swarm, work=prev.work + sum(weights if credit is None else credit),
                                  credit=credit)
            certify_started = self.clock.monotonic()
            certificate, reason = self.transport.call(steps.certify(group, plan, statement),
                                                      timeout=d.transfer + 4 * d.control)
            outcome = Outcome.DISCARDED if certificate is None else (
                Outcome.COMMITTED if certificate.statement == statement else Outcome.MISMATCH)
            result = RoundResult(
                outcome=outcome, round=group.round, leader=group.leader, role=role, members=list(reduced.members),
                weights=list(weights), excluded=plan.excluded, state_hash=statement.new_hash,
                leader_hash=certificate.statement.new_hash if certificate is not None else "", reason=reason,
                bytes_sent=reduced.sent, bytes_received=reduced.received, direct=reduced.direct, pipes=reduced.pipes,
                certify_s=self.clock.monotonic() - certify_started, certificate=certificate, audit_s=reduced.audit_s,
                cheaters=dict(reduced.cheaters), passes=reduced.passes, failed=dict(reduced.failed))
        except Exception as exc:  # whatever ends the round early, nothing uncertified is kept
            if not isinstance(exc, (RoundAborted, concurrent.futures.TimeoutError, TimeoutError)):
                logger.exception("round %d failed unexpectedly; discarding it", group.round)
            reason = str(exc) or f"{type(exc).__name__} after {self.clock.monotonic() - started:.1f}s"
            self.transport.submit(steps.abort(group, reason))
            result = RoundResult(outcome=Outcome.DISCARDED, round=group.round, leader=group.leader, role=role,
                                 members=list(group.members), reason=reason,
                                 blame=exc.blame if isinstance(exc, RoundAborted) else "",
                                 cheaters=exc.cheaters if isinstance(exc, RoundAborted) else {})
        finally:
            if applied and (result is None or result.outcome != Outcome.COMMITTED):
                rollback()
            if result is not None:
                self._judge(group, result)
        if result.outcome == Outcome.COMMITTED and result.certificate is not None:
            self.set_state(Head.of(result.certificate))
        return replace(result, seconds=self.clock.monotonic() - started)

    def _judge(self, group: Group, result: RoundResult) -> None:
        """Ban whoever was proven to cheat, and leave out of our next plans a peer that cost us this round: one
        that stalled, vanished or withheld its reduced shard from *us* (first-hand, never on anyone's word). Every
        member that lost the round to it does the same, so it costs the swarm one attempt, not one per leader:
        leaders change every view."""
        steps, matchmaker = self.steps, self.matchmaker
        if steps is None or matchmaker is None:
            return
        async def ban(peer: str, why: str) -> None:  # on the loop, where the matchmaker reads it
            matchmaker.banned[peer] = bounded(why)

        for peer, why in result.cheaters.items():
            if peer != self.transport.peer_id:
                steps.ban(peer, why)
                self.transport.call(ban(peer, why), timeout=self.cfg.control_timeout_s)
        # A member does not hold the round's failure against its leader: a leader gives up when anyone fails it,
        # so from a member's side an honest leader's abort looks like the leader's fault. (A leader that fails
        # its view is replaced by the schedule anyway.)
        blame = result.blame if group.is_leader or result.blame != group.leader else ""
        if blame and blame != group.me and blame not in result.cheaters:
            steps.suspend(blame, group.round, result.reason)
        # A reducer whose shard we lacked cost the round a second pass even when it committed without it.
        for peer, why in result.failed.items():
            if peer not in (group.me, blame) and peer not in result.cheaters:
                steps.suspend(peer, group.round, why)
