"""How much of the swarm a group is, and who may lead it: counted in heads, or weighed by seniority once the run's
authority has vouched for some of the peers present.

In an open run identities cost nothing, so a rule that counts them is a rule strangers set. Admitted identities that
publish records at the honest state and never take part would otherwise raise the majority a group needs out of
the honest peers' reach (seven of them make a three-peer swarm need six members), and lead views they let expire.
Where the newest authority checkpoint (`swarmloco.protocol.trust.checkpoints`) names some active peer as senior:
- a group must hold more than half the seniority of the active peers (itself included), and at least `quorum`
  members: two disjoint groups weighed by one checkpoint cannot both close;
- the swarm a group declares, and whose majority its certificate's signatures must be
  (`swarmloco.protocol.trust.certificates.need`), is the group plus the senior peers outside it: peers on
  probation count only when they take part;
- only senior peers lead views, and only their records, weighed by seniority, can move a peer to a later view.
Without a checkpoint, or where nobody active is senior yet, every active peer counts as one, as before. Peers
holding different checkpoints may weigh one group differently for a few seconds; the group then does not close
or a member sits it out, and the next view goes on. Who adopts a certified state is weighed the same way, in
`swarmloco.protocol.chain.chain.Chain`.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from swarmloco.protocol.trust.certificates import need
from swarmloco.protocol.trust.checkpoints import Checkpoint


@dataclass(frozen=True)
class Weights:
    """One peer's weighing of the active swarm at one look: the checkpoint it holds and the round's quorum."""

    checkpoint: Checkpoint | None
    quorum: int

    def seniority(self, peer: str) -> int:
        return 0 if self.checkpoint is None else self.checkpoint.seniority(peer)

    def weighed(self, peers: Iterable[str]) -> bool:
        """Whether the seniority rule applies among `peers`: some of them are senior."""
        return any(self.seniority(p) > 0 for p in peers)

    def swarm(self, group: Collection[str], active: Collection[str]) -> int:
        """The swarm size a group declares at close: every active peer, or (weighed) the group and the senior
        peers outside it."""
        everyone = set(active) | set(group)
        if not self.weighed(everyone):
            return len(everyone)
        return len(set(group) | {p for p in active if self.seniority(p) > 0})

    def enough(self, group: Collection[str], active: Collection[str], *, declared: int = 0) -> bool:
        """Whether `group` (the leader and its members) may close among `active`: a majority of the larger of the
        swarm it declared and the one we see, and, weighed, more than half the active seniority."""
        members, everyone = set(group), set(active) | set(group)
        if len(members) < need(max(declared, self.swarm(members, active)), self.quorum):
            return False
        if not self.weighed(everyone):
            return True
        return 2 * sum(map(self.seniority, members)) > sum(map(self.seniority, everyone))

    def short_of(self, active: Collection[str]) -> str:
        """What a group among `active` still needs, in words (for the message when none formed)."""
        if self.weighed(active):
            total = sum(map(self.seniority, set(active)))
            return f"group holding more than half of the {total} seniority of {len(active)} active peers"
        swarm = len(set(active))
        return f"group of {need(swarm, self.quorum)} (a majority of {swarm} active peers)"

    def say(self, peer: str) -> int:
        """A peer's weight when half of the ready peers or more move others to a later view: its seniority, or one
        where it has none (among peers `eligible` keeps, either all are senior or none is)."""
        return max(1, self.seniority(peer))

    def eligible(self, peers: Collection[str]) -> Collection[str]:
        """Who among `peers` may lead a view (or move others to a later one): the senior ones, or all of them when
        none is."""
        seniors = [p for p in peers if self.seniority(p) > 0]
        return seniors or peers
