"""Group formation: from the peers' DHT records to one closed group of members around one leader.

Seen from a peer that holds θ_r and has spent its round budget:
1. It marks itself ready in its record (its `eta` becomes the time it was ready) and reads the records of compatible
   peers at the same (r, state hash).
2. The view schedule (`swarmloco.protocol.round.schedule`) says which view of the round it is in and who leads it:
   every peer that reads the same records computes the same leader, from the certified seed, the view number and
   who was ready by the view's cutoff. Nobody reports who leads.
3. The view's leader admits a JoinRequest while its group is open and the request carries a valid ticket and matches
   our run, model, round and state; the member checks the leader's ticket. The leader closes the group once it has a
   majority of the active swarm and at least `quorum` peers, weighed by seniority where the run's authority has
   vouched for some of them (`swarmloco.protocol.round.weights`), and the grace window has passed (it waits a little
   for peers whose records say they are about to be ready), and at the latest when its view ends. Closing sends
   every member the member list and the swarm size; the round itself (claims, plan, sharded reduce, votes) then
   runs in `swarmloco.protocol.round.steps`.
4. A view whose group did not close ends for everyone at the same time: its leader releases its members, and the
   next view has another leader. A member never waits on a leader past the end of the view.
A peer that sees a verified certified state outranking its own gets `Behind` instead, unless members joined it.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Callable, Collection

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.records import PROTOCOL_VERSION, PeerRecord
from swarmloco.protocol.base.text import bounded, short_id
from swarmloco.protocol.base.wire import WireError, close_writer, read_frame, write_frame
from swarmloco.protocol.chain.chain import Chain
from swarmloco.protocol.chain.forks import Behind
from swarmloco.protocol.network.transport import Transport
from swarmloco.protocol.round.config import Deadlines, LocalModel, RoundConfig
from swarmloco.protocol.round.exchange import Link
from swarmloco.protocol.round.groups import Collecting, Declined, Group, RoundAborted, admit
from swarmloco.protocol.round.rules import active_peers, compatible, grace_over
from swarmloco.protocol.round.schedule import POLL_S, Action, Decision, Views, ViewSchedule, decide
from swarmloco.protocol.round.weights import Weights
from swarmloco.protocol.trust.admission import Credentials, Gate

logger = logging.getLogger(__name__)


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
        hooks: Hooks | None = None,
    ) -> None:
        self.transport, self.cfg, self.model = transport, cfg, model
        self.clock = transport.clock  # every deadline and view end is read from it
        self.hooks = hooks or Hooks()
        self.chain, self.gate, self.credentials = chain, gate, credentials
        self.deadlines = Deadlines.of(cfg)
        self.schedule = ViewSchedule.of(cfg)
        self.handler_name = f"swarmloco/{transport.run_id}/avg/v{PROTOCOL_VERSION}"
        self.round, self.state_hash, self.seed = 0, "", ""
        self.proven: frozenset[str] = frozenset()  # who signed our state's certificate
        self.refusals: list[str] = []  # why other peers refused us: each reason is logged once
        self.views: Views | None = None  # where we are in the view schedule of our state
        self._collect: Collecting | None = None
        self._formed: tuple[int, str, int] | None = None  # (round, state hash, view) of the last group we formed
        self.banned: dict[str, str] = {}  # peers proven to have cheated: never our leader, never in our group

    async def register(self) -> None:
        await self.transport.add_handler(self.handler_name, self._handle_join)

    def set_state(self, round_number: int, state_hash: str, seed: str = "", proven: Collection[str] = ()) -> None:
        """The state we hold (joins are admitted against it), its leader-order seed (default: its hash) and the
        peers that signed its certificate (they lead its views where any of them is a candidate)."""
        if (round_number, state_hash) != (self.round, self.state_hash) or seed:
            self.seed = seed or state_hash
            self.proven = frozenset(proven)
        self.round, self.state_hash = round_number, state_hash

    # --- finding or forming a group -------------------------------------------------------------------------------
    async def form_group(self, round_number: int, state_hash: str) -> Group | Behind:
        """The closed group for round r, or the newer state to fetch. Raises RoundAborted past round_timeout_s."""
        self.set_state(round_number, state_hash)
        views = self._ready(round_number, state_hash)
        deadline = self.clock.monotonic() + self.cfg.round_timeout_s
        active: set[str] = {self.transport.peer_id}
        weights = self._weights()
        last: tuple[int, str] | None = None
        try:
            while self.clock.monotonic() < deadline:
                looked_at = self.clock.monotonic()
                try:
                    found = await self.transport.fetch_records(timeout=self.deadlines.control)
                    look = self.clock.monotonic() - looked_at  # what the next look will take, about
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
                me = self.transport.peer_id
                here = {p: r for p, r in records.items() if r.round == round_number and r.state_hash == state_hash
                        and p not in self.banned and p != me}
                active = active_peers(records, round_number) | {me}
                weights = self._weights()
                enough = functools.partial(weights.enough, active=active)
                wall = self.clock.time()
                views.see({p: r.eta for p, r in here.items() if r.ready}, me=me, now=wall,
                          lookback_s=self.cfg.round_timeout_s, enough=enough)
                decision = decide(me=me, views=views, here=here, seed=self.seed or state_hash,
                                  schedule=self.schedule, now=wall,
                                  eligible=self._eligible(here, weights), weight=weights.say,
                                  enough=enough)
                self.transport.update_record(view=decision.view)
                if (decision.view, decision.leader) != last:
                    last = (decision.view, decision.leader)
                    logger.debug("round %d view %d: %s %s (%.1fs left in the view)", round_number, decision.view,
                                 decision.action.value, short_id(decision.leader),
                                 decision.until_end(self.clock.time()))
                group: Group | Declined | None = None
                if decision.action is Action.LEAD:
                    group = await self._lead(round_number, decision, active, here, weights, deadline, look)
                else:
                    self._abandon()  # a group of ours from an earlier view: its members move on with us
                    group = await self._try_join(decision.leader, round_number, state_hash, decision, active,
                                                 weights)
                    if not isinstance(group, Group):
                        await asyncio.sleep(min(POLL_S, decision.until_end(self.clock.time())))
                if isinstance(group, Group):
                    self._formed = (round_number, state_hash, decision.view)
                    group.view = decision.view
                    return group
            raise RoundAborted(
                f"no {weights.short_of(active)} formed for round {round_number} "
                f"within {self.cfg.round_timeout_s:.0f}s (view {views.current})"
            )
        except BaseException:
            self._abandon()
            raise

    def _ready(self, round_number: int, state_hash: str) -> Views:
        """Say we are ready, and find our place in the views of this state (kept across attempts at it).

        Our readiness time (the `eta` our record shows) is kept across looks that formed no group: we were
        waiting for a group all along, whether alone or held by a leader that never closed. It moves only after we
        were busy since the last look (our record said so: in the exchange of a group of ours that failed, or
        training after a state we could not adopt). Were it to move with every look, a peer that holds its members
        until its view ends would be the only peer ready by the next view's cutoff, and would lead that one too."""
        now = self.clock.time()
        views = self.views
        own = self.transport.own_record()
        if views is None or (views.round, views.state_hash) != (round_number, state_hash):
            views = self.views = Views(round=round_number, state_hash=state_hash, ready_at=now, anchor=math.inf)
        elif own is not None and not own.ready:  # busy since the last look (a closed group marks us so)
            views.ready_again(now)
        if self._formed is not None and self._formed[:2] == (round_number, state_hash):
            # We were in a group at this state and are still here: it did not commit. Not that view again.
            views.floor = max(views.floor, self._formed[2] + 1)
        self.transport.update_record(ready=True, eta=views.ready_at, view=max(views.current, views.floor))
        return views

    def _eligible(self, here: dict[str, PeerRecord], weights: Weights) -> Callable[[Collection[str]], Collection[str]]:
        """Who may lead a view: those `weights` allows (the senior peers, where a checkpoint names some); among
        them never a peer behind NAT (its record, or our transport, says nobody can dial it, so nobody could join
        it), unless each of them is; and among those, the peers that signed our state's certificate, if any is a
        candidate. A signer did the last round's work and stayed to its end; an identity that never takes part in
        a round (it says "ready", and joins nobody or holds whoever joins it) then never leads one, and a peer
        that just arrived leads once it has taken part. A peer that claims to be unreachable only keeps itself
        from leading; claiming it never lets a probationer lead in a senior's place."""
        unreachable = {p for p, r in here.items() if not r.reachable}
        if not self.transport.reachable:
            unreachable.add(self.transport.peer_id)
        proven = self.proven

        def eligible(peers: Collection[str]) -> Collection[str]:
            allowed = weights.eligible(peers)
            reachable = [p for p in allowed if p not in unreachable] or allowed
            return [p for p in reachable if p in proven] or reachable

        return eligible

    def _weights(self) -> Weights:
        """How we weigh the swarm now: by the newest authority checkpoint we hold, if any."""
        return Weights(self.gate.checkpoint, self.cfg.quorum)

    async def _lead(self, round_number: int, decision: Decision, active: set[str],
                    here: dict[str, PeerRecord], weights: Weights, deadline: float, look: float) -> Group | None:
        """One look as the view's leader: close the group if quorum and grace allow, or once enough have joined
        and the view or our attempt at the round (`deadline`, monotonic) would end before our next look (`look`:
        what this one's read of the records took); else wait for a join or the next poll. The grace waits for
        peers about to be ready, and for ready ones in our view until they have had time to join: a peer that
        waits for a group reads the records every POLL_S and joins us at its next look, so one that has been ready
        in our view for four of those and has not joined is not coming (were it waited for to the grace's end, a
        peer that says "ready" and never joins would cost every round the longest grace). A ready peer in another
        view follows another leader and is not waited for at all."""
        collect = self._ensure_collecting(round_number, decision.view)
        now, wall = self.clock.monotonic(), self.clock.time()
        for p, r in here.items():
            if r.ready and r.view == decision.view:
                collect.seen_ready.setdefault(p, now)
        group = [self.transport.peer_id, *collect.members]
        if weights.enough(group, active) and not self.hooks.hold_group(round_number):
            collect.quorum_at = collect.quorum_at or now
            join_s = max(self.cfg.grace_min_s, 4 * (POLL_S + look))
            etas = [None if r.ready else max(0.0, r.eta - wall) for p, r in here.items()
                    if p not in collect.members and not (r.ready and r.view != decision.view)
                    and not (r.ready and now - collect.seen_ready.get(p, now) >= join_s)]
            if grace_over(waited=now - collect.quorum_at, etas=etas, cfg=self.cfg) or \
                    min(decision.until_end(wall), deadline - now) <= POLL_S + look:
                return await self._close(collect, active, weights)
        collect.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(collect.changed.wait(), timeout=max(0.01, min(POLL_S, decision.until_end(wall))))
        return None

    def _ensure_collecting(self, round_number: int, view: int) -> Collecting:
        if self._collect is None or (self._collect.round, self._collect.view) != (round_number, view):
            self._abandon()
            self._collect = Collecting(round=round_number, view=view)
        return self._collect

    def _abandon(self) -> None:
        """Give up an open group: its members' join streams end, and they look for another leader."""
        collect, self._collect = self._collect, None
        if collect is None:
            return
        if not collect.done.done():
            collect.done.set_result(None)

    async def _close(self, collect: Collecting, active: set[str], weights: Weights) -> Group:
        collect.closed = True
        self._collect = None
        self.transport.update_record(ready=False)
        me = self.transport.peer_id
        links = dict(collect.members)
        names = [me, *links]
        swarm = weights.swarm(names, active)  # members whose records we have not seen yet are active too

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

    async def _try_join(self, leader: str, round_number: int, state_hash: str, decision: Decision,
                        active: set[str], weights: Weights) -> Group | Declined:
        """Join the view's leader: the closed group, or why not. A member waits for the close at most until the view
        ends (and one control timeout more, for the close in flight); then the next view has another leader."""
        d = self.deadlines
        try:
            reader, writer = await self.transport.open_stream(leader, self.handler_name, timeout=d.control)
        except Exception as exc:  # whatever keeps us from the leader costs us its view, nothing more
            logger.info("round %d view %d: cannot reach leader %s: %r", round_number, decision.view,
                        short_id(leader), exc)
            return Declined("unreachable")
        link = Link(leader, reader, writer)
        try:
            request = pb.JoinRequest(
                protocol_version=PROTOCOL_VERSION,
                run_id=self.transport.run_id,
                fingerprint=self.model.fingerprint,
                task_config_json=self.model.config_json,
                round=round_number,
                state_hash=state_hash,
                ticket=self.credentials.ticket,
            )
            await write_frame(writer, request, timeout=d.control)
            reply, _ = await read_frame(reader, pb.JoinReply, max_payload=0, timeout=d.control)
            if reply.status != pb.JoinReply.ACCEPTED:
                logger.debug("round %d: %s turned us down: %s", round_number, short_id(leader), reply.message)
                if reply.status in (pb.JoinReply.INCOMPATIBLE, pb.JoinReply.NOT_ADMITTED) and \
                        reply.message not in self.refusals:
                    self.refusals.append(reply.message)
                    logger.error("peer %s refused us: %s", short_id(leader), reply.message)
                link.close()
                return Declined(bounded(reply.message))
            refused = self.gate.check(reply.ticket, leader, role="trainer")
            if refused:
                # The leader's own ticket proves it is not one of the run's peers: evidence, kept like a ban.
                logger.warning("round %d: leader %s is not admitted (%s); never following it", round_number,
                               short_id(leader), refused)
                self.banned[leader] = bounded(f"not admitted: {refused}")
                link.close()
                return Declined("leader not admitted")
            closed, _ = await read_frame(reader, pb.GroupClosed, max_payload=0,
                                         timeout=decision.until_end(self.clock.time()) + d.control)
            if closed.round != round_number or closed.codec != self.cfg.codec or \
                    self.transport.peer_id not in closed.members:
                link.close()
                return Declined("closed a group we are not in")
            if not weights.enough(closed.members, active, declared=closed.swarm):
                # A group that is no majority of the swarm we see could never be certified (and two of them could
                # both commit): a leader understating the swarm is not followed.
                logger.info("round %d: %s closed %d of a claimed swarm of %d, we see %d active (%s); not taking "
                            "part", round_number, short_id(leader), len(closed.members), closed.swarm, len(active),
                            "weighed by seniority" if weights.weighed(active) else "counted")
                link.close()
                return Declined("group too small")
            self.transport.update_record(ready=False)
            return Group(
                round=round_number,
                me=self.transport.peer_id,
                leader=leader,
                members=list(closed.members),
                links={leader: link},
                swarm=closed.swarm,
            )
        except WireError as exc:
            logger.info("round %d view %d: leader %s let us go before its group closed: %r", round_number,
                        decision.view, short_id(leader), exc)
            link.close()
            return Declined("released")

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
