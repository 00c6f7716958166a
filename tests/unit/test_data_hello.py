"""The signed hello of the TCP data plane: a token read off the plaintext path is not enough to connect, nor is a
replayed, re-addressed or stale hello; the honest, signed one is accepted, once."""
from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from _loops import run_loop as _run

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.wire import frame_prefix
from swarmloco.protocol.network.data_hello import HandshakeLimits, hello_body, hello_problem, signed_hello
from swarmloco.protocol.network.data_plane import DataConn, DataPlane, connect
from swarmloco.protocol.trust.identity import Identity

pytestmark = pytest.mark.timeout(60)

RUN = "run-hello"


def _identity() -> Identity:
    return Identity(path=Path("<memory>"), private_key=Identity.generate())


HONEST, MITM, LISTENER = _identity(), _identity(), _identity()


def _hello(identity: Identity | None = HONEST, **kw: object) -> pb.DataHello:
    args: dict[str, object] = dict(token="t", receiver=LISTENER.peer_id, run_id=RUN, round_number=5)
    return signed_hello(identity, **{**args, **kw})  # type: ignore[arg-type]


def _problem(hello: pb.DataHello, **kw: object) -> str:
    return hello_problem(hello, **{"me": LISTENER.peer_id, "run_id": RUN, "freshness_s": 60.0, **kw})  # type: ignore


def test_hello_checks_on_plain_data() -> None:
    assert _problem(_hello()) == ""
    assert _problem(_hello(sender=HONEST.peer_id, identity=None)) == "unsigned hello"
    forged = _hello(MITM)
    forged.sender = HONEST.peer_id  # a stranger claims the honest member's id, signing with its own key
    assert _problem(forged) == "signature is not the sender's"
    changed = _hello()
    changed.round = 6  # every field is under the signature
    assert _problem(changed) == "signature is not the sender's"
    assert "another peer" in _problem(_hello(receiver=MITM.peer_id))
    assert "another run" in _problem(_hello(run_id="other"))
    assert "expected" in _problem(_hello(MITM), sender=HONEST.peer_id)
    assert "away from our clock" in _problem(_hello(), now=time.time() + 120)
    assert _problem(_hello(), now=time.time() + 30) == ""  # skew inside the window is fine
    with pytest.raises(ValueError, match="per_source"):
        HandshakeLimits(pending=4, per_source=8)
    with pytest.raises(ValueError, match="deadline_s"):
        HandshakeLimits(deadline_s=0)


async def _raw(plane: DataPlane, hello: pb.DataHello | bytes) -> socket.socket:
    """A connection that sends exactly these hello bytes (what someone on the path can copy)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    host, _, port = plane.addrs[0].rpartition(":")
    await loop.sock_connect(sock, (host, int(port)))
    raw = hello if isinstance(hello, bytes) else frame_prefix(hello, 0)
    await loop.sock_sendall(sock, raw)
    return sock


async def _closed_by_listener(sock: socket.socket, *, timeout: float = 3.0) -> bool:
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.get_running_loop().sock_recv(sock, 1) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def test_listener_takes_only_signed_fresh_hellos_addressed_to_it_once() -> None:
    async def main() -> None:
        plane = DataPlane(bind_host="127.0.0.1", advertise_hosts=["127.0.0.1"])
        await plane.start()
        got: list[tuple[DataConn, pb.DataHello]] = []
        plane.listen("round-token", lambda conn, hello: got.append((conn, hello)), me=LISTENER.peer_id, run_id=RUN)
        try:
            bad = [
                _hello(None, token="round-token", sender=HONEST.peer_id),  # the old, token-only hello
                _hello(MITM, token="round-token"),  # the token, read off the path, with the reader's own key
                _hello(token="round-token", receiver=MITM.peer_id),  # signed, but for another listener
                _hello(token="round-token", run_id="other-run"),
            ]
            forged = _hello(MITM, token="round-token")
            forged.sender = HONEST.peer_id
            stale = _hello(token="round-token")
            stale.time_ms -= 3_600_000
            stale.signature = HONEST.sign(hello_body(stale))
            for hello in [bad[0], *bad[2:], forged, stale]:
                assert await _closed_by_listener(await _raw(plane, hello)), hello
            stranger = await _raw(plane, bad[1])  # a validly signed hello: handed on, but as the stranger's own
            await _eventually(lambda: len(got) == 1)
            assert got[0][1].sender == MITM.peer_id  # so the inbox, which knows the plan's members, drops it
            got.pop()[0].close()
            stranger.close()
            honest = frame_prefix(_hello(token="round-token"), 0)
            first = await _raw(plane, honest)
            await _eventually(lambda: len(got) == 1)
            replayed = await _raw(plane, honest)  # the same bytes again, as someone on the path would send them
            assert await _closed_by_listener(replayed)
            assert [h.sender for _, h in got] == [HONEST.peer_id]
            first.close()
            for conn, _ in got:
                conn.close()
        finally:
            await plane.close()

    _run(main())


def test_one_time_token_takes_only_its_expected_signer() -> None:
    async def main() -> None:
        plane = DataPlane(bind_host="127.0.0.1", advertise_hosts=["127.0.0.1"])
        await plane.start()
        try:
            token, future = plane.expect(me=LISTENER.peer_id, run_id=RUN, sender=HONEST.peer_id)
            kw = dict(receiver=LISTENER.peer_id, run_id=RUN, timeout=2.0)
            stranger = await connect(plane.addrs, token, identity=MITM, **kw)  # type: ignore[arg-type]
            unsigned = await connect(plane.addrs, token, sender=HONEST.peer_id, **kw)  # type: ignore[arg-type]
            for conn in (stranger, unsigned):
                assert conn is not None
                await conn.read_eof(timeout=3)  # the listener hung up on it
                conn.close()
            assert not future.done()
            member = await connect(plane.addrs, token, identity=HONEST, **kw)  # type: ignore[arg-type]
            assert member is not None
            mine = await asyncio.wait_for(future, 3)
            await member.send_frame(pb.ShardBye(round=9), b"x" * 1024, timeout=2)
            header, payload = await mine.recv_frame(pb.ShardBye, max_payload=1024, timeout=2)
            assert header.round == 9 and payload == b"x" * 1024
            assert plane.refused == 2
            member.close()
            mine.close()
        finally:
            await plane.close()

    _run(main())


async def _eventually(check: object, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
