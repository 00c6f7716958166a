"""Backup reducers: what a round does when a reduced shard is lost, as pure functions of the plan and the reports.

Each member reduces one shard, so a member that withholds its reduced shard, sends a garbled one, or dies after
the parts were exchanged leaves a hole in everyone's average. Rather than discard the round, the leader re-plans
it: the contributors whose shard reached it (and who lost nothing that reached it) reduce the whole vector again,
among themselves, with the same weights and claims. Every member derives that plan alike from the old one and the
survivors, so nothing but the survivors' names and the leader's signature travels; the pipes of the first pass are
reused, and the new plan has its own digest, so no part or result of the first pass counts in the second.

Who is left out follows from the leader's first-hand view, never from anyone's word about another peer:
- a reducer whose shard did not reach the leader (missing, late or refused) is out, since nobody can apply it;
- a reducer that says it lost a shard which did reach the leader is out itself: either it lies, or its link to
  that reducer failed; either way it cannot hold the average, and the reducer it names stays in;
- a reducer that sends no word on the reduced shards is out.
A liar can therefore only take itself out of the round. At most one re-plan per round: a shard lost in the second
pass ends the round, as it always did.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.text import bounded, short_id
from swarmloco.protocol.round.plans import Plan, bandwidth_shares, shard_bounds

MAX_PASSES = 2  # the round as planned, and one re-plan without the reducers that failed it


@dataclass(frozen=True)
class Recovery:
    """The leader's word after the reduced shards: keep the results (`plan` None), or reduce again under `plan`."""

    members: tuple[str, ...]  # the contributors from here on
    plan: Plan | None = None


def left_out(*, leader: str, reducers: Sequence[str], lost_at_leader: Mapping[str, str],
             reports: Mapping[str, pb.ShardReport | None]) -> dict[str, str]:
    """The reducers a re-plan leaves out, with why: those whose reduced shard the leader lacks, those who gave no
    report on the reduced shards, and those who report a shard lost that the leader holds. Empty: every member
    holds every shard, and the round goes on to its audit."""
    out = {p: f"its reduced shard did not reach the leader: {bounded(why, 200)}"
           for p, why in lost_at_leader.items() if p in reducers and p != leader}
    for reducer in reducers:
        if reducer == leader or reducer in out:
            continue
        report = reports.get(reducer)
        if report is None:
            out[reducer] = "it sent no word on the reduced shards"
            continue
        held = [p for p in report.refused if p in reducers and p not in lost_at_leader]
        if held:
            out[reducer] = f"it lacks the reduced shard of {short_id(held[0])}, which reached the leader"
    return out


def replan(plan: Plan, survivors: Sequence[str]) -> Plan:
    """The plan of the second pass: the old one restricted to `survivors` (in plan order), shards cut anew by their
    claimed bandwidths, unsigned. Deterministic: every member derives the same one, the leader signs it."""
    keep = [i for i, p in enumerate(plan.members) if p in set(survivors)]
    if not keep:
        raise ValueError("a re-plan needs at least one survivor")
    claims = tuple(plan.claims[i] for i in keep) if plan.claims else ()
    shares = bandwidth_shares([c.bandwidth for c in claims]) if claims else [1.0 / len(keep)] * len(keep)
    dropped = sum(w for i, w in enumerate(plan.weights) if i not in keep)
    return Plan(round=plan.round, members=tuple(plan.members[i] for i in keep),
                weights=tuple(plan.weights[i] for i in keep), bounds=shard_bounds(plan.numel, shares),
                endpoints=tuple(plan.endpoints[i] for i in keep), codec=plan.codec, numel=plan.numel,
                prev_hash=plan.prev_hash, swarm=plan.swarm, work=plan.work - dropped, excluded={}, claims=claims)
