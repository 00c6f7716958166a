"""The network steps of one round, each a coroutine on the transport's loop: plan and exchange, then certify.

`Averager.run_round` drives them from the training thread, which applies the average in between:

    exchange  leader: collect the members' claims, bound their weights, cut the vector into shards, send the plan;
              member: send the claim, receive and check the plan. Then everyone runs the sharded reduce, which
              settles twice a pass with the leader (`swarmloco.protocol.round.settle`): whose parts count, and
              whether every reduced shard arrived or the round is reduced again without a reducer that failed it.
    certify   member: sign the statement with its own new hash and vote; wait for the certificate.
              leader: count the votes for its own hash and, with a majority of the swarm, send the certificate.
    abort     tell the members the round is over without a certificate (leader), or just leave (member).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import replace

import torch

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.codecs import Codec
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.text import bounded, short_hash, short_id
from swarmloco.protocol.base.wire import WireError
from swarmloco.protocol.chain.chain import Chain
from swarmloco.protocol.network.transport import Transport
from swarmloco.protocol.round.config import Deadlines, LocalModel, RoundConfig
from swarmloco.protocol.round.credit import uncredited
from swarmloco.protocol.round.exchange import (
    ClaimContext,
    Link,
    MemberClaim,
    broadcast,
    collect_claims,
    plan_claims_problem,
)
from swarmloco.protocol.round.groups import Group, RoundAborted
from swarmloco.protocol.round.pipes import ShardRouter
from swarmloco.protocol.round.plans import Endpoint, Plan, bandwidth_shares, plan_problem, shard_bounds
from swarmloco.protocol.round.rules import token_weights
from swarmloco.protocol.round.settle import Settlement
from swarmloco.protocol.round.shard_reduce import Reduced, ShardTimeouts, reduce_shards
from swarmloco.protocol.round.shard_results import Signing
from swarmloco.protocol.trust.admission import Credentials
from swarmloco.protocol.trust.certificates import Certificate, Head, Statement, need, refusal_to_sign, signed_by
from swarmloco.protocol.trust.payloads import NONCE_BYTES, claim_body, commitment, plan_body, plan_digest, signed

logger = logging.getLogger(__name__)


SUSPEND_ROUNDS = 3  # a member that cost us a round (it stalled, or vanished mid-exchange) sits out this many
HISTORY = 16  # certified (round, hash) pairs we remember, to check the base state of a stale Δ


class RoundSteps:
    def __init__(self, transport: Transport, cfg: RoundConfig, model: LocalModel, *, chain: Chain,
                 credentials: Credentials, codec: Codec, router: ShardRouter, hooks: Hooks, use_tcp: bool,
                 probe: Callable[[bytes], torch.Tensor] | None = None) -> None:
        self.transport, self.cfg, self.model, self.chain = transport, cfg, model, chain
        self.probe = probe
        self.credentials, self.codec, self.router, self.hooks = credentials, codec, router, hooks
        self.use_tcp = use_tcp
        self.deadlines = Deadlines.of(cfg)
        self.bandwidth = 0.0  # bytes/s our uplink moved in the last exchange: sizes our next shard
        self.banned: dict[str, str] = {}  # peer -> the evidence it cheated: never in a plan of ours again
        self.suspended: dict[str, int] = {}  # peer -> the round until which a plan of ours leaves it out
        self.history: dict[int, str] = {}  # round -> the certified state's hash we held at that round

    def ban(self, peer: str, why: str) -> None:
        if peer not in self.banned:
            logger.warning("banning %s for the rest of the run: %s", short_id(peer), bounded(why))
        self.banned[peer] = bounded(why)

    def suspend(self, peer: str, round_number: int, why: str) -> None:
        logger.info("leaving %s out of our plans until round %d: %s", short_id(peer), round_number + SUSPEND_ROUNDS,
                    bounded(why, 200))
        self.suspended[peer] = round_number + SUSPEND_ROUNDS

    def remember(self, head: Head) -> None:
        self.history[head.round] = head.state_hash
        for old in [r for r in self.history if r < head.round - HISTORY]:
            del self.history[old]

    def _base_known(self, prev: Head) -> Callable[[int, str], bool]:
        return lambda r, h: (r == prev.round and h == prev.state_hash) or (r < prev.round and self.history.get(r) == h)

    # --- exchange -------------------------------------------------------------------------------------------------
    async def exchange(self, group: Group, delta: torch.Tensor, tokens: int, staleness: int,
                       prev: Head) -> tuple[Plan, Reduced]:
        d = self.deadlines
        self.remember(prev)
        inbox = self.router.open(group.round)
        nonce = secrets.token_bytes(NONCE_BYTES)

        def after_parts() -> None:
            if not group.is_leader:
                self.hooks.after_send(group.round)

        try:
            claim = self._claim(group, tokens, staleness, prev, self.router.endpoint(inbox), commitment(nonce),
                                delta.numel())
            if group.is_leader:
                plan = await self._plan(group, claim, prev)
            else:
                plan = await self._receive_plan(group, claim, prev)
            settlement = Settlement(group, d, self.cfg.quorum, self.transport.run_id, self.credentials.identity)
            signing = Signing(run_id=self.transport.run_id, identity=self.credentials.identity, leader=group.leader,
                              plan_id=plan_digest(plan.to_pb()), plan_signature=plan.signature, rule=self.cfg.rule,
                              probes=self.cfg.audit_probes, nonce=nonce,
                              commits=tuple(c.audit_commit for c in plan.claims), hooks=self.hooks,
                              grace_floor=d.control, result_grace_floor=d.result_grace, probe=self.probe)
            reduced = await reduce_shards(plan, delta, me=group.me, codec=self.codec, router=self.router,
                                          inbox=inbox, timeouts=ShardTimeouts(connect=d.control, transfer=d.transfer),
                                          use_tcp=self.use_tcp, after_parts=after_parts, signing=signing,
                                          settle=settlement.settle, confirm=settlement.confirm)
        except BaseException:
            if not group.is_leader:  # a leader releases its members only after telling them (`abort`)
                await self._release(group)
            raise
        finally:
            self.router.close(inbox)
        if reduced.send_s > 0 and reduced.parts_sent > 0:
            self.bandwidth = reduced.parts_sent / reduced.send_s
        return plan, reduced

    def _claim(self, group: Group, tokens: int, staleness: int, prev: Head, endpoint: Endpoint, commit: str,
               numel: int) -> pb.ContributionClaim:
        """Our signed claim. `numel` is our Δ's true size: a leader refuses a wrong one before anything moves."""
        base = max(0, group.round - staleness)
        claim = pb.ContributionClaim(
            tokens=tokens, codec=self.codec.name, numel=numel, data_addrs=endpoint.addrs,
            data_token=endpoint.token, dials_out=endpoint.dials_out, bandwidth=self.bandwidth, round=group.round,
            prev_hash=prev.state_hash,
            leader=group.leader, base_round=base, base_hash=self.history.get(base, prev.state_hash),
            audit_commit=commit)
        claim.signature = self.credentials.identity.sign(claim_body(self.transport.run_id, claim))
        return claim

    def _context(self, group: Group, prev: Head) -> ClaimContext:
        return ClaimContext(run_id=self.transport.run_id, round=group.round, prev_hash=prev.state_hash,
                            leader=group.leader, codec=self.codec.name, numel=self.model.numel,
                            max_staleness=self.cfg.max_staleness, uncredited=uncredited(prev))

    async def _plan(self, group: Group, own: pb.ContributionClaim, prev: Head) -> Plan:
        d, me = self.deadlines, group.me
        claims = await collect_claims(group.links, ctx=self._context(group, prev), timeout=d.control,
                                      base_known=self._base_known(prev))
        claims.admitted[me] = MemberClaim.of(own)
        self.suspended = {p: until for p, until in self.suspended.items() if until > group.round}
        needed = need(group.swarm, self.cfg.quorum)
        for peer in list(claims.admitted):
            if peer in self.banned and peer != me:
                del claims.admitted[peer]
                claims.excluded[peer] = f"left out: {self.banned[peer]}"
        # A suspended member (it stalled or vanished lately) sits out only while the round can do without it: in a
        # small swarm, leaving it out would stop every round, which is worse than risking one.
        for peer in [p for p in claims.admitted if p in self.suspended and p != me]:
            if len(claims.admitted) > needed:
                del claims.admitted[peer]
                claims.excluded[peer] = (f"left out: it stalled or vanished in a recent round (until round "
                                         f"{self.suspended[peer]})")
        weights = token_weights({p: (c.tokens, c.staleness) for p, c in claims.admitted.items()}, cfg=self.cfg,
                                cut=uncredited(prev))
        members = tuple(sorted(weights))
        if len(members) < needed:
            raise RoundAborted(f"only {len(members)} of the group contributed; a certificate needs {needed}: "
                               f"{claims.excluded}")
        bounds = shard_bounds(self.model.numel, bandwidth_shares([claims.admitted[p].bandwidth for p in members]))
        plan = Plan(round=group.round, members=members, weights=tuple(weights[p] for p in members), bounds=bounds,
                    endpoints=tuple(claims.admitted[p].endpoint for p in members), codec=self.codec.name,
                    numel=self.model.numel, prev_hash=prev.state_hash, swarm=group.swarm,
                    work=prev.work + sum(weights.values()), excluded=claims.excluded,
                    claims=tuple(claims.admitted[p].signed for p in members))
        body = plan_body(self.transport.run_id, plan.round, plan_digest(plan.to_pb()))
        plan = replace(plan, signature=self.credentials.identity.sign(body))
        await broadcast(group.links, plan.to_pb(), timeout=d.control)
        group.stage = "planned"
        return plan

    async def _receive_plan(self, group: Group, claim: pb.ContributionClaim, prev: Head) -> Plan:
        d = self.deadlines
        link = group.links[group.leader]
        try:
            await link.send(claim, timeout=d.control)
            msg, _ = await link.recv(pb.Plan, max_payload=0, timeout=2 * d.control)
        except WireError as exc:
            raise RoundAborted(f"lost the leader before the plan: {exc}", blame=group.leader) from exc
        if not msg.ok:
            raise RoundAborted(f"leader aborted the round: {bounded(msg.reason)}")
        plan = Plan.from_pb(msg)
        me = self.transport.peer_id
        if me not in plan.members:  # the leader refused our claim, and says why: its judgement, not a fault
            raise RoundAborted(f"our contribution was excluded: {bounded(plan.excluded.get(me, ''))}")
        problem = plan_problem(plan, round_number=group.round, codec=self.codec.name, numel=self.model.numel, me=me,
                               group=group.members, max_group=self.cfg.max_group)
        if not problem and not signed(group.leader, plan_body(self.transport.run_id, plan.round, plan_digest(msg)),
                                      plan.signature):
            problem = "it is not signed by the leader"
        if not problem:
            problem = plan_claims_problem(plan, ctx=self._context(group, prev), cfg=self.cfg)
        if not problem and plan.claims[plan.members.index(me)].SerializeToString(deterministic=True) != \
                claim.SerializeToString(deterministic=True):
            problem = "it carries another claim of ours than the one we sent"
        if not problem:
            provisional = Statement(run_id=self.transport.run_id, round=plan.round + 1, prev_hash=plan.prev_hash,
                                    new_hash="0" * 64, members=plan.members, weights=plan.weights, swarm=plan.swarm,
                                    work=plan.work)
            problem = provisional.problem() or refusal_to_sign(
                provisional, prev, round_number=group.round, swarm=group.swarm, group_members=group.members, me=me,
                my_tokens=claim.tokens)
        if problem:
            raise RoundAborted(f"leader's plan is not one we can take part in: {problem}", blame=group.leader)
        return plan

    # --- certify --------------------------------------------------------------------------------------------------
    async def certify(self, group: Group, plan: Plan, statement: Statement) -> tuple[Certificate | None, str]:
        """The round's certificate (None, with the reason, when there is none; RoundAborted blaming the leader when
        it vanished or sent a bad one). A certificate of another hash than ours means the swarm moved on without us:
        the caller re-syncs to it."""
        try:
            if group.is_leader:
                return await self._certify_as_leader(group, statement)
            return await self._vote(group, statement)
        finally:
            await self._release(group)

    async def _certify_as_leader(self, group: Group, statement: Statement) -> tuple[Certificate | None, str]:
        d = self.deadlines
        # Members vote once they hold every shard and applied it: the slowest is up to one transfer behind us.
        votes = await asyncio.gather(*(_vote_of(link, d.transfer + d.control) for link in group.links.values()))
        body = statement.body()
        signatures = {group.me: Certificate.sign(self.credentials.identity, statement)}
        refusals = []
        for peer, vote in zip(group.links, votes, strict=True):
            if vote is None:
                continue
            if vote.accept and peer in statement.members and signed_by(peer, body, vote.signature):
                signatures[peer] = vote.signature
            elif vote.accept:
                refusals.append(f"{short_id(peer)}: reached {short_hash(vote.state_hash)}…")
            else:
                refusals.append(f"{short_id(peer)}: {bounded(vote.reason, 200)}")
        tickets = {p: group.tickets.get(p, b"").decode(errors="replace") for p in signatures if p != group.me}
        tickets[group.me] = self.credentials.ticket.decode(errors="replace")
        certificate = Certificate(statement, signatures, {p: t for p, t in tickets.items() if t})
        problem = self.chain.verify(certificate)
        if problem:
            reason = f"no certificate: {problem}" + (f" (refused by {'; '.join(refusals)})" if refusals else "")
            await broadcast(group.links, pb.Commit(ok=False, reason=reason), timeout=d.control)
            return None, reason
        await broadcast(group.links, pb.Commit(ok=True, certificate=certificate.to_bytes()), timeout=d.control)
        return certificate, ""

    async def _vote(self, group: Group, statement: Statement) -> tuple[Certificate | None, str]:
        link = group.links[group.leader]
        d = self.deadlines
        vote = pb.Vote(accept=True, signature=Certificate.sign(self.credentials.identity, statement),
                       state_hash=statement.new_hash)
        try:
            await link.send(vote, timeout=d.control)
            # the leader waits for every member's vote, the slowest up to one transfer after us
            commit, _ = await link.recv(pb.Commit, max_payload=0, timeout=d.transfer + 3 * d.control)
        except WireError as exc:
            raise RoundAborted(f"no certificate from the leader: {exc}", blame=group.leader) from exc
        if not commit.ok:  # too few signatures: the leader tells us honestly, and is not to blame for it
            return None, f"leader has no certificate: {bounded(commit.reason)}"
        try:
            certificate = Certificate.from_bytes(commit.certificate)
        except ValueError as exc:
            raise RoundAborted(f"leader sent a malformed certificate: {exc}", blame=group.leader) from exc
        problem = self.chain.verify(certificate)
        theirs = certificate.statement
        if not problem and theirs != statement and theirs != _with_hash(statement, theirs.new_hash):
            problem = "it certifies another round than the one we took part in"
        if problem:
            raise RoundAborted(f"leader's certificate is invalid: {problem}", blame=group.leader)
        return certificate, ""

    # --- abort ----------------------------------------------------------------------------------------------------
    async def abort(self, group: Group, reason: str) -> None:
        """The round ends here without a certificate; members learn it from their leader (or its silence)."""
        if group.is_leader:
            kind = {"closed": pb.Plan, "planned": pb.Contributors}.get(group.stage, pb.Commit)
            message = kind(ok=False, reason=reason)
            try:
                await broadcast(group.links, message, timeout=self.deadlines.control)
            finally:
                await self._release(group)
        else:
            await self._release(group)

    async def _release(self, group: Group) -> None:
        """The round is over for us: join handlers may end; a member closes its link to the leader."""
        if group.release is not None and not group.release.done():
            group.release.set_result(None)
        if not group.is_leader:
            for link in group.links.values():
                link.close()


async def _vote_of(link: Link, timeout: float) -> pb.Vote | None:
    try:
        vote, _ = await link.recv(pb.Vote, max_payload=0, timeout=timeout)
        return vote
    except WireError:
        return None


def _with_hash(statement: Statement, new_hash: str) -> Statement:
    return replace(statement, new_hash=new_hash)
