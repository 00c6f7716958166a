"""The two points of a pass where the leader settles what every member goes on with.

    settle   after the parts: each reducer reports whose part of its shard arrived whole; the leader keeps the
             contributors every reducer holds a part of, and tells everyone.
    confirm  after the reduced shards: each member reports which reduced shards it lacks; the leader either lets
             the round go on to its audit, or re-plans it without the reducers that failed it (backup reducers,
             `swarmloco.protocol.round.recovery`), or ends it.

Both are one report from every member to the leader and one answer back, on the group's control links.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.text import bounded, short_id
from swarmloco.protocol.base.wire import WireError
from swarmloco.protocol.round.config import Deadlines
from swarmloco.protocol.round.exchange import Link, broadcast
from swarmloco.protocol.round.groups import Group, RoundAborted
from swarmloco.protocol.round.plans import Plan
from swarmloco.protocol.round.recovery import Recovery, left_out, replan
from swarmloco.protocol.trust.certificates import need
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.payloads import plan_body, plan_digest, signed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settlement:
    """One round's settling, from one member's side (the leader's when `group.is_leader`)."""

    group: Group
    deadlines: Deadlines
    quorum: int
    run_id: str
    identity: Identity

    # --- settle: whose contributions count ------------------------------------------------------------------------
    async def settle(self, plan: Plan, have: list[str], problems: dict[str, str]) -> tuple[str, ...]:
        group, d = self.group, self.deadlines
        if group.is_leader:
            return await self._settle_as_leader(plan, have, problems)
        for peer, why in problems.items():
            logger.info("round %d: part from %s refused: %s", group.round, short_id(peer), bounded(why, 200))
        refused = [p for p in plan.members if p in problems]
        report = pb.ShardReport(round=plan.round, shard=plan.members.index(group.me), have=have, refused=refused,
                                refused_reasons=[bounded(problems[p], 200) for p in refused])
        # the leader waits for the slowest reducer's report: up to one transfer after ours
        msg = await self._ask(report, d.transfer + 2 * d.control, "settling the contributors")
        members = tuple(msg.members)
        if msg.round != plan.round or msg.recover or not members or list(members) != sorted(set(members)) or \
                not set(members) <= set(have):
            raise RoundAborted("leader settled on contributors that are not ours to reduce", blame=group.leader)
        plan.excluded.update(zip(msg.excluded, msg.excluded_reasons, strict=False))
        return members

    async def _settle_as_leader(self, plan: Plan, have: list[str], problems: dict[str, str]) -> tuple[str, ...]:
        group, d = self.group, self.deadlines
        reports = await self._reports(plan, results=False)
        holders = {group.me: set(have)}
        why: dict[str, list[str]] = {p: [f"{short_id(group.me)}: {bounded(problems[p], 200)}"] for p in problems}
        for reducer, r in reports.items():
            if r is None:
                continue
            holders[reducer] = set(r.have)
            for p, reason in zip(r.refused, r.refused_reasons, strict=False):
                if p in plan.members:
                    why.setdefault(p, []).append(f"{short_id(reducer)}: {bounded(reason, 200)}")
        missing = [p for p in plan.members if p not in holders]
        kept = set(plan.members).intersection(*holders.values())
        excluded = {p: "; ".join(why.get(p, [])[:3]) or "its part of some shard did not arrive"
                    for p in plan.members if p not in kept}
        reason = ""
        if missing:
            reason = f"no report from reducer(s) {', '.join(short_id(p) for p in missing)}: their shards are lost"
        elif len(kept) < need(group.swarm, self.quorum):
            reason = (f"only {len(kept)} contributions arrived whole at every reducer; a certificate needs "
                      f"{need(group.swarm, self.quorum)}: {excluded}")
        members = tuple(sorted(kept))
        message = pb.Contributors(ok=not reason, reason=reason, round=plan.round, members=members,
                                  excluded=list(excluded), excluded_reasons=list(excluded.values()))
        await broadcast(group.links, message, timeout=d.control)
        if reason:
            raise RoundAborted(reason)
        plan.excluded.update(excluded)
        return members

    # --- confirm: every reduced shard everywhere, or a re-plan ----------------------------------------------------
    async def confirm(self, plan: Plan, members: tuple[str, ...], lost: Mapping[str, str], *,
                      last: bool) -> Recovery:
        """After the reduced shards of a pass: go on (`Recovery.plan` None), or reduce again under the returned
        plan. Raises RoundAborted when the round ends here. `lost`: the reducers whose shard we lack, and why."""
        group, d = self.group, self.deadlines
        if group.is_leader:
            return await self._confirm_as_leader(plan, members, lost, last=last)
        refused = [p for p in plan.members if p in lost]
        report = pb.ShardReport(round=plan.round, shard=plan.members.index(group.me), refused=refused,
                                refused_reasons=[bounded(lost[p], 200) for p in refused], results=True)
        msg = await self._ask(report, d.transfer + 2 * d.control, "confirming the reduced shards")
        survivors = tuple(msg.members)
        if msg.round != plan.round or list(survivors) != sorted(set(survivors)) or \
                not set(survivors) <= set(members):
            raise RoundAborted("leader confirmed contributors that are not ours", blame=group.leader)
        if not msg.recover:
            if survivors != members or lost:
                raise RoundAborted("leader let the round go on without a reduced shard we lack",
                                   blame=group.leader)
            return Recovery(members)
        plan.excluded.update(zip(msg.excluded, msg.excluded_reasons, strict=False))
        if group.me not in survivors:
            raise RoundAborted(f"the round goes on without us: {bounded(plan.excluded.get(group.me, ''), 200)}")
        again = replan(plan, survivors)
        if last or not signed(group.leader, plan_body(self.run_id, plan.round, plan_digest(again.to_pb())),
                              bytes(msg.plan_signature)):
            raise RoundAborted("leader's re-plan is not one we can take part in", blame=group.leader)
        logger.info("round %d: reducing again among %d without %s", plan.round, len(survivors),
                    ", ".join(short_id(p) for p in members if p not in survivors) or "lost shards")
        return Recovery(survivors, replace(again, signature=bytes(msg.plan_signature)))

    async def _confirm_as_leader(self, plan: Plan, members: tuple[str, ...], lost: Mapping[str, str], *,
                                 last: bool) -> Recovery:
        group, d = self.group, self.deadlines
        reports = await self._reports(plan, results=True)
        out = left_out(leader=group.me, reducers=plan.members, lost_at_leader=lost, reports=reports)
        if not out:
            await broadcast(group.links, pb.Contributors(ok=True, round=plan.round, members=members),
                            timeout=d.control)
            group.stage = "settled"  # from here, an abort is told with a Commit, the message members wait for
            return Recovery(members)
        survivors = tuple(p for p in members if p not in out)
        reason = ""
        if last:
            reason = f"a reduced shard was lost again: {bounded('; '.join(out.values()), 300)}"
        elif len(survivors) < need(group.swarm, self.quorum):
            reason = (f"only {len(survivors)} contributors would be left once the reducers that failed the round are "
                      f"left out; a certificate needs {need(group.swarm, self.quorum)}: {bounded(str(out), 300)}")
        if reason:
            await broadcast(group.links, pb.Contributors(ok=False, reason=reason, round=plan.round),
                            timeout=d.control)
            raise RoundAborted(reason, blame=next(iter(lost), ""))
        again = replan(plan, survivors)
        signature = self.identity.sign(plan_body(self.run_id, plan.round, plan_digest(again.to_pb())))
        await broadcast(group.links, pb.Contributors(
            ok=True, round=plan.round, members=survivors, excluded=list(out), excluded_reasons=list(out.values()),
            recover=True, plan_signature=signature), timeout=d.control)
        plan.excluded.update(out)
        logger.info("round %d: reducing again among %d without %s", plan.round, len(survivors),
                    ", ".join(short_id(p) for p in out))
        return Recovery(survivors, replace(again, signature=signature))

    # --- the leader's side of both: one report from every reducer -------------------------------------------------
    async def _reports(self, plan: Plan, *, results: bool) -> dict[str, pb.ShardReport | None]:
        d = self.deadlines

        async def report_of(link: Link) -> pb.ShardReport | None:
            try:
                report, _ = await link.recv(pb.ShardReport, max_payload=0, timeout=d.transfer + d.control)
            except WireError:
                return None
            return report if report.round == plan.round and report.results == results else None

        reducers = [p for p in self.group.links if p in plan.members]  # an excluded member has nothing to report
        return dict(zip(reducers, await asyncio.gather(*(report_of(self.group.links[p]) for p in reducers)),
                        strict=True))

    async def _ask(self, report: pb.ShardReport, timeout: float, doing: str) -> pb.Contributors:
        link = self.group.links[self.group.leader]
        try:
            await link.send(report, timeout=self.deadlines.control)
            msg, _ = await link.recv(pb.Contributors, max_payload=0, timeout=timeout)
        except WireError as exc:
            raise RoundAborted(f"lost the leader while {doing}: {exc}", blame=self.group.leader) from exc
        if not msg.ok:
            raise RoundAborted(f"leader aborted the round: {bounded(msg.reason)}")
        return msg
