"""Matchmaking and the exchange on the in-memory transport: whole rounds, splits that merge, deaths at every step of a
round, a member that never sends, and the join race — in milliseconds, without p2pd."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from _fake_rounds import (
    FAST,
    H0,
    MODEL,
    NUMEL,
    Applied,
    announce,
    averager_for,
    by_rank,
    join_request,
    peers,
    run,
    whole_round,
)

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.wire import read_frame, write_frame
from swarmloco.protocol.round.config import RoundConfig
from swarmloco.protocol.round.groups import Group
from swarmloco.protocol.round.matchmaking import Matchmaker
from swarmloco.protocol.round.schedule import view_leader
from swarmloco.protocol.testing.fake import FakeNetwork
from swarmloco.protocol.trust.admission import Gate

pytestmark = pytest.mark.timeout(60)


def test_three_peers_commit_the_same_token_weighted_average_with_a_certificate(net: FakeNetwork) -> None:
    averagers = peers(net, 3, quorum=3)
    ids = [a.transport.peer_id for a in averagers]
    results, applied = whole_round(averagers, tokens=lambda i: 100 * (i + 1))
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3
    assert len({r.state_hash for r in results}) == 1 and all(r.state_hash == r.leader_hash for r in results)
    leader = next(r for r in results if r.role == "leader")
    order = sorted(ids)
    assert leader.members == order and leader.weights == [100 * (ids.index(p) + 1) for p in order]
    # Sharded: every byte one member sends is one another receives, and no member's link carries more than about
    # twice the vector (a star's leader sends it N − 1 times and receives it N − 1 times).
    assert sum(r.bytes_sent for r in results) == sum(r.bytes_received for r in results) > 0
    assert all(0 < r.bytes_sent < 2 * 4 * NUMEL and 0 < r.bytes_received < 2 * 4 * NUMEL for r in results), results
    assert all(r.pipes == 2 for r in results)
    expected = (1 * 100 + 2 * 200 + 3 * 300) / 600
    assert all(torch.allclose(a.calls[0], torch.full((NUMEL,), expected)) for a in applied)
    # θ_1 exists with a certificate every member holds: all three signed, over the previous and the new state
    certs = [r.certificate for r in results]
    assert all(c is not None and c.statement == certs[0].statement for c in certs)  # type: ignore[union-attr]
    s = certs[0].statement  # type: ignore[union-attr]
    assert (s.round, s.prev_hash, s.new_hash, s.swarm, s.work) == (1, H0, results[0].state_hash, 3, 600)
    assert set(certs[0].signatures) == set(ids)  # type: ignore[union-attr]
    assert all(not averagers[0].chain.verify(c) for c in certs)  # type: ignore[arg-type]
    assert all(a.head.round == 1 and a.head.work == 600 for a in averagers)
    assert not any(a.rolled_back for a in applied)


def test_split_halves_each_below_the_majority_meet_around_the_views_leader(net: FakeNetwork) -> None:
    """Two halves that see only each other's records each gather a group of 2 (quorum 4) that cannot close. Once the
    partition heals, every peer reads the same records and computes the same leader for the view it is in: the other
    half's leader releases its member and both join. Nobody decides alone that a leader stalled or should merge."""
    averagers = peers(net, 4, quorum=4)
    ids = [a.transport.peer_id for a in averagers]
    net.partition({ids[0], ids[2]}, {ids[1], ids[3]})
    futures = [a.find_group(0, H0) for a in averagers]
    assert net.until(lambda: sum(1 for a in averagers if a.matchmaker._collect is not None  # type: ignore[union-attr]
                                 and a.matchmaker._collect.members) >= 2, 5), "the two halves did not each form a group"  # type: ignore[union-attr]
    net.heal()
    groups = [f.result(timeout=15) for f in futures]
    assert all(isinstance(g, Group) for g in groups)
    assert len({g.leader for g in groups}) == 1  # type: ignore[union-attr]
    assert sorted(next(g for g in groups if g.is_leader).members) == sorted(ids)  # type: ignore[union-attr]
    views = {a.matchmaker.views.current for a in averagers}  # type: ignore[union-attr]
    assert len(views) == 1, views
    assert groups[0].leader == view_leader(H0, views.pop(), ids)  # type: ignore[union-attr]


def test_a_group_that_loses_a_member_below_quorum_is_discarded_and_rolled_back(net: FakeNetwork) -> None:
    """A peer is accepted into the group, then vanishes before it closes: the two left cannot gather the three
    signatures quorum 3 asks for, so nobody keeps θ_1 (before certificates, they committed a round of 2)."""
    leader, member = by_rank(peers(net, 2, quorum=3))
    victim = net.peer()

    async def join_then_die() -> None:
        reader, writer = await victim.open_stream(leader.transport.peer_id, leader.matchmaker.handler_name, timeout=1)  # type: ignore[union-attr]
        await write_frame(writer, join_request(victim), timeout=1)
        reply, _ = await read_frame(reader, pb.JoinReply, max_payload=0, timeout=1)
        assert reply.status == pb.JoinReply.ACCEPTED, reply

    found = leader.find_group(0, H0)
    net.sleep(0.05)  # the leader is collecting
    net.call(join_then_die(), timeout=5)
    net.kill(victim.peer_id)  # the leader still counts it: 2 of 3, so the group waits for the member
    member_found = member.find_group(0, H0)
    applied = [Applied(), Applied()]
    with net.pool(2) as pool:
        runs = [pool.submit(lambda a=a, f=f, i=i: run(a, f.result(timeout=10), i, applied[i]))
                for i, (a, f) in enumerate([(leader, found), (member, member_found)])]
        results = [r.result(timeout=20) for r in runs]
    assert [r.outcome for r in results] == [Outcome.DISCARDED] * 2, results
    # the leader sees it before anything moves: two contributors can never gather the three signatures
    assert "only 2 of the group contributed; a certificate needs 3" in results[0].reason, results[0].reason
    assert all(not a.calls and not a.rolled_back for a in applied)
    assert leader.head.round == 0 and member.head.round == 0


def test_leader_dying_before_commit_discards_the_round_for_every_member(net: FakeNetwork) -> None:
    averagers = by_rank(peers(net, 3, quorum=3))
    leader_id = averagers[0].transport.peer_id

    class DieBeforeCommit(Hooks):
        def before_commit(self, round_number: int) -> None:
            net.kill(leader_id)

    averagers[0].hooks = DieBeforeCommit()
    results, applied = whole_round(averagers)
    members = [r for r in results if r.role == "member"]
    assert len(members) == 2 and all(r.outcome == Outcome.DISCARDED and r.leader == leader_id for r in members)
    assert all(not a.holds_new_state for a in applied[1:]), "a member kept a round its leader never certified"
    assert all("no certificate from the leader" in r.reason for r in members), [r.reason for r in members]


def test_leader_dying_after_the_votes_leaves_every_member_on_the_old_state(net: FakeNetwork) -> None:
    """The leader has the average out and the signatures in, then dies before the certificate leaves: every member
    applied θ_1 tentatively and rolls it back, so no peer holds a state without a certificate."""
    averagers = by_rank(peers(net, 3, quorum=3))
    leader = averagers[0]
    verify = leader.chain.verify

    def die_once_signed(certificate):  # type: ignore[no-untyped-def]
        # runs on the loop once every vote is in; the certificate broadcast that follows meets a dead leader
        asyncio.ensure_future(net._kill(leader.transport.peer_id))
        return verify(certificate)

    leader.chain.verify = die_once_signed  # type: ignore[method-assign]
    results, applied = whole_round(averagers)
    members = [r for r, a in zip(results, averagers, strict=True) if a is not leader]
    assert all(r.outcome == Outcome.DISCARDED for r in members), members
    assert all(a.calls and not a.holds_new_state for a in applied[1:])


def test_member_that_never_sends_is_excluded_and_the_round_commits(net: FakeNetwork) -> None:
    """A stranger joins, receives GroupClosed, and goes silent: the leader stops waiting at its collect deadline and
    the two contributors certify the round."""
    averagers = by_rank(peers(net, 2, quorum=2))
    silent = net.peer()
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    leader_id = averagers[0].transport.peer_id

    async def join_and_hold() -> None:
        reader, writer = await silent.open_stream(leader_id, averagers[0].matchmaker.handler_name, timeout=1)  # type: ignore[union-attr]
        await write_frame(writer, join_request(silent), timeout=1)
        held.append((reader, writer))  # never sends a contribution, never closes

    found = averagers[0].find_group(0, H0)
    net.sleep(0.05)
    net.call(join_and_hold(), timeout=5)
    applied = [Applied(), Applied()]
    with net.pool(2) as pool:
        lead = pool.submit(lambda: run(averagers[0], found.result(timeout=10), 0, applied[0], 10))  # type: ignore[arg-type]
        memb = pool.submit(lambda: run(averagers[1], averagers[1].find_group(0, H0).result(timeout=10), 1,  # type: ignore[arg-type]
                                       applied[1], 10))
        results = [lead.result(timeout=20), memb.result(timeout=20)]
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 2, results
    assert "no contribution" in results[0].excluded[silent.peer_id], results[0].excluded
    assert results[0].members == sorted(a.transport.peer_id for a in averagers)
    assert results[0].state_hash == results[1].state_hash


def test_a_peer_that_goes_to_join_another_leader_stops_admitting_members(net: FakeNetwork) -> None:
    """A peer leads alone, then sees a better-ranked leader and goes to join it. While that join is in flight, a
    third peer asking the first must be turned away: before, it was admitted to a group never closed, and waited."""
    lone = averager_for(net.peer(), quorum=2)
    announce(lone.transport)  # type: ignore[arg-type]
    found = lone.find_group(0, H0)
    net.sleep(0.05)  # it is collecting, nobody else is ready
    preferred = net.peer()
    while by_rank([lone, averager_for(preferred, quorum=2)])[0] is lone:
        preferred = net.peer()  # a peer that outranks it for this state
    reply_now = asyncio.Event()
    asked = threading.Event()

    async def slow_leader(caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader, pb.JoinRequest, max_payload=0, timeout=1)
        asked.set()
        await reply_now.wait()  # keeps the join in flight
        await write_frame(writer, pb.JoinReply(status=pb.JoinReply.NOT_LEADER, message="test"), timeout=1)

    net.call(preferred.add_handler(lone.matchmaker.handler_name, slow_leader), timeout=1)  # type: ignore[union-attr]
    announce(preferred)
    assert net.until(asked.is_set, 5), "the lone leader never went to join the better-ranked one"
    asker = net.peer()

    async def ask() -> int:
        reader, writer = await asker.open_stream(lone.transport.peer_id, lone.matchmaker.handler_name, timeout=1)  # type: ignore[union-attr]
        await write_frame(writer, join_request(asker), timeout=1)
        reply, _ = await read_frame(reader, pb.JoinReply, max_payload=0, timeout=1)
        return reply.status

    assert net.call(ask(), timeout=5) == pb.JoinReply.NOT_LEADER
    reply_now.set()
    found.cancel()


def _matchmaker(net: FakeNetwork) -> tuple[Matchmaker, str]:
    transport = net.peer()
    announce(transport)
    averager = averager_for(transport, quorum=2)
    mm = Matchmaker(transport, RoundConfig(quorum=2, **FAST), MODEL, chain=averager.chain,  # type: ignore[arg-type]
                    gate=Gate(transport.run_id, None), credentials=transport.credentials)
    return mm, transport.peer_id


class _SlowReplyWriter:
    """A join stream whose first reply is held in flight until released (the window the join race lives in)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.release = asyncio.Event()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        await self.release.wait()

    def close(self) -> None:
        self.closed = True


def test_group_closing_while_the_accept_is_in_flight_still_counts_the_member(net: FakeNetwork) -> None:
    """Admission, then the ACCEPTED reply is in flight, then the group closes: the member must be in the group and
    get GroupClosed (before, it was registered only after the reply and waited out the round)."""
    mm, leader_id = _matchmaker(net)
    request = join_request(net.peer())

    async def race() -> tuple[Group, bytes, bool]:
        mm.set_state(0, H0)
        collect = mm._ensure_collecting(0, 0)
        reader = asyncio.StreamReader()
        await write_frame(_Feed(reader), request, timeout=1)
        writer = _SlowReplyWriter()
        handler = asyncio.ensure_future(mm._handle_join("member", reader, writer))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # admitted; the reply is in flight
        group_task = asyncio.ensure_future(mm._close(collect, {leader_id}, mm._weights()))
        await asyncio.sleep(0.05)
        writer.release.set()
        group = await group_task
        reader.feed_eof()  # the member closes once it is done
        await asyncio.wait_for(handler, 2)
        return group, bytes(writer.data), writer.closed

    group, sent, closed = net.call(race(), timeout=10)
    assert group.members == [leader_id, "member"]

    async def parse() -> tuple[pb.JoinReply, pb.GroupClosed]:
        # made inside the loop: a StreamReader built outside one fails once an earlier test's asyncio.run has
        # cleared the main thread's loop
        reply_reader = asyncio.StreamReader()
        reply_reader.feed_data(sent)
        reply_reader.feed_eof()
        reply, _ = await read_frame(reply_reader, pb.JoinReply, max_payload=0, timeout=1)
        closed_msg, _ = await read_frame(reply_reader, pb.GroupClosed, max_payload=0, timeout=1)
        return reply, closed_msg

    reply, closed_msg = asyncio.run(parse())
    assert reply.status == pb.JoinReply.ACCEPTED and list(closed_msg.members) == [leader_id, "member"] and closed
    assert closed_msg.swarm == 2


def test_abandoned_group_ends_a_member_stream_whose_accept_was_in_flight(net: FakeNetwork) -> None:
    mm, _ = _matchmaker(net)
    request = join_request(net.peer())

    async def abandon() -> bool:
        mm.set_state(0, H0)
        mm._ensure_collecting(0, 0)
        reader = asyncio.StreamReader()
        await write_frame(_Feed(reader), request, timeout=1)
        writer = _SlowReplyWriter()
        handler = asyncio.ensure_future(mm._handle_join("member", reader, writer))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        mm._abandon()  # e.g. merging into a stronger leader while the reply is in flight
        writer.release.set()
        await asyncio.wait_for(handler, 2)  # ends at once (no AssertionError, no wait for the member)
        return writer.closed

    assert net.call(abandon(), timeout=10)


class _Feed:
    """Writes into a StreamReader (to hand a handler a request)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def write(self, data: bytes) -> None:
        self.reader.feed_data(data)

    async def drain(self) -> None:
        return None
