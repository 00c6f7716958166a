"""Matchmaking and the exchange on the in-memory transport: whole rounds, splits that merge, deaths at every step of a
round, a member that never sends, and the join race — in milliseconds, without p2pd."""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from protocol import swarmloco_wire_pb2 as pb
from protocol.averager import Averager, Contribution, RoundResult
from protocol.hooks import Hooks
from protocol.matchmaking import Group, Matchmaker
from protocol.records import PROTOCOL_VERSION, PeerRecord
from protocol.rounds import Behind, LocalModel, Outcome, RoundConfig
from protocol.testing.fake import FakeNetwork, FakeTransport
from protocol.wire import read_frame, write_frame

pytestmark = pytest.mark.timeout(60)
H0 = "0" * 64
NUMEL = 64
MODEL = LocalModel(fingerprint="fp", config={"numel": NUMEL}, numel=NUMEL)
FAST = dict(
    grace_min_s=0.0, grace_max_s=0.2, round_timeout_s=5, exchange_timeout_s=1, control_timeout_s=1, codec="fp32"
)


@pytest.fixture
def net() -> Iterator[FakeNetwork]:
    with FakeNetwork() as n:
        yield n


def _peers(net: FakeNetwork, n: int, *, quorum: int, hooks: dict[int, Hooks] | None = None) -> list[Averager]:
    out = []
    for i in range(n):
        transport = net.peer(f"peer-{i}")
        averager = Averager(transport, RoundConfig(quorum=quorum, **FAST), MODEL, hooks=(hooks or {}).get(i))
        averager.start()
        averager.set_state(0, H0)
        _ready(transport)
        out.append(averager)
    return out


def _ready(transport: FakeTransport, round_number: int = 0) -> None:
    record = PeerRecord.announce(fingerprint="fp", config_json="{}", round=round_number, state_hash=H0, ready=True)
    transport.update_record(**record.to_value())


def _join_request(transport: FakeTransport) -> pb.JoinRequest:
    return pb.JoinRequest(protocol_version=PROTOCOL_VERSION, run_id=transport.run_id, fingerprint="fp", round=0,
                          state_hash=H0)


def _delta(i: int) -> torch.Tensor:
    return torch.full((NUMEL,), float(i + 1))


class Applied:
    """An `apply` that records what it was given and returns a hash of it (so equal averages give equal hashes)."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def __call__(self, average: torch.Tensor) -> str:
        self.calls.append(average.clone())
        return hashlib.sha256(average.numpy().tobytes()).hexdigest()


def _round(
    averagers: list[Averager], tokens: Callable[[int], int] = lambda i: 100
) -> tuple[list[RoundResult], list[Applied]]:
    """Every averager finds its group and runs the round, each on its own thread, as peers do."""
    applied = [Applied() for _ in averagers]

    def one(i: int) -> RoundResult:
        found = averagers[i].find_group(0, H0).result(timeout=10)
        assert isinstance(found, Group), found
        return averagers[i].run_round(found, Contribution(delta=_delta(i), tokens=tokens(i)), apply=applied[i])

    with concurrent.futures.ThreadPoolExecutor(len(averagers)) as pool:
        results = list(pool.map(one, range(len(averagers))))
    return results, applied


def test_three_peers_commit_the_same_token_weighted_average(net: FakeNetwork) -> None:
    results, applied = _round(_peers(net, 3, quorum=3), tokens=lambda i: 100 * (i + 1))
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3
    assert len({r.state_hash for r in results}) == 1 and all(r.state_hash == r.leader_hash for r in results)
    leader = next(r for r in results if r.role == "leader")
    assert leader.members == ["peer-0", "peer-1", "peer-2"] and leader.weights == [100, 200, 300]
    # every byte the leader reports sending is one a member reports receiving, and the other way round
    members = [r for r in results if r.role == "member"]
    assert leader.bytes_sent == sum(r.bytes_received for r in members) > 0
    assert leader.bytes_received == sum(r.bytes_sent for r in members) > 0
    expected = (1 * 100 + 2 * 200 + 3 * 300) / 600
    assert all(torch.allclose(a.calls[0], torch.full((NUMEL,), expected)) for a in applied)


def test_split_groups_below_quorum_merge(net: FakeNetwork) -> None:
    """Two halves that see only each other's records each form a group of 2 (quorum 4); once the view heals, the
    weaker leader hands its member over and one group of 4 closes. Without the merge all four time out."""
    averagers = _peers(net, 4, quorum=4)
    ids = [a.transport.peer_id for a in averagers]
    net.partition({ids[0], ids[2]}, {ids[1], ids[3]})
    futures = [a.find_group(0, H0) for a in averagers]
    deadline = time.monotonic() + 5
    while sum(1 for a in averagers if a.matchmaker._collect is not None and a.matchmaker._collect.members) < 2:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the two halves did not each form a group"
        time.sleep(0.01)
    net.heal()
    groups = [f.result(timeout=10) for f in futures]
    assert all(isinstance(g, Group) for g in groups)
    assert {g.leader for g in groups} == {ids[0]}  # type: ignore[union-attr]
    assert sorted(next(g for g in groups if g.is_leader).members) == ids  # type: ignore[union-attr]


def test_member_dying_after_join_is_left_out(net: FakeNetwork) -> None:
    """A peer is accepted into the group, then vanishes before it closes: the others still commit together."""
    leader, member = _peers(net, 2, quorum=3)
    victim = net.peer("peer-9")

    async def join_then_die() -> None:
        reader, writer = await victim.open_stream(leader.transport.peer_id, leader.matchmaker.handler_name, timeout=1)  # type: ignore[union-attr]
        await write_frame(writer, _join_request(victim), timeout=1)
        reply, _ = await read_frame(reader, pb.JoinReply, max_payload=0, timeout=1)
        assert reply.status == pb.JoinReply.ACCEPTED, reply

    found = leader.find_group(0, H0)
    time.sleep(0.05)  # the leader is collecting
    net.call(join_then_die(), timeout=5)
    net.kill("peer-9")  # the leader still counts it: 2 of 3, so the group waits for the member
    member_found = member.find_group(0, H0)
    applied = [Applied(), Applied()]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(
                lambda a=a, f=f, i=i: a.run_round(
                    f.result(timeout=10), Contribution(delta=_delta(i), tokens=10), apply=applied[i]
                )
            )
            for i, (a, f) in enumerate([(leader, found), (member, member_found)])
        ]
        results = [run.result(timeout=20) for run in runs]
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 2, results
    assert results[0].state_hash == results[1].state_hash and results[0].members == ["peer-0", "peer-1"]


def test_leader_dying_before_commit_discards_the_round_for_every_member(net: FakeNetwork) -> None:
    class DieBeforeCommit(Hooks):
        def before_commit(self, round_number: int) -> None:
            net.kill("peer-0")

    averagers = _peers(net, 3, quorum=3, hooks={0: DieBeforeCommit()})
    results, applied = _round(averagers)
    members = [r for r in results if r.role == "member"]
    assert len(members) == 2 and all(r.outcome == Outcome.DISCARDED and r.leader == "peer-0" for r in members), members
    assert all(not a.calls for a in applied[1:]), "a member applied a round its leader never committed"
    assert all("lost the leader" in r.reason for r in members)


def test_member_that_never_sends_is_excluded_and_the_round_commits(net: FakeNetwork) -> None:
    """A stranger joins, receives GroupClosed, and goes silent: the leader stops waiting at its collect deadline."""
    averagers = _peers(net, 2, quorum=3)
    silent = net.peer("peer-silent")
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def join_and_hold() -> None:
        reader, writer = await silent.open_stream("peer-0", averagers[0].matchmaker.handler_name, timeout=1)  # type: ignore[union-attr]
        await write_frame(writer, _join_request(silent), timeout=1)
        held.append((reader, writer))  # never sends a contribution, never closes

    found = averagers[0].find_group(0, H0)
    time.sleep(0.05)
    net.call(join_and_hold(), timeout=5)
    applied = [Applied(), Applied()]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        lead = pool.submit(
            lambda: averagers[0].run_round(
                found.result(timeout=10), Contribution(delta=_delta(0), tokens=10), apply=applied[0]
            )
        )
        memb = pool.submit(
            lambda: averagers[1].run_round(
                averagers[1].find_group(0, H0).result(timeout=10),
                Contribution(delta=_delta(1), tokens=10),
                apply=applied[1],
            )
        )
        results = [lead.result(timeout=20), memb.result(timeout=20)]
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 2, results
    assert "no contribution" in results[0].excluded["peer-silent"], results[0].excluded
    assert results[0].members == ["peer-0", "peer-1"] and results[0].state_hash == results[1].state_hash


def test_a_peer_that_goes_to_join_another_leader_stops_admitting_members(net: FakeNetwork) -> None:
    """peer-5 leads alone, then sees a leader it prefers and goes to join it. While that join is in flight, a third
    peer asking peer-5 must be turned away: before, it was admitted to a group peer-5 never closed, and waited."""
    (lone,) = _peers_named(net, ["peer-5"], quorum=2)
    found = lone.find_group(0, H0)
    time.sleep(0.05)  # peer-5 is collecting, nobody else is ready
    preferred = net.peer("peer-1")
    reply_now = asyncio.Event()
    asked = threading.Event()

    async def slow_leader(caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader, pb.JoinRequest, max_payload=0, timeout=1)
        asked.set()
        await reply_now.wait()  # keeps peer-5's join in flight
        await write_frame(writer, pb.JoinReply(status=pb.JoinReply.NOT_LEADER, message="test"), timeout=1)

    net.call(preferred.add_handler(lone.matchmaker.handler_name, slow_leader), timeout=1)  # type: ignore[union-attr]
    _ready(preferred)
    assert asked.wait(5), "peer-5 never went to join the preferred leader"
    asker = net.peer("peer-7")

    async def ask() -> int:
        reader, writer = await asker.open_stream("peer-5", lone.matchmaker.handler_name, timeout=1)  # type: ignore[union-attr]
        await write_frame(writer, _join_request(asker), timeout=1)
        reply, _ = await read_frame(reader, pb.JoinReply, max_payload=0, timeout=1)
        return reply.status

    assert net.call(ask(), timeout=5) == pb.JoinReply.NOT_LEADER
    reply_now.set()
    found.cancel()


def _peers_named(net: FakeNetwork, names: list[str], *, quorum: int) -> list[Averager]:
    out = []
    for name in names:
        transport = net.peer(name)
        averager = Averager(transport, RoundConfig(quorum=quorum, **FAST), MODEL)
        averager.start()
        averager.set_state(0, H0)
        _ready(transport)
        out.append(averager)
    return out


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
    transport = net.peer("leader")
    _ready(transport)
    mm = Matchmaker(transport, RoundConfig(quorum=2, **FAST), MODEL, data_plane=None, dial_data_plane=False)
    request = _join_request(transport)

    async def race() -> tuple[Group, bytes, bool]:
        mm.set_state(0, H0)
        collect = mm._ensure_collecting(0)
        reader = asyncio.StreamReader()
        await write_frame(_Feed(reader), request, timeout=1)
        writer = _SlowReplyWriter()
        handler = asyncio.ensure_future(mm._handle_join("member", reader, writer))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # admitted; the reply is in flight
        group_task = asyncio.ensure_future(mm._close(collect))
        await asyncio.sleep(0.05)
        writer.release.set()
        group = await group_task
        reader.feed_eof()  # the member closes once it is done
        await asyncio.wait_for(handler, 2)
        return group, bytes(writer.data), writer.closed

    group, sent, closed = net.call(race(), timeout=10)
    assert group.members == ["leader", "member"]
    reply_reader = asyncio.StreamReader()
    reply_reader.feed_data(sent)
    reply_reader.feed_eof()

    async def parse() -> tuple[pb.JoinReply, pb.GroupClosed]:
        reply, _ = await read_frame(reply_reader, pb.JoinReply, max_payload=0, timeout=1)
        closed_msg, _ = await read_frame(reply_reader, pb.GroupClosed, max_payload=0, timeout=1)
        return reply, closed_msg

    reply, closed_msg = asyncio.run(parse())
    assert reply.status == pb.JoinReply.ACCEPTED and list(closed_msg.members) == ["leader", "member"] and closed


def test_abandoned_group_ends_a_member_stream_whose_accept_was_in_flight(net: FakeNetwork) -> None:
    transport = net.peer("leader")
    _ready(transport)
    mm = Matchmaker(transport, RoundConfig(quorum=2, **FAST), MODEL, data_plane=None, dial_data_plane=False)
    request = _join_request(transport)

    async def abandon() -> bool:
        mm.set_state(0, H0)
        mm._ensure_collecting(0)
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


def test_a_peer_behind_is_told_to_fetch_the_newer_state(net: FakeNetwork) -> None:
    (averager,) = _peers(net, 1, quorum=2)
    ahead = net.peer("ahead")
    record = PeerRecord.announce(fingerprint="fp", config_json="{}", round=3, state_hash="3" * 64, eta=0.0)
    ahead.update_record(**record.to_value())
    found = averager.find_group(0, H0).result(timeout=5)
    assert isinstance(found, Behind) and (found.round, found.donors) == (3, ["ahead"])


class _Feed:
    """Writes into a StreamReader (to hand a handler a request)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def write(self, data: bytes) -> None:
        self.reader.feed_data(data)

    async def drain(self) -> None:
        return None
