"""Chunk-verified state transfer on the in-memory transport, bulk bytes over a real loopback data plane: lying
donors cost one chunk, a vanishing donor only its in-flight chunks, and a donor's sessions stay bounded under a
crowd of joiners (who are told "busy" and finish later or elsewhere)."""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
import torch

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.hashing import LEAF_BYTES, StateLayout, hash_tensors, state_layout
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.wire import close_writer, read_frame, write_frame
from swarmloco.protocol.chain.config import FetchConfig
from swarmloco.protocol.chain.state_sync import (
    ServedState,
    ServeLimits,
    StateServer,
    StateSyncError,
    download_latest,
    download_state,
    fetch_certificate,
    state_handler,
)
from swarmloco.protocol.network.data_plane import DataPlane, connect
from swarmloco.protocol.testing.fake import FakeNetwork, FakeTransport
from swarmloco.protocol.trust.certificates import Certificate, Statement

pytestmark = pytest.mark.timeout(60)
SHAPES = {"w": torch.Size([3 * LEAF_BYTES // 4 // 2 + 1000]), "b": torch.Size([77])}  # 3 leaves and a bit
NAMES = ["w", "b"]
FAST = FetchConfig(chunk_timeout_s=2.0, control_timeout_s=2.0, connect_timeout_s=1.0, busy_retry_s=0.05)


def _state(seed: int = 0) -> tuple[bytes, str, StateLayout]:
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    momentum = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    flat = torch.cat([params[n].reshape(-1) for n in NAMES] + [momentum[n].reshape(-1) for n in NAMES])
    entries = [(f"param/{n}", params[n]) for n in NAMES] + [(f"momentum/{n}", momentum[n]) for n in NAMES]
    return flat.numpy().tobytes(), hash_tensors(entries), state_layout(SHAPES, NAMES)


BLOB, ROOT, LAYOUT = _state()
OLDER_BLOB, OLDER_ROOT, _ = _state(1)  # another state of the same model: round 2, before BLOB's round 3


class _FlipBits(Hooks):
    """Serves the honest leaf list, but one flipped bit in every chunk: whichever chunk it serves first is bad."""

    def served_state(self, blob: bytes) -> bytes:
        bad = bytearray(blob)
        for start in range(0, len(bad), LEAF_BYTES):
            bad[start + 5] ^= 1
        return bytes(bad)


class _Server(StateServer):
    """A donor that can be slowed down, or vanish after sending some chunks."""

    delay_s = 0.0
    vanish_after: int | None = None
    sent = 0

    async def _on_chunk(self, index: int, view: memoryview) -> memoryview:
        if self.vanish_after is not None and self.sent >= self.vanish_after:
            raise ConnectionResetError("donor left")
        await asyncio.sleep(self.delay_s)
        self.sent += 1
        return view


@pytest.fixture(scope="module")
def net() -> Iterator[FakeNetwork]:
    # Donors serve over real TCP sockets (a DataPlane on 127.0.0.1), which move in real time: these transfers and
    # their deadlines run on the machine's clock, not the virtual one the round tests use.
    with FakeNetwork(virtual=False) as n:
        yield n


def _donor(net: FakeNetwork, *, hooks: Hooks | None = None, tcp: bool = True, leaves: tuple[bytes, ...] = (),
           limits: ServeLimits | None = None, cls: type[StateServer] = _Server) -> tuple[FakeTransport, StateServer]:
    t = net.peer()
    plane = None
    if tcp:
        plane = DataPlane(bind_host="127.0.0.1", advertise_hosts=["127.0.0.1"])
        net.call(plane.start(), timeout=5)
    server = cls(t, "fp", gate=_gate(t), credentials=t.credentials, data_plane=plane, hooks=hooks,
                 limits=limits, control_timeout_s=2)
    net.call(server.register(), timeout=5)
    server.publish(ServedState(round=3, state_hash=ROOT, blob=BLOB, leaves=leaves))
    return t, server


def _gate(t: FakeTransport):  # type: ignore[no-untyped-def]
    from swarmloco.protocol.trust.admission import Gate

    return Gate(t.run_id, None)


def _fetch(net: FakeNetwork, joiner: FakeTransport, donors: list[str], **kw: object) -> tuple[bytearray, list[str]]:
    args = dict(round_number=3, state_hash=ROOT, layout=LAYOUT, fingerprint="fp", config=FAST, timeout=20.0)
    return net.call(download_state(joiner, donors=donors, **{**args, **kw}), timeout=30)  # type: ignore[arg-type]


def test_tree_root_binds_layout_and_leaves() -> None:
    assert LAYOUT.leaves == 4 and LAYOUT.total_bytes == len(BLOB)
    assert ROOT != hash_tensors({"param/w": torch.zeros(3)})
    other = state_layout({"w": SHAPES["w"], "b": torch.Size([7, 11])}, NAMES)
    assert other.total_bytes == LAYOUT.total_bytes and other.digest != LAYOUT.digest


def test_download_over_tcp_and_over_the_stream(net: FakeNetwork) -> None:
    (a, sa), (b, sb) = _donor(net), _donor(net, tcp=False)
    got, bad = _fetch(net, net.peer(), [a.peer_id, b.peer_id])
    assert bytes(got) == BLOB and bad == []
    assert sa.stats.via_data_plane == 1 and sb.stats.via_data_plane == 0
    # a donor counts a session's chunks when the session ends, which can be just after the joiner has them all
    deadline = time.monotonic() + 5
    while sa.stats.chunks + sb.stats.chunks < LAYOUT.leaves and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sa.stats.chunks + sb.stats.chunks == LAYOUT.leaves


def test_lying_chunk_costs_one_chunk_and_the_liar_is_reported(net: FakeNetwork) -> None:
    (liar, sl), (honest, _) = _donor(net, hooks=_FlipBits()), _donor(net)
    got, bad = _fetch(net, net.peer(), [liar.peer_id, honest.peer_id], config=FetchConfig(window=1))
    assert bytes(got) == BLOB and bad == [liar.peer_id]
    assert sl.sent == 1  # window 1: its first chunk failed the leaf check, and it was asked for nothing more
    with pytest.raises(StateSyncError, match="no donor served verified state"):
        _fetch(net, net.peer(), [liar.peer_id])


def test_wrong_leaf_list_is_refused_before_any_chunk(net: FakeNetwork) -> None:
    fake = tuple(bytes(32) for _ in range(LAYOUT.leaves))
    (liar, sl), (honest, _) = _donor(net, leaves=fake), _donor(net)
    got, bad = _fetch(net, net.peer(), [liar.peer_id, honest.peer_id])
    assert bytes(got) == BLOB and bad == [liar.peer_id] and sl.sent == 0


def test_donor_leaving_mid_transfer_loses_only_its_chunks(net: FakeNetwork) -> None:
    (quitter, sq), (steady, ss) = _donor(net), _donor(net)
    sq.vanish_after, sq.delay_s, ss.delay_s = 1, 0.0, 0.05  # type: ignore[attr-defined]
    got, bad = _fetch(net, net.peer(), [quitter.peer_id, steady.peer_id])
    # The quitter is reported once the joiner notices it is gone; when the steady donor hands over the last chunk
    # first, the download ends before that (a race the result does not depend on).
    assert bytes(got) == BLOB and set(bad) <= {quitter.peer_id} and sq.sent == 1


def _certified(t: FakeTransport, new_hash: str = ROOT) -> Certificate:
    """A certificate of round 3 (parsed by the joiner, never verified here: `follow` is the caller's judgement)."""
    statement = Statement(run_id=t.run_id, round=3, prev_hash="a" * 64, new_hash=new_hash, members=(t.peer_id,),
                          weights=(5,), swarm=1, work=5)
    return Certificate(statement, {t.peer_id: Certificate.sign(t.credentials.identity, statement)})


def _fetch_latest(net: FakeNetwork, donors: list[str], follow: object) -> tuple[bytearray, list[str], object]:
    """Ask for round 2: every donor has moved on to round 3 since the target was chosen."""
    job = download_latest(net.peer(), donors=donors, round_number=2, state_hash="a" * 64, layout=LAYOUT,
                          follow=follow, fingerprint="fp", config=FAST, timeout=10.0)  # type: ignore[arg-type]
    return net.call(job, timeout=20)  # type: ignore[no-any-return]


def test_a_download_moves_on_to_the_certified_state_its_donors_moved_to(net: FakeNetwork) -> None:
    """A swarm that certifies a round between a joiner's choice of target and its request has moved every donor on.
    The donors' manifests carry their state's certificate; the joiner takes that state when its own judgement
    (`follow`) accepts the certificate, and refuses it otherwise, as before."""
    (a, sa), (b, sb) = _donor(net), _donor(net)
    cert = _certified(a)
    for server in (sa, sb):
        server.publish(ServedState(round=3, state_hash=ROOT, blob=BLOB, certificate=cert.to_bytes()))
    asked: list[Certificate] = []
    got, bad, followed = _fetch_latest(net, [a.peer_id, b.peer_id], lambda c: asked.append(c) or True)
    assert bytes(got) == BLOB and bad == [] and followed == cert and asked == [cert]  # asked once, by the first
    with pytest.raises(StateSyncError, match="no donor served"):
        _fetch_latest(net, [a.peer_id, b.peer_id], lambda c: False)
    with pytest.raises(StateSyncError, match="no donor served"):  # without `follow`: the target or nothing
        _fetch(net, net.peer(), [a.peer_id, b.peer_id], round_number=2, state_hash="a" * 64)


class _SlowManifest(_Server):
    async def _leaf_list(self, state: ServedState) -> tuple[bytes, ...]:
        await asyncio.sleep(0.3)
        return await super()._leaf_list(state)


def test_a_download_under_way_is_not_moved(net: FakeNetwork) -> None:
    """Once a donor's manifest of the target was taken, a later donor's newer state moves nothing: chunks of the
    target may be in flight, and that donor simply fails this download."""
    (steady, ss), (ahead, sa) = _donor(net), _donor(net, cls=_SlowManifest)
    ss.publish(ServedState(round=2, state_hash=OLDER_ROOT, blob=OLDER_BLOB))
    sa.publish(ServedState(round=3, state_hash=ROOT, blob=BLOB, certificate=_certified(ahead).to_bytes()))
    ss.delay_s = 0.5  # type: ignore[attr-defined]  # still sending when the second manifest arrives
    asked: list[Certificate] = []
    job = download_latest(net.peer(), donors=[steady.peer_id, ahead.peer_id], round_number=2, state_hash=OLDER_ROOT,
                          layout=LAYOUT, follow=lambda c: asked.append(c) or True, fingerprint="fp", config=FAST,
                          timeout=10.0)
    got, bad, followed = net.call(job, timeout=20)
    assert bytes(got) == OLDER_BLOB and followed is None and asked == [] and bad == [ahead.peer_id]


def test_a_certificate_the_donor_cannot_serve_moves_nothing(net: FakeNetwork) -> None:
    """A certificate is public: any donor can copy a newer one. One whose certified hash is not the root of the
    leaves the donor committed to (or that is not a certificate at all) is never offered to `follow`, so it cannot
    move a download to a state its donor does not serve. A download of the state they do serve is unaffected."""
    (liar, sl), (garbler, sg), (claimer, sc) = _donor(net), _donor(net), _donor(net)
    sl.publish(ServedState(round=3, state_hash=ROOT, blob=BLOB, certificate=_certified(liar, "c" * 64).to_bytes()))
    sg.publish(ServedState(round=3, state_hash=ROOT, blob=BLOB, certificate=b"{not json"))
    # names the certified state in its header too, but its leaves are those of another blob
    claimed = _certified(claimer, "c" * 64).to_bytes()
    sc.publish(ServedState(round=3, state_hash="c" * 64, blob=BLOB, certificate=claimed))
    asked: list[Certificate] = []
    with pytest.raises(StateSyncError, match=r"no donor served verified state for round 2 \(3 failed"):
        _fetch_latest(net, [liar.peer_id, garbler.peer_id, claimer.peer_id], lambda c: asked.append(c) or True)
    assert asked == []
    got, bad = _fetch(net, net.peer(), [liar.peer_id, garbler.peer_id])
    assert bytes(got) == BLOB and bad == []


def test_crowd_of_joiners_is_bounded_and_told_busy(net: FakeNetwork) -> None:
    limits = ServeLimits(sessions=3, chunk_timeout_s=1.0, idle_timeout_s=1.0)
    donor, server = _donor(net, limits=limits)
    server.delay_s = 0.01  # type: ignore[attr-defined]
    joiners = [net.peer() for _ in range(50)]

    async def crowd() -> list[object]:
        jobs = [download_state(j, donors=[donor.peer_id], round_number=3, state_hash=ROOT, layout=LAYOUT,
                               fingerprint="fp", config=FAST, timeout=15.0) for j in joiners]
        running = asyncio.gather(*jobs, return_exceptions=True)
        await asyncio.sleep(0.1)
        # the donor still answers other requests at once while the crowd downloads
        probe = time.monotonic()
        with pytest.raises(StateSyncError, match="without a certificate"):
            await fetch_certificate(joiners[0], donor.peer_id, fingerprint="fp", ticket=b"", timeout=2)
        probe = time.monotonic() - probe
        return [*(await running), probe]

    started = time.monotonic()
    *results, probe = net.call(crowd(), timeout=40)
    assert time.monotonic() - started < 20 and probe < 0.5  # type: ignore[operator]
    done = [r for r in results if isinstance(r, tuple)]
    assert all(bytes(r[0]) == BLOB for r in done)
    assert all(isinstance(r, tuple | StateSyncError) for r in results), results
    assert server.stats.peak_sessions <= 3 and server.stats.busy > 0


def test_one_session_per_requester_and_a_trickling_reader_is_cut_at_the_chunk_deadline(net: FakeNetwork) -> None:
    """A reader that drains 64 KiB every 0.1 s keeps every read alive; only a deadline per chunk ends it."""
    limits = ServeLimits(sessions=4, per_requester=1, chunk_timeout_s=0.5, idle_timeout_s=5.0, penalty_s=0.0)
    donor, server = _donor(net, limits=limits)
    joiner = net.peer()

    async def open_session() -> tuple[pb.StateHeader, asyncio.StreamWriter]:
        reader, writer = await joiner.open_stream(donor.peer_id, state_handler(joiner.run_id), timeout=2)
        await write_frame(writer, pb.StateRequest(run_id=joiner.run_id, fingerprint="fp", manifest=True), timeout=2)
        header, _ = await read_frame(reader, pb.StateHeader, max_payload=1 << 10, timeout=2)
        return header, writer

    def trickle(sock: socket.socket, stop: float) -> None:
        while time.monotonic() < stop:
            try:
                sock.settimeout(1.0)
                if not sock.recv(1 << 16):
                    return
            except OSError:
                return
            time.sleep(0.1)

    async def scenario() -> tuple[bool, bool, float, bool]:
        first, writer = await open_session()
        conn = await connect(list(first.data_addrs), first.data_token, timeout=2,
                             identity=joiner.credentials.identity, receiver=donor.peer_id, run_id=joiner.run_id)
        assert conn is not None
        second, w2 = await open_session()
        close_writer(w2)
        for i in range(LAYOUT.leaves):
            await conn.send_frame(pb.StateChunkRequest(index=i), timeout=2)
        started = time.monotonic()
        reading = asyncio.get_running_loop().run_in_executor(None, trickle, conn.sock, started + 8)
        while server._open and time.monotonic() - started < 8:
            await asyncio.sleep(0.05)
        cut = time.monotonic() - started
        conn.close()
        await reading
        third, w3 = await open_session()
        close_writer(w3)
        close_writer(writer)
        return first.ok, second.busy, cut, third.ok

    ok, busy, cut, again = net.call(scenario(), timeout=20)
    assert ok and busy and again and cut < 3.0, cut
