"""The plan of one sharded round, as plain data: who contributes with which weight, and who reduces which shard.

The leader builds the plan from the members' claims (tokens, staleness, bandwidth, how to reach them) and sends it
to every member; each member checks it before moving a byte (a plan is the leader's word, and the leader is a
stranger too). Everything here is pure and unit-tested without a network.

Shards are sized by bandwidth, as DeDLOC does: reducer i receives N − 1 parts of its shard and sends N − 1 copies
of the result, so its link time is proportional to its shard's size over its bandwidth; shard sizes proportional
to bandwidth make every reducer finish together. A claimed bandwidth is only a claim: each share is clamped to
[1/4, 4] × the median share, so no member can take a large part of the vector (and of the round's time) by
boasting, nor be starved of one by a leader's whim.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.text import bounded

SHARD_ALIGN = 128  # shard boundaries fall on whole quantisation blocks, so a shard encodes like a whole vector
BANDWIDTH_CLAMP = 4.0  # a member's share of the vector is within [1/4, 4] × the median share
# A claimed bandwidth (bytes/s) above this is taken as this (80 Tbit/s, beyond any link): claims near float's
# largest value would make the shares' sum overflow to inf and every share 0.
MAX_BANDWIDTH = 1e13
MAX_ADDRS = 8  # per endpoint
MAX_FIELD_CHARS = 128  # an address or a token


@dataclass(frozen=True)
class Endpoint:
    addrs: tuple[str, ...]  # "host:port" of the member's TCP data plane (empty: libp2p only)
    token: str  # the member's secret for this round's shard connections
    dials_out: bool = False  # nobody can dial the member (behind NAT): it opens each of its pipes itself


@dataclass(frozen=True)
class Plan:
    round: int
    members: tuple[str, ...]  # contributors, sorted; member i reduces shard i
    weights: tuple[int, ...]
    bounds: tuple[int, ...]  # shard i is [bounds[i], bounds[i + 1])
    endpoints: tuple[Endpoint, ...]
    codec: str
    numel: int
    prev_hash: str
    swarm: int
    work: int
    excluded: dict[str, str] = field(default_factory=dict)
    claims: tuple[pb.ContributionClaim, ...] = ()  # each contributor's signed claim, same order
    signature: bytes = b""  # the leader's, of the plan's digest

    def shard(self, i: int) -> slice:
        return slice(self.bounds[i], self.bounds[i + 1])

    def dials(self, a: int, b: int) -> bool:
        """Whether member a opens the pipe between members a and b. The earlier one in the plan does, unless only
        the later one cannot be dialled (behind NAT): then that one dials out. Every member derives the same answer
        from the plan. Two members behind NAT: the earlier tries, over libp2p, which may relay."""
        lo, hi = min(a, b), max(a, b)
        dialer = hi if self.endpoints[hi].dials_out and not self.endpoints[lo].dials_out else lo
        return a == dialer

    def to_pb(self) -> pb.Plan:
        return pb.Plan(
            ok=True, round=self.round, members=self.members, weights=self.weights, bounds=self.bounds,
            endpoints=[pb.Endpoint(addrs=e.addrs, token=e.token, dials_out=e.dials_out) for e in self.endpoints],
            excluded=list(self.excluded), excluded_reasons=list(self.excluded.values()), codec=self.codec,
            numel=self.numel, prev_hash=self.prev_hash, swarm=self.swarm, work=self.work, claims=self.claims,
            signature=self.signature,
        )

    @classmethod
    def from_pb(cls, msg: pb.Plan) -> Plan:
        return cls(
            round=int(msg.round), members=tuple(msg.members), weights=tuple(int(w) for w in msg.weights),
            bounds=tuple(int(b) for b in msg.bounds),
            endpoints=tuple(Endpoint(tuple(e.addrs), e.token, bool(e.dials_out)) for e in msg.endpoints),
            codec=msg.codec,
            numel=int(msg.numel), prev_hash=msg.prev_hash, swarm=int(msg.swarm), work=int(msg.work),
            excluded=dict(zip(msg.excluded, msg.excluded_reasons, strict=False)), claims=tuple(msg.claims),
            signature=bytes(msg.signature),
        )


def plan_problem(plan: Plan, *, round_number: int, codec: str, numel: int, me: str, group: Sequence[str],
                 max_group: int) -> str:
    """Why a member must not act on this plan ("" when it may): it must be for our round, codec and vector, name
    each contributor once, in order, all from our group (us included), and cut the whole vector into one shard per
    contributor whose sizes respect the bandwidth clamp's bound."""
    n = len(plan.members)
    if plan.round != round_number or plan.codec != codec or plan.numel != numel:
        return f"plan is for round {plan.round}, {plan.codec}, {plan.numel} elements"
    if not 1 <= n <= max_group:
        return f"plan names {n} contributors, allowed 1 .. {max_group}"
    if list(plan.members) != sorted(set(plan.members)) or not set(plan.members) <= set(group):
        return "plan's contributors are not distinct members of our group in sorted order"
    if me not in plan.members:
        why = bounded(plan.excluded.get(me, ""), 200)
        return "our contribution was excluded" + (f": {why}" if why else "")
    if len(plan.weights) != n or len(plan.endpoints) != n or len(plan.bounds) != n + 1:
        return "plan's weights, endpoints and shard bounds do not match its contributors"
    if any(w < 1 for w in plan.weights):
        return "plan gives a contributor a weight below 1"
    if any(not endpoint_ok(e) for e in plan.endpoints):
        return "plan has a malformed endpoint"
    b = plan.bounds
    if b[0] != 0 or b[-1] != numel or any(b[i] > b[i + 1] for i in range(n)):
        return "plan's shards do not cut the vector into consecutive pieces"
    # The largest share bandwidth_shares can give: one member at BANDWIDTH_CLAMP × the median, the others at
    # 1/BANDWIDTH_CLAMP of it. Allow one block of rounding on top.
    sizes = [b[i + 1] - b[i] for i in range(n)]
    c2 = BANDWIDTH_CLAMP**2
    if n > 1 and max(sizes) > numel * c2 / (c2 + n - 1) + SHARD_ALIGN:
        return f"plan gives one reducer {max(sizes)} of {numel} elements"
    return ""


def endpoint_ok(endpoint: Endpoint) -> bool:
    """A shard endpoint within bounds: a token, at most MAX_ADDRS addresses, no field over MAX_FIELD_CHARS."""
    fields = (*endpoint.addrs, endpoint.token)
    return bool(endpoint.token) and len(endpoint.addrs) <= MAX_ADDRS and all(len(f) <= MAX_FIELD_CHARS for f in fields)


def bandwidth_shares(bandwidths: Sequence[float]) -> list[float]:
    """Each member's share of the vector, from its claimed bandwidth (0 or non-finite: unknown, taken as the
    median; capped at MAX_BANDWIDTH), clamped to [1/4, 4] × the median and normalised to sum 1."""
    capped = [min(b, MAX_BANDWIDTH) if b > 0 and b < float("inf") else 0.0 for b in bandwidths]
    known = sorted(b for b in capped if b > 0)
    if not known:
        return [1.0 / len(bandwidths)] * len(bandwidths)
    median = known[len(known) // 2]
    clamped = [min(max(b if b > 0 else median, median / BANDWIDTH_CLAMP), median * BANDWIDTH_CLAMP) for b in capped]
    total = sum(clamped)
    return [c / total for c in clamped]


def shard_bounds(numel: int, shares: Sequence[float], *, align: int = SHARD_ALIGN) -> tuple[int, ...]:
    """Offsets cutting [0, numel) into len(shares) consecutive shards of about those shares, each boundary on a
    multiple of `align` (the last shard ends at numel; a shard may be empty when the vector is small)."""
    bounds = [0]
    acc = 0.0
    for s in shares[:-1]:
        acc += s
        cut = min(numel, int(round(acc * numel / align)) * align)
        bounds.append(max(bounds[-1], cut))
    bounds.append(numel)
    return tuple(bounds)
