"""Untrusted input at the edges: DHT record validation, compatibility messages, frame caps, data-plane tokens."""
from __future__ import annotations

import asyncio
import struct

import pytest
from _records import rec

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.records import PROTOCOL_VERSION, PeerRecord
from swarmloco.protocol.base.wire import WireError, read_frame
from swarmloco.protocol.round.rules import compatibility_problem


@pytest.mark.parametrize(
    "bad",
    [
        {"round": "3"},
        {"round": -1},
        {"round": 2**50},
        {"ready": 1},
        {"view": True},
        {"eta": float("nan")},
        {"state_hash": "abc"},
        {"config_json": "x" * 5000},
        {"extra": 1},
    ],
)
def test_record_schema_abuse_is_dropped(bad: dict[str, object]) -> None:
    value = rec().to_value()
    value.update(bad)
    assert PeerRecord.parse(value) is None
    assert PeerRecord.parse(rec().to_value()) == rec()
    assert PeerRecord.parse("not a dict") is None and PeerRecord.parse(None) is None


def test_compatibility_messages_name_the_difference() -> None:
    ours = {"d_model": 320}
    assert compatibility_problem({}, fingerprint="x", config=ours) is None
    msg = compatibility_problem({"a": rec()}, fingerprint="other", config=ours)
    assert msg is not None and "d_model: ours 320 vs theirs 128" in msg
    msg = compatibility_problem({"a": rec(version=PROTOCOL_VERSION + 1)}, fingerprint="fp", config=ours)
    assert msg is not None and f"protocol version {PROTOCOL_VERSION + 1}" in msg
    assert compatibility_problem({"a": rec(), "b": rec(fingerprint="other")}, fingerprint="fp", config=ours) is None


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_frames_over_the_caps_are_refused_before_allocation() -> None:
    async def main() -> None:
        with pytest.raises(WireError, match="header"):
            await read_frame(_reader(struct.pack("<I", 10**9)), pb.JoinRequest, max_payload=0, timeout=1)
        head = pb.ContributionClaim(tokens=1).SerializeToString()
        huge = struct.pack("<I", len(head)) + head + struct.pack("<Q", 2**60)
        with pytest.raises(WireError, match="payload"):
            await read_frame(_reader(huge), pb.ContributionClaim, max_payload=1000, timeout=1)
        short = struct.pack("<I", len(head)) + head + struct.pack("<Q", 100) + b"x" * 10
        with pytest.raises(WireError, match="stream ended"):
            await read_frame(_reader(short), pb.ContributionClaim, max_payload=1000, timeout=1)
        with pytest.raises(WireError, match="malformed|closed"):
            await read_frame(
                _reader(struct.pack("<I", 3) + b"\xff\xff\xff" + struct.pack("<Q", 0)),
                pb.JoinRequest,
                max_payload=0,
                timeout=1,
            )

    asyncio.run(main())


def test_data_plane_accepts_only_offered_tokens_once() -> None:
    from pathlib import Path

    from swarmloco.protocol.network.data_plane import DataPlane, connect, hosts_from_maddrs
    from swarmloco.protocol.trust.identity import Identity

    me = Identity(path=Path("<memory>"), private_key=Identity.generate())

    assert hosts_from_maddrs(
        ["/ip4/0.0.0.0/tcp/1", "/ip4/10.0.0.2/tcp/5/p2p/x", "/ip6/::1/tcp/3", "/ip4/10.0.0.2/udp/4"]
    ) == ["10.0.0.2"]

    async def main() -> None:
        plane = DataPlane(bind_host="127.0.0.1", advertise_hosts=["127.0.0.1"])
        await plane.start()
        try:
            token, future = plane.expect()
            stranger = await connect(plane.addrs, "not-a-token", identity=me)
            assert stranger is not None  # the TCP connect works, but the leader drops it
            await stranger.read_eof(timeout=5)
            assert not future.done()
            member = await connect(plane.addrs, token, identity=me)
            assert member is not None
            leader_side = await asyncio.wait_for(future, 5)
            payload = bytes(range(256)) * 4096  # 1 MiB, crosses many recv calls
            await leader_side.send_frame(pb.ShardResult(round=7), payload, timeout=5)
            header, body = await member.recv_frame(pb.ShardResult, max_payload=len(payload), timeout=5)
            assert header.round == 7 and body == payload
            await leader_side.send_frame(pb.ShardResult(round=8), payload, timeout=5)
            with pytest.raises(WireError, match="cap is 100"):  # announced size checked before anything is read
                await member.recv_frame(pb.ShardResult, max_payload=100, timeout=5)
            replay = await connect(plane.addrs, token, identity=me)  # a used token is worthless
            assert replay is not None
            await replay.read_eof(timeout=5)
            assert await connect(["127.0.0.1:1"], token, timeout=1) is None
            token2, future2 = plane.expect()
            silent = await connect(plane.addrs, token2, identity=me)
            assert silent is not None
            quiet_leader = await asyncio.wait_for(future2, 5)
            with pytest.raises(WireError, match="deadline|timed out"):  # nobody sends: the read gives up in time
                await silent.recv_frame(pb.ShardResult, max_payload=0, timeout=0.3)
            for conn in (stranger, member, leader_side, replay, silent, quiet_leader):
                conn.close()
                conn.close()  # idempotent
        finally:
            await plane.close()

    asyncio.run(main())
