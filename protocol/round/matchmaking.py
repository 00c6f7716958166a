"""Group formation: from the peers' DHT records to one closed group of members around one leader.

Seen from a peer that holds θ_r and has spent its round budget:
1. It is marked ready in its record and reads the records of compatible peers at the same (r, state hash).
2. It gathers around the ready peer at its state that ranks first (`pick_leader`: a hash of the round's seed with
   the peer id, an order no peer controls). A leader admits a JoinRequest while its group is open and the request
   carries a valid ticket and matches our run, model, round and state; the member checks the leader's ticket.
3. A leader closes the group once it has a majority of the active swarm and at least `quorum` peers
   (`swarmloco.protocol.trust.certificates.need`) *and* the grace window has passed (it waits a little for peers whose
   records say they are about to be ready). Closing sends every member the member list and the swarm size; the round
   itself (claims, plan, sharded reduce, votes) then runs in `swarmloco.protocol.round.steps`.
4. Peers that read records at different moments can form two groups, both below that size. Every peer orders
   leaders the same way, so the worse-ranked leader, after seeing the better one twice in a row, releases its
   members (nothing was closed, so nothing can split) and joins it.
A peer that sees a verified certified state outranking its own gets `Behind` instead, unless members joined it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.records import PROTOCOL_VERSION, PeerRecord
from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.base.wire import WireError, close_writer, read_frame, write_frame
from swarmloco.protocol.chain.chain import Chain
from swarmloco.protocol.chain.forks import Behind
from swarmloco.protocol.network.transport import Transport
from swarmloco.protocol.round.config import Deadlines, LocalModel, RoundConfig
from swarmloco.protocol.round.exchange import Link
from swarmloco.protocol.round.groups import Attempt, Collecting, Declined, Group, RoundAborted, admit
from swarmloco.protocol.round.rules import active_peers, compatible, grace_over, leader_rank, pick_leader
from swarmloco.protocol.trust.admission import Credentials, Gate
from swarmloco.protocol.trust.certificates import need

logger = logging.getLogger(__name__)
POLL_S = 0.25  # a leader re-reads the records this often while it waits for members (a join wakes it at once)
LONE_S = 1.0  # a best-ranked leader nobody joined looks for a group already forming after this long
STALL_SKIP_ROUNDS = 3  # a leader whose round with us ended uncertified is skipped this many round timeouts

# How long a leader that turned us down is skipped, by its answer.
_SKIP_S = {pb.JoinReply.INCOMPATIBLE: 3600.0, pb.JoinReply.NOT_ADMITTED: 60.0, pb.JoinReply.WRONG_STATE: 5.0}
_SKIP_UNADMITTED_LEADER_S, _SKIP_UNREACHABLE_S, _SKIP_DROPPED_S, _SKIP_OTHER_S = 3600.0, 10.0, 5.0, 1.0


class Matchmaker:
    """Runs on the transport's loop: serves join requests, and forms or finds the group for a round."""

    def __init__(
        self,
        transport: Transport,
        cfg: RoundConfig,
        model: LocalModel,
        *,
        chain: Chain,
        gate: Gate,
        credentials: Credentials,
    ) -> None:
        self.transport, self.cfg, self.model = transport, cfg, model
        self.chain, self.gate, self.credentials = chain, gate, credentials
        self.deadlines = Deadlines.of(cfg)
        self.handler_name = f"swarmloco/{transport.run_id}/avg/v{PROTOCOL_VERSION}"
        self.round, self.state_hash, self.seed = 0, "", ""
        self.refusals: list[str] = []  # why other peers refused us: each reason is logged once
        self._collect: Collecting | None = None
        # Leaders that accepted us and then never closed the group: skipped across rounds for a while. The leader
        # order only changes with the state, so without this one stalling leader would hold every retry.
        self._stalled: dict[str, float] = {}
        self._held: set[str] = set()  # of those, the ones that held us to our deadline: never followed while skipped
        self._released: dict[str, float] = {}  # leaders that released us once: until when a second release is a stall
        self.banned: dict[str, str] = {}  # peers proven to have cheated: never our leader, never in our group

    def skip_leader(self, leader: str, why: str, *, held: bool = False) -> None:
        """Skip `leader` for a few round timeouts: it took us in, and the round ended uncertified (on the loop).
        `held`: it kept us waiting until our deadline, the one stall no honest leader causes on purpose."""
        self._stalled[leader] = time.monotonic() + STALL_SKIP_ROUNDS * self.cfg.round_timeout_s
        if held:
            self._held.add(leader)
        logger.info("skipping leader %s for the next rounds: %s", short_id(leader), why)

    def _released_or_stalled(self, leader: str, round_number: int, exc: WireError) -> None:
        """A leader that took us in ended the join stream without closing its group. An honest leader releases its
        members when it merges into a better-ranked group, so a first release costs it only the short skip of a
        dropped join; holding us to the deadline, or releasing us again within the stall window (holding members
        and letting them go, round after round), is a stall: skipped for the next rounds."""
        now = time.monotonic()
        self._released = {p: t for p, t in self._released.items() if t > now}
        held = isinstance(exc.__cause__, TimeoutError)
        if held or leader in self._released:
            self.skip_leader(leader, f"round {round_number}: it accepted us but never closed its group", held=held)
        else:
            self._released[leader] = now + STALL_SKIP_ROUNDS * self.cfg.round_timeout_s

    async def register(self) -> None:
        await self.transport.add_handler(self.handler_name, self._handle_join)

    def set_state(self, round_number: int, state_hash: str, seed: str = "") -> None:
        """The state we hold (joins are admitted against it) and its leader-order seed (default: its hash)."""
        if (round_number, state_hash) != (self.round, self.state_hash) or seed:
            self.seed = seed or state_hash
        self.round, self.state_hash = round_number, state_hash

    # --- finding or forming a group -------------------------------------------------------------------------------
    async def form_group(self, round_number: int, state_hash: str) -> Group | Behind:
        """The closed group for round r, or the newer state to fetch. Raises RoundAborted past round_timeout_s."""
        self.set_state(round_number, state_hash)
        attempt = Attempt(
            round=round_number, state_hash=state_hash, deadline=time.monotonic() + self.cfg.round_timeout_s
        )
        try:
            while time.monotonic() < attempt.deadline:
                try:
                    found = await self.transport.fetch_records(timeout=self.deadlines.control)
                except TimeoutError:
                    logger.info("DHT lookup timed out; retrying")
                    continue
                records = compatible(found, self.model.fingerprint)
                if not (self._collect is not None and self._collect.members):
                    target = await self.chain.target(records, wait=0)  # checks run in the background
                    if target is not None:
                        self._abandon()
                        return target
                records = self.chain.credible(records)
                here = {p: r for p, r in records.items() if r.round == round_number and r.state_hash == state_hash}
                attempt.active = active_peers(records, round_number) | {self.transport.peer_id}
                leader = self._choose_leader(attempt, here)
                if leader == self.transport.peer_id:
                    group = await self._lead(attempt, here)
                    if group is not None:
                        return group
                    continue
                # Joining someone else: stop admitting members to a group of ours we would never close (it is
                # empty here: with members we only leave through a merge, which has released them already).
                self._abandon()
                attempt.quorum_at = attempt.alone_since = None
                joined = await self._try_join(leader, attempt)
                if isinstance(joined, Group):
                    return joined
                attempt.skip[leader] = time.monotonic() + joined.retry_after_s
            raise RoundAborted(
                f"no group of {need(attempt.swarm, self.cfg.quorum)} (a majority of {attempt.swarm} active peers) "
                f"formed for round {round_number} within {self.cfg.round_timeout_s:.0f}s"
            )
        except BaseException:
            self._abandon()
            raise

    def _choose_leader(self, attempt: Attempt, here: dict[str, PeerRecord]) -> str:
        now = time.monotonic()
        attempt.skip = {p: t for p, t in attempt.skip.items() if t > now}
        self._stalled = {p: t for p, t in self._stalled.items() if t > now}
        self._held &= self._stalled.keys()
        me, needed = self.transport.peer_id, need(attempt.swarm, self.cfg.quorum)
        # Skipping a stalled leader must not leave us unable to form a group of the size a round needs: peers judge
        # stalls each on its own, and an honest leader can look stalled to one member (it released us twice, or
        # its round was lost). Where the peers at our state without the stalled ones are too few, those are
        # candidates again, and all of us follow the one leader order. A leader that held us to our deadline stays
        # skipped: a record missing from one DHT read would otherwise hand a holding attacker every member again.
        stalled = set(self._stalled)
        if len(({p for p in here if p not in self.banned} | {me}) - stalled) < needed:
            stalled = set(self._held)
        candidates = [p for p, r in here.items()
                      if r.ready and p not in attempt.skip and p not in stalled and p not in self.banned]
        members = len(self._collect.members) if self._collect is not None else 0
        leader = pick_leader(me, members, candidates, needed=needed, seed=self.seed or attempt.state_hash)
        if leader == me and not members:
            leader = self._rescue_lone_leader(attempt, here, candidates, now)
        else:
            attempt.alone_since = None
        if leader == me or not members:
            attempt.merge_into, attempt.merge_seen = None, 0
            return leader
        # A better-ranked leader while we lead a group below the size it needs: a split. Merge once it is seen twice
        # in a row, so a record read mid-update does not dissolve a group.
        if not attempt.confirm_merge(leader):
            return self.transport.peer_id
        logger.info("round %d: merging my %d member(s) into %s's group", attempt.round, members, short_id(leader))
        self._abandon()
        return leader

    def _rescue_lone_leader(self, attempt: Attempt, here: dict[str, PeerRecord], candidates: list[str],
                            now: float) -> str:
        """We rank first but nobody joined us (they tried us before we were collecting, and gathered around the next
        in rank): after a short wait, join the best-ranked group already forming rather than be left out. The only
        use of a record's `leading` count: a false one can attract a lone peer for one round, never make it lead."""
        me = self.transport.peer_id
        if attempt.alone_since is None:
            attempt.alone_since = now
        if now - attempt.alone_since < min(LONE_S, self.cfg.grace_max_s / 2):
            return me
        # A count is plausible only if that many other ready peers at our state exist to be its members.
        forming = [p for p in candidates if 0 < here[p].leading <= len(here) - 1]
        if not forming:
            return me
        return min(forming, key=lambda p: (leader_rank(self.seed or attempt.state_hash, p), p))

    async def _lead(self, attempt: Attempt, here: dict[str, PeerRecord]) -> Group | None:
        """One look as leader: close the group if quorum and grace allow, else wait for a join or the next poll."""
        collect = self._ensure_collecting(attempt.round)
        self.transport.update_record(leading=len(collect.members))
        now = time.monotonic()
        if 1 + len(collect.members) >= need(attempt.swarm, self.cfg.quorum):
            attempt.quorum_at = attempt.quorum_at or now
            wall = time.time()
            etas = [None if r.ready else max(0.0, r.eta - wall) for p, r in here.items() if p not in collect.members]
            if grace_over(waited=now - attempt.quorum_at, etas=etas, cfg=self.cfg):
                return await self._close(collect, attempt.active)
        collect.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(collect.changed.wait(), timeout=POLL_S)
        return None

    def _ensure_collecting(self, round_number: int) -> Collecting:
        if self._collect is None or self._collect.round != round_number:
            self._abandon()
            self._collect = Collecting(round=round_number)
        return self._collect

    def _abandon(self) -> None:
        """Give up an open group: its members' join streams end, and they look for another leader."""
        collect, self._collect = self._collect, None
        if collect is None:
            return
        if not collect.done.done():
            collect.done.set_result(None)
        self.transport.update_record(leading=0)

    async def _close(self, collect: Collecting, active: set[str]) -> Group:
        collect.closed = True
        self._collect = None
        self.transport.update_record(leading=0, ready=False)
        me = self.transport.peer_id
        links = dict(collect.members)
        names = [me, *links]
        swarm = len(active | set(names))  # members whose records we have not seen yet are active too

        async def notify(link: Link) -> bool:
            message = pb.GroupClosed(
                round=collect.round, members=names, codec=self.cfg.codec, deadline_s=self.deadlines.transfer,
                swarm=swarm,
            )
            try:
                await write_frame(link.writer, message, timeout=self.deadlines.control)
                return True
            except WireError as exc:
                logger.info("member %s unreachable at close: %r", short_id(link.peer), exc)
                return False

        reached = await asyncio.gather(*(notify(link) for link in links.values()))
        alive = {p: link for (p, link), ok in zip(links.items(), reached, strict=False) if ok}
        tickets = {p: collect.tickets.get(p, b"") for p in alive}
        return Group(round=collect.round, me=me, leader=me, members=[me, *alive], links=alive, release=collect.done,
                     swarm=swarm, tickets=tickets)

    async def _try_join(self, leader: str, attempt: Attempt) -> Group | Declined:
        """Join `leader`'s group: the closed group, or why not (as how long to leave this leader alone)."""
        d = self.deadlines
        try:
            reader, writer = await self.transport.open_stream(leader, self.handler_name, timeout=d.control)
        except Exception as exc:  # whatever keeps us from a leader means: try another
            logger.info("round %d: cannot reach leader %s: %r", attempt.round, short_id(leader), exc)
            return Declined(_SKIP_UNREACHABLE_S)
        link = Link(leader, reader, writer)
        try:
            request = pb.JoinRequest(
                protocol_version=PROTOCOL_VERSION,
                run_id=self.transport.run_id,
                fingerprint=self.model.fingerprint,
                task_config_json=self.model.config_json,
                round=attempt.round,
                state_hash=attempt.state_hash,
                ticket=self.credentials.ticket,
            )
            await write_frame(writer, request, timeout=d.control)
            reply, _ = await read_frame(reader, pb.JoinReply, max_payload=0, timeout=d.control)
            if reply.status != pb.JoinReply.ACCEPTED:
                logger.debug("round %d: %s turned us down: %s", attempt.round, short_id(leader), reply.message)
                if reply.status == pb.JoinReply.INCOMPATIBLE and reply.message not in self.refusals:
                    self.refusals.append(reply.message)
                    logger.error("peer %s refused us: %s", short_id(leader), reply.message)
                link.close()
                return Declined(_SKIP_S.get(reply.status, _SKIP_OTHER_S))
            refused = self.gate.check(reply.ticket, leader, role="trainer")
            if refused:
                logger.warning("round %d: leader %s is not admitted (%s); not joining it", attempt.round,
                               short_id(leader), refused)
                link.close()
                return Declined(_SKIP_UNADMITTED_LEADER_S)
            self.transport.update_record(leading=0)
            try:
                closed, _ = await read_frame(
                    reader, pb.GroupClosed, max_payload=0, timeout=max(1.0, attempt.deadline - time.monotonic())
                )
            except WireError as exc:
                self._released_or_stalled(leader, attempt.round, exc)
                raise
            if (
                closed.round != attempt.round
                or closed.codec != self.cfg.codec
                or self.transport.peer_id not in closed.members
            ):
                link.close()
                return Declined(_SKIP_DROPPED_S)
            if len(closed.members) < need(max(closed.swarm, attempt.swarm), self.cfg.quorum):
                # A group that is no majority of the swarm we see could never be certified (and two of them could
                # both commit): a leader understating the swarm is not followed.
                logger.info("round %d: %s closed %d of a claimed swarm of %d, we see %d active; not taking part",
                            attempt.round, short_id(leader), len(closed.members), closed.swarm, attempt.swarm)
                link.close()
                return Declined(_SKIP_DROPPED_S)
            self.transport.update_record(ready=False)
            return Group(
                round=attempt.round,
                me=self.transport.peer_id,
                leader=leader,
                members=list(closed.members),
                links={leader: link},
                swarm=closed.swarm,
            )
        except WireError as exc:
            logger.info("leader %s dropped us before the group closed: %r", short_id(leader), exc)
            link.close()
            return Declined(_SKIP_DROPPED_S)

    # --- serving join requests ------------------------------------------------------------------------------------
    async def _handle_join(self, caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        d = self.deadlines
        collect: Collecting | None = None
        link = Link(caller, reader, writer)
        try:
            request, _ = await read_frame(reader, pb.JoinRequest, max_payload=0, timeout=d.control)
            collect = self._collect
            status, message = admit(
                request,
                run_id=self.transport.run_id,
                model=self.model,
                state_hash=self.state_hash,
                collecting_round=collect.round if collect is not None else None,
                closed=collect.closed if collect is not None else False,
                size=len(collect.members) if collect is not None else 0,
                max_group=self.cfg.max_group,
                not_admitted=self.gate.check(request.ticket, caller, role="trainer") or (
                    f"banned from our groups: {self.banned[caller]}" if caller in self.banned else ""),
            )
            accepted = collect is not None and status == pb.JoinReply.ACCEPTED
            if accepted:
                collect.tickets[caller] = bytes(request.ticket)
                # Registered before the reply goes out: a group that closes while the reply is in flight still
                # counts this member and sends it GroupClosed, instead of leaving it waiting out the round.
                collect.members[caller] = link
                collect.changed.set()
            else:
                collect = None
            reply = pb.JoinReply(status=status, message=message, ticket=self.credentials.ticket)
            await write_frame(writer, reply, timeout=d.control)
            if collect is None:
                return
            await collect.done  # the stream stays open until the exchange is over
            if collect.closed:
                # Closing our end resets the libp2p stream and can cut off a result still in flight: wait for the
                # member to close first (it does once it has read the result), or for the deadline. A group that was
                # abandoned before closing has nothing in flight: close at once so the member moves on.
                await asyncio.wait_for(_until_eof(reader), timeout=d.linger)
        except (TimeoutError, WireError, asyncio.CancelledError, ConnectionError) as exc:
            logger.debug("join stream from %s ended: %r", short_id(caller), exc)
            if collect is not None and not collect.closed and collect.members.get(caller) is link:
                collect.members.pop(caller, None)  # the reply never got through: not a member after all
                collect.changed.set()
        finally:
            close_writer(writer)


async def _until_eof(reader: asyncio.StreamReader) -> None:
    """Read (and drop) whatever the member still sends until it closes its end."""
    while await reader.read(1 << 12):
        pass
