"""The view schedule: who leads a round's group, and until when, as a pure function of shared facts and the time.

A round at a state (r, hash) runs in views 0, 1, 2, ... . View v lasts `ViewSchedule.length(v)`: a base that doubles
with every view up to a cap, so that under any (unknown) bound on delays some view is long enough for an honest
leader to gather its group. The views are counted from the state's anchor: the time at which the peers at that state
that said they were ready (their records' `eta` once `ready`) were first enough to close a group, so every peer
that reads the same records numbers the views alike, whoever read them first. Not the earliest single readiness: a
lone record backdating its own would move every peer's views on at once, to the long ones, where a staller that
draws a view holds its members longest; moving the anchor takes enough ready peers to close a group (by seniority,
where the authority has vouched for some).

The leader of view v is, among the peers at the state that were ready by the view's cutoff (their records say
`ready`, and their `eta` is when they became ready), the one whose hash of (seed, v, peer id) is lowest; where the
run's authority has vouched for some of those peers, only they are drawn from (`swarmloco.protocol.round.weights`):
admitted identities that never did verified work cannot lead views and let them expire; and among those, only the
peers that signed the state's certificate, where any of them is a candidate (`Matchmaker._eligible`): a peer that
took no part in the round that made the state leads none of its views. The cutoff
is a short window (`ViewSchedule.window_s`) after the view began, or, if the ready peers were not yet enough to
close a group then, after the moment they first were (taking them in the order they became ready). Until then no
leader could close anyway, and drawing one early would hand the view to whoever says "ready" first: a peer that
claims readiness the moment a state appears, without training, would be the only candidate of every view that
begins while the others train, and could hold them in a group it never closes, round after round. A peer still
training, or busy in an exchange, never leads: only a peer waiting for a group can gather one. Past the cutoff the
candidates are fixed, so a peer that becomes ready later joins the view's leader instead of displacing it and
dissolving the group it is gathering.

The seed comes from the state's certificate, so no peer can choose its place, and each view draws a new order: a
leader that stalls, crashes or lies costs its view, for every peer at once, and the next view has another leader.
Nothing here is one peer's impression of another: no skip lists, no counts of who seems to be leading. The only
per-peer facts are evidence (a peer proven to cheat is banned) and the peer's own history (a group it took part in
that did not commit makes it move on to the next view).

A view ends for everyone at its scheduled time, or earlier for a peer that sees at least half of the ready peers at
its state (weighed as they are for leading: by seniority where some are senior) already in a later view, once half
of its own view has passed: those left in its view could no longer be a majority, and a peer whose anchor was late
catches up with the others. One record is not enough where three or more peers are ready: a peer advertising later
views, however many identities it holds short of half, does not shorten anybody's views (were it enough, every
view would end at its half, and the swarm would reach the long views in half the time, where a staller that leads
one of them holds its members longest).

`decide` is the whole decision, with the clock passed in, so it is unit-tested without a network or a real clock.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from enum import Enum

from swarmloco.protocol.base.records import MAX_VIEW, PeerRecord
from swarmloco.protocol.round.config import RoundConfig

POLL_S = 0.25  # a leader re-reads the records this often while it waits for members (a join wakes it at once)
DOUBLINGS = 3  # view lengths double this many times: base, 2×, 4×, then 8× for every later view
MAX_TRACKED = 1024  # peers whose readiness time one peer remembers per state
# A peer's word that it became ready is believed at most this far in our future (clock skew). Readiness further
# ahead is no readiness yet: needed for a group, it would put the anchor, and with it every view's end, that far
# ahead, and a member would wait for a view that never ends.
READY_AHEAD_S = 30.0


@dataclass(frozen=True)
class ViewSchedule:
    """View lengths: `base_s` · 2^v, capped at `base_s` · 2^DOUBLINGS."""

    base_s: float

    @classmethod
    def of(cls, cfg: RoundConfig) -> ViewSchedule:
        """`view_s`, or the base that fits one honest view with every wait at its deadline (a join and its reply,
        the grace window, the close), but no more than a third of the round timeout: a peer's attempt at a round
        then spans at least views 0 and 1, so it is still there when its turn to lead comes."""
        fits = cfg.grace_max_s + 2 * cfg.control_timeout_s + 2 * POLL_S
        return cls(base_s=cfg.view_s or min(fits, cfg.round_timeout_s / 3))

    @property
    def window_s(self) -> float:
        """How long after a view's start (or its first readiness) a newly ready peer still becomes a candidate:
        peers ready at about the same time all get a fair draw, and later ones never displace the leader."""
        return self.base_s / 4

    @property
    def cap_s(self) -> float:
        return self.base_s * 2**DOUBLINGS

    def length(self, view: int) -> float:
        return self.base_s * 2 ** min(view, DOUBLINGS)

    def start(self, view: int) -> float:
        """Seconds from the anchor to the start of `view`."""
        if view <= DOUBLINGS + 1:
            return self.base_s * (2**view - 1)
        return self.start(DOUBLINGS + 1) + (view - DOUBLINGS - 1) * self.cap_s

    def at(self, elapsed: float) -> int:
        """The view `elapsed` seconds after the anchor (0 before it)."""
        for view in range(DOUBLINGS + 1):
            if elapsed < self.start(view + 1):
                return view
        return min(MAX_VIEW, DOUBLINGS + 1 + int((elapsed - self.start(DOUBLINGS + 1)) // self.cap_s))


def view_rank(seed: str, view: int, peer: str) -> bytes:
    """A peer's place in the leader order of one view: no peer controls the seed, and every view reshuffles."""
    return hashlib.sha256(f"{seed}\n{view}\n{peer}".encode()).digest()


def view_leader(seed: str, view: int, candidates: Collection[str]) -> str:
    return min(candidates, key=lambda p: (view_rank(seed, view, p), p))


class Action(Enum):
    LEAD = "lead"  # gather members; close once quorum and grace allow, before the view ends
    JOIN = "join"  # join `leader`'s group, waiting for it to close at most until the view ends


@dataclass(frozen=True)
class Decision:
    action: Action
    view: int
    leader: str
    ends_at: float  # wall time the view ends

    def until_end(self, now: float) -> float:
        return max(0.0, self.ends_at - now)


@dataclass
class Views:
    """One peer's place in the views of one state: the anchor it has seen, and the lowest view it may still use.

    The anchor (`see`) is when enough peers for a group were first ready; infinite until then. It only moves
    earlier, as records of earlier readiness arrive, and never further back than `lookback_s` before our own."""

    round: int
    state_hash: str
    ready_at: float  # wall time we said we were ready (our record's eta)
    anchor: float
    floor: int = 0  # after a group of ours did not commit: one past its view
    current: int = 0  # the view we are in (never goes back)
    etas: dict[str, float] = field(default_factory=dict)  # per peer: its earliest eta seen in its current readiness

    def ready_since(self, here: Mapping[str, PeerRecord]) -> dict[str, float]:
        """When each ready peer in `here` became ready, as far as we can tell: the earliest eta its record showed
        since we last saw it busy. An honest peer's eta only changes when it is ready again after being busy; a
        record that keeps pushing its eta later while it stays ready would otherwise slip in and out of the
        candidates (and move the cutoff) with the moment each peer happens to read it, and the peers would pick
        different leaders. Bounded: peers past `MAX_TRACKED` are taken at their word."""
        since = {}
        for peer, record in here.items():
            if not record.ready:
                self.etas.pop(peer, None)
                continue
            eta = min(self.etas.get(peer, record.eta), record.eta)
            if peer in self.etas or len(self.etas) < MAX_TRACKED:
                self.etas[peer] = eta
            since[peer] = eta
        return since

    def see(self, ready: Mapping[str, float], *, me: str, now: float, lookback_s: float,
            enough: Callable[[Collection[str]], bool] = lambda peers: True) -> None:
        """Move the anchor to when the ready peers (peer -> when it became ready; `me` is added at `ready_at`) were
        first `enough` for a group, where that is earlier: not the earliest readiness any one record states, which
        a lone record backdating its readiness would choose for everybody (and put every peer in the long views at
        once). Before enough peers were ready no group could close, so no view's time runs out (the anchor stays
        infinite). Readiness earlier than `lookback_s` before ours, or later than READY_AHEAD_S after `now`, is not
        believed."""
        earliest, latest = self.ready_at - lookback_s, now + READY_AHEAD_S
        believed = {p: eta for p, eta in ready.items() if earliest <= eta <= latest}
        believed[me] = self.ready_at
        self.anchor = min(self.anchor, _gathered(believed, enough))

    def ready_again(self, now: float) -> None:
        """Ready again after being busy at the same state (in the exchange of a group of ours that failed, or
        training): our readiness moves, the anchor stays."""
        self.ready_at = now


def decide(*, me: str, views: Views, here: Mapping[str, PeerRecord], seed: str, schedule: ViewSchedule,
           now: float, eligible: Callable[[Collection[str]], Collection[str]] = lambda peers: peers,
           weight: Callable[[str], int] = lambda peer: 1,
           enough: Callable[[Collection[str]], bool] = lambda peers: True) -> Decision:
    """What to do now at our state. `here`: the credible, unbanned records of the other peers at our (round, hash).
    `eligible`: who among a view's candidates may lead it, and whose later views move us on (default: all of them;
    `swarmloco.protocol.round.weights.Weights.eligible` keeps the senior ones where there are any). `weight`: each
    of those peers' say in moving us on (default: one each). `enough`: whether a set of peers could close a group
    (default: any one peer could; `Weights.enough` among the active peers in a swarm).
    Updates `views.current` and the readiness times `views.etas`; the rest of `views` is read only."""
    # the ready peers other than us (a readiness stated for later than READY_AHEAD_S from now is none yet)
    since = {p: eta for p, eta in views.ready_since({p: r for p, r in here.items() if p != me}).items()
             if eta <= now + READY_AHEAD_S}
    view = max(schedule.at(now - views.anchor), views.floor, views.current)
    if _half_ahead(me, view, here, eligible([*since, me]), weight) and \
            now - views.anchor >= schedule.start(view) + schedule.length(view) / 2:
        view = min(MAX_VIEW, view + 1)
    views.current = view
    # a view entered ahead of the schedule runs to its scheduled end; before enough peers were ever ready at this
    # state (no anchor yet) nothing runs out, and each look simply waits up to a view's length for more of them
    began = views.anchor + schedule.start(view) if math.isfinite(views.anchor) else now
    ends_at = began + schedule.length(view)
    cutoff = max(began, _gathered({**since, me: views.ready_at}, enough)) + schedule.window_s
    candidates = [p for p, eta in since.items() if eta <= cutoff]
    if views.ready_at <= cutoff:
        candidates.append(me)
    # never empty: the first peer ready is always a candidate, and `eligible` keeps some of any non-empty set
    leader = view_leader(seed, view, eligible(candidates))
    return Decision(Action.LEAD if leader == me else Action.JOIN, view, leader, ends_at)


def _gathered(ready: Mapping[str, float], enough: Callable[[Collection[str]], bool]) -> float:
    """When the ready peers (peer -> the time it became ready) first were `enough` for a group, taken in the order
    they became ready; infinity if they are not yet. `enough` only grows with its argument, so a binary search."""
    order = sorted(ready, key=lambda p: (ready[p], p))
    if not order or not enough(order):
        return math.inf
    low, high = 1, len(order)  # the shortest prefix that is enough
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if enough(order[:mid]) else (mid + 1, high)
    return ready[order[low - 1]]


def _half_ahead(me: str, view: int, here: Mapping[str, PeerRecord], voters: Collection[str],
                weight: Callable[[str], int]) -> bool:
    """Whether the peers in a later view than ours hold at least half the weight of `voters` (us included): the
    rest, we among them, are then no majority, and our view cannot gather a group."""
    total = sum(weight(p) for p in voters)
    ahead = sum(weight(p) for p in voters if p != me and here[p].view > view)
    return 2 * ahead >= total
