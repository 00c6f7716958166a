"""Protocol units: DHT record validation, target choice, refusals, framing caps, verified multi-donor download."""
from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace

import pytest
import torch

from protocol import swarmloco_wire_pb2 as pb
from protocol.group import Group, GroupAverager, LocalModel, RoundConfig, choose_target, pick_leader
from protocol.hashing import hash_tensors
from protocol.node import NetworkConfig, SwarmNode
from protocol.records import PROTOCOL_VERSION, PeerRecord, compatibility_problem
from protocol.state_sync import ServedState, StateServer, StateSyncError, download_state
from protocol.wire import WireError, read_frame

H1, H2 = "1" * 64, "2" * 64


def _rec(**changes: object) -> PeerRecord:
    base = dict(version=PROTOCOL_VERSION, fingerprint="fp", config_json='{"d_model": 128}', round=3, state_hash=H1, ready=False,
                leading=0, eta=0.0, updated=1.0)
    base.update(changes)
    return PeerRecord(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    {"round": "3"}, {"round": -1}, {"round": 2**50}, {"ready": 1}, {"leading": True}, {"eta": float("nan")},
    {"state_hash": "abc"}, {"config_json": "x" * 5000}, {"extra": 1},
])
def test_record_schema_abuse_is_dropped(bad: dict[str, object]) -> None:
    value = _rec().to_value()
    value.update(bad)
    assert PeerRecord.parse(value) is None
    assert PeerRecord.parse(_rec().to_value()) == _rec()
    assert PeerRecord.parse("not a dict") is None and PeerRecord.parse(None) is None


def test_choose_target_prefers_highest_round_then_majority_hash() -> None:
    me = "me"
    assert choose_target({}, me, 3, H1) is None
    assert choose_target({"a": _rec(round=3, state_hash=H1)}, me, 3, H1) is None
    behind = choose_target({"a": _rec(round=5, state_hash=H2), "b": _rec(round=4)}, me, 3, H1)
    assert behind is not None and (behind.round, behind.state_hash, behind.donors) == (5, H2, ["a"])
    # same round, we are the minority hash: re-sync to the majority
    split = choose_target({"a": _rec(state_hash=H2), "b": _rec(state_hash=H2)}, me, 3, H1)
    assert split is not None and split.state_hash == H2 and sorted(split.donors) == ["a", "b"]
    # tie at the same round: every peer picks the smallest hash, so exactly one side re-syncs
    assert choose_target({"a": _rec(state_hash=H2)}, me, 3, H1) is None
    tie = choose_target({"a": _rec(state_hash=H1)}, me, 3, H2)
    assert tie is not None and tie.state_hash == H1


def test_pick_leader_orders_leaders_the_same_everywhere() -> None:
    ready = {"b": _rec(ready=True), "c": _rec(ready=True)}
    assert pick_leader("a", 0, ready, quorum=4) == "a"  # nobody leads yet: smallest id
    assert pick_leader("d", 0, ready, quorum=4) == "b"
    assert pick_leader("a", 0, {"c": _rec(ready=True, leading=1)}, quorum=4) == "c"  # most members wins over id
    # a split: we lead 1 member, "b" leads 1 with a smaller id -> we merge into "b"; "b" sees us and stays
    assert pick_leader("c", 1, {"b": _rec(ready=True, leading=1)}, quorum=4) == "b"
    assert pick_leader("b", 1, {"c": _rec(ready=True, leading=1)}, quorum=4) == "b"
    assert pick_leader("a", 1, {"c": _rec(ready=True, leading=2)}, quorum=4) == "c"  # the bigger group wins
    assert pick_leader("c", 2, {"a": _rec(ready=True, leading=1)}, quorum=4) == "c"
    # a group that has reached quorum is about to close: it never merges away
    assert pick_leader("c", 1, {"b": _rec(ready=True, leading=3)}, quorum=2) == "c"


def test_split_groups_below_quorum_merge() -> None:
    """Peers that saw different records formed two groups of 2 with quorum 4. Before, neither leader ever gave up
    its members and the round timed out on all four; now the weaker leader merges into the stronger one."""
    nodes: list[SwarmNode] = []
    visible: dict[str, set[str]] = {}

    def partitioned(node: SwarmNode):  # wraps the node's own fetch_records
        real = node.fetch_records

        async def fetch(**kw: object) -> dict[str, PeerRecord]:
            records = await real(**kw)
            allowed = visible.get(node.peer_id)
            return records if allowed is None else {p: r for p, r in records.items() if p in allowed}
        return fetch

    try:
        for _ in range(4):
            initial = tuple(nodes[0].visible_maddrs()) if nodes else ()
            n = SwarmNode(NetworkConfig(run_id="split", host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=initial, heartbeat_s=0.5))
            n.start()
            nodes.append(n)
        cfg = RoundConfig(quorum=4, grace_min_s=0.0, grace_max_s=0.0, round_timeout_s=45)
        averagers = [GroupAverager(n, cfg, LocalModel(fingerprint="fp", config={}, numel=10)) for n in nodes]
        ids = sorted(n.peer_id for n in nodes)
        halves = [set(ids[0::2]), set(ids[1::2])]  # each half holds one of the two smallest ids: two leaders
        for n, averager in zip(nodes, averagers):
            n.fetch_records = partitioned(n)  # type: ignore[method-assign]
            visible[n.peer_id] = next(h for h in halves if n.peer_id in h)
            n.call(averager.register(), timeout=30)
            n.set_record(PeerRecord(version=PROTOCOL_VERSION, fingerprint="fp", config_json="{}", round=0, state_hash=H1, ready=True,
                                    leading=0, eta=time.time(), updated=time.time()))
        futures = [n.submit(a.form_group(round_number=0, state_hash=H1, my_eta=time.time())) for n, a in zip(nodes, averagers)]
        deadline = time.monotonic() + 30
        while sum(1 for a in averagers if a._collect is not None and a._collect.members) < 2:
            assert time.monotonic() < deadline, "the two halves did not each form a group"
            time.sleep(0.1)
        visible.clear()  # the partition heals: everyone sees everyone
        groups = [f.result(timeout=60) for f in futures]
        assert all(isinstance(g, Group) for g in groups)
        leaders = {g.leader for g in groups}
        assert len(leaders) == 1 and leaders.pop() == ids[0]
        assert all(sorted(g.members) == ids for g in groups if g.is_leader)
        for n, a, g in zip(nodes, averagers, groups):
            if g.is_leader:
                n.call(a.abort_as_leader(g, "test over"), timeout=30)
    finally:
        for node in nodes:
            node.shutdown()
        time.sleep(0.5)


def test_compatibility_messages_name_the_difference() -> None:
    ours = {"d_model": 320}
    assert compatibility_problem({}, fingerprint="x", config=ours) is None
    msg = compatibility_problem({"a": _rec()}, fingerprint="other", config=ours)
    assert msg is not None and "d_model: ours 320 vs theirs 128" in msg
    msg = compatibility_problem({"a": _rec(version=PROTOCOL_VERSION + 1)}, fingerprint="fp", config=ours)
    assert msg is not None and f"protocol version {PROTOCOL_VERSION + 1}" in msg
    assert compatibility_problem({"a": _rec(), "b": _rec(fingerprint="other")}, fingerprint="fp", config=ours) is None


def test_leader_refuses_incompatible_or_wrong_state_joins() -> None:
    node = SimpleNamespace(net=NetworkConfig(run_id="r"))
    averager = GroupAverager(node, RoundConfig(), LocalModel(fingerprint="fp", config={"d_model": 128}, numel=10))  # type: ignore[arg-type]
    averager.set_state(3, H1)
    req = pb.JoinRequest(protocol_version=PROTOCOL_VERSION, run_id="r", fingerprint="fp", round=3, state_hash=H1)
    status, _ = averager._admit(req)
    assert status == pb.JoinReply.NOT_LEADER  # not collecting
    status, msg = averager._admit(pb.JoinRequest(protocol_version=PROTOCOL_VERSION + 1, run_id="r", fingerprint="fp"))
    assert status == pb.JoinReply.INCOMPATIBLE and "protocol version differs" in msg
    status, msg = averager._admit(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, run_id="r", fingerprint="zz",
                                                 task_config_json='{"d_model": 256}'))
    assert status == pb.JoinReply.INCOMPATIBLE and "d_model: ours 128 vs theirs 256" in msg
    status, msg = averager._admit(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, run_id="other", fingerprint="fp"))
    assert status == pb.JoinReply.INCOMPATIBLE and "run id differs" in msg


def test_round_config_validation_names_values() -> None:
    with pytest.raises(ValueError, match="quorum: got 0"):
        RoundConfig(quorum=0)
    with pytest.raises(ValueError, match="allowed fp32, fp16, bf16, int8, int4"):
        RoundConfig(codec="gzip")


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_frames_over_the_caps_are_refused_before_allocation() -> None:
    async def main() -> None:
        with pytest.raises(WireError, match="header"):
            await read_frame(_reader(struct.pack("<I", 10**9)), pb.JoinRequest, max_payload=0, timeout=1)
        head = pb.Contribution(tokens=1).SerializeToString()
        huge = struct.pack("<I", len(head)) + head + struct.pack("<Q", 2**60)
        with pytest.raises(WireError, match="payload"):
            await read_frame(_reader(huge), pb.Contribution, max_payload=1000, timeout=1)
        short = struct.pack("<I", len(head)) + head + struct.pack("<Q", 100) + b"x" * 10
        with pytest.raises(WireError, match="stream ended"):
            await read_frame(_reader(short), pb.Contribution, max_payload=1000, timeout=1)
        with pytest.raises(WireError, match="malformed|closed"):
            await read_frame(_reader(struct.pack("<I", 3) + b"\xff\xff\xff" + struct.pack("<Q", 0)), pb.JoinRequest, max_payload=0, timeout=1)

    asyncio.run(main())


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_download_rejects_lying_donor_and_uses_honest_one() -> None:
    """Fault matrix row 13: a poisoned state download fails the hash check; the joiner moves to another donor."""
    blob = torch.arange(50_000, dtype=torch.float32).numpy().tobytes()

    def verify(b: bytes) -> str:
        return hash_tensors({"blob": torch.frombuffer(bytearray(b), dtype=torch.uint8)})

    good_hash = verify(blob)
    nodes: list[SwarmNode] = []
    try:
        first = SwarmNode(NetworkConfig(run_id="t", host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
        first.start()
        nodes.append(first)
        for _ in range(2):
            n = SwarmNode(NetworkConfig(run_id="t", host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=tuple(first.visible_maddrs())))
            n.start()
            nodes.append(n)
        liar, honest, joiner = nodes
        for node, tamper in ((liar, lambda b: bytes(len(b))), (honest, None)):
            server = StateServer(node, "fp")
            node.call(server.register(), timeout=30)
            server.publish(ServedState(round=7, state_hash=good_hash, blob=blob))
            server.tamper = tamper
        kw = dict(round_number=7, state_hash=good_hash, total_bytes=len(blob), fingerprint="fp", verify=verify)
        got, bad = joiner.call(download_state(joiner, donors=[liar.peer_id, honest.peer_id], max_parallel=1, **kw), timeout=60)
        assert bytes(got) == blob and bad == [liar.peer_id]
        got, bad = joiner.call(download_state(joiner, donors=[liar.peer_id, honest.peer_id], **kw), timeout=60)
        assert bytes(got) == blob and bad == ["parallel-assembly", liar.peer_id]
        with pytest.raises(StateSyncError, match="no donor served verified state"):
            joiner.call(download_state(joiner, donors=[liar.peer_id], **kw), timeout=60)
        # a donor at another round is not trusted for this one
        with pytest.raises(StateSyncError):
            joiner.call(download_state(joiner, donors=[honest.peer_id], **{**kw, "round_number": 8}), timeout=60)
    finally:
        for node in nodes:
            node.shutdown()
        time.sleep(0.5)


def test_data_plane_accepts_only_offered_tokens_once() -> None:
    from protocol.data_plane import DataPlane, connect, hosts_from_maddrs

    assert hosts_from_maddrs(["/ip4/0.0.0.0/tcp/1", "/ip4/10.0.0.2/tcp/5/p2p/x", "/ip6/::1/tcp/3", "/ip4/10.0.0.2/udp/4"]) == ["10.0.0.2"]

    async def main() -> None:
        plane = DataPlane(bind_host="127.0.0.1", advertise_hosts=["127.0.0.1"])
        await plane.start()
        try:
            token, future = plane.expect()
            stranger = await connect(plane.addrs, "not-a-token")
            assert stranger is not None  # the TCP connect works, but the leader drops it
            await stranger.read_eof(timeout=5)
            assert not future.done()
            member = await connect(plane.addrs, token)
            assert member is not None
            leader_side = await asyncio.wait_for(future, 5)
            payload = bytes(range(256)) * 4096  # 1 MiB, crosses many recv calls
            await leader_side.send_frame(pb.RoundResult(round=7), payload, timeout=5)
            header, body = await member.recv_frame(pb.RoundResult, max_payload=len(payload), timeout=5)
            assert header.round == 7 and body == payload
            await leader_side.send_frame(pb.RoundResult(round=8), payload, timeout=5)
            with pytest.raises(WireError, match="cap is 100"):  # announced size checked before anything is read
                await member.recv_frame(pb.RoundResult, max_payload=100, timeout=5)
            replay = await connect(plane.addrs, token)  # a used token is worthless
            assert replay is not None
            await replay.read_eof(timeout=5)
            assert await connect(["127.0.0.1:1"], token, timeout=1) is None
            token2, future2 = plane.expect()
            silent = await connect(plane.addrs, token2)
            assert silent is not None
            quiet_leader = await asyncio.wait_for(future2, 5)
            with pytest.raises(WireError, match="deadline|timed out"):  # nobody sends: the read gives up in time
                await silent.recv_frame(pb.RoundResult, max_payload=0, timeout=0.3)
            for conn in (stranger, member, leader_side, replay, silent, quiet_leader):
                conn.close()
                conn.close()  # idempotent
        finally:
            await plane.close()

    asyncio.run(main())
