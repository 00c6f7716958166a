"""Protocol units: DHT record validation, target choice, refusals, framing caps, verified multi-donor download."""
from __future__ import annotations

import asyncio
import struct
import time
from types import SimpleNamespace

import pytest
import torch

from protocol import swarmloco_wire_pb2 as pb
from protocol.group import GroupAverager, LocalModel, RoundConfig, choose_target
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
            assert await asyncio.wait_for(stranger[0].read(1), 5) == b""
            assert not future.done()
            member = await connect(plane.addrs, token)
            assert member is not None
            reader, writer = await asyncio.wait_for(future, 5)
            writer.write(b"ok")
            await writer.drain()
            assert await member[0].readexactly(2) == b"ok"
            replay = await connect(plane.addrs, token)  # a used token is worthless
            assert replay is not None and await asyncio.wait_for(replay[0].read(1), 5) == b""
            assert await connect(["127.0.0.1:1"], token, timeout=1) is None
        finally:
            await plane.close()

    asyncio.run(main())
