"""Chunk sessions of the state download: the donor's serving loop and the joiner's verified multi-donor fetch.

A joiner opens a session with each donor on the authenticated libp2p state protocol
(`swarmloco.protocol.chain.state_sync`): the donor answers with the leaf digests of the state it serves, its TCP
data-plane addresses and a one-time token. The joiner checks the leaves against the certified root before asking for
anything, then pulls chunks by index over direct TCP (the libp2p stream when TCP cannot connect), a few in flight per
donor, from a queue shared by all donors, so a fast donor takes more. Each chunk is received straight into its place
in the blob and checked there against its leaf; a chunk that fails is fetched again from another donor and its donor
dropped, and a donor that breaks or stalls hands its in-flight chunks back to the queue. Donors bound their sessions
(in total and per requester) and give each chunk one deadline; a refused joiner is told "busy" and tries another
donor, or later.
"""
from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from google.protobuf.message import Message

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.buffers import prefaulted_buffer
from swarmloco.protocol.base.hashing import DIGEST_BYTES, LEAF_BYTES, StateLayout, leaf_digest, remember_leaves
from swarmloco.protocol.base.records import PROTOCOL_VERSION
from swarmloco.protocol.base.text import bounded, short_id
from swarmloco.protocol.base.wire import WireError, close_writer, read_frame, write_frame
from swarmloco.protocol.chain.config import FetchConfig
from swarmloco.protocol.network.data_hello import signer_of
from swarmloco.protocol.network.data_plane import connect
from swarmloco.protocol.network.transport import Transport
from swarmloco.protocol.trust.certificates import Certificate

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
MAX_DATA_ADDRS = 4  # a donor's address list is not trusted: each unreachable one costs a connect timeout
# Joiner-side leaf checks and the copy into place run here, beside the socket threads, never on the event loop.
_VERIFY = ThreadPoolExecutor(max_workers=2, thread_name_prefix="swarmloco-verify")


class StateSyncError(RuntimeError):
    pass


class _Lied(StateSyncError):
    """The donor sent something its own manifest or the certified root contradicts."""


class _Busy(StateSyncError):
    pass


def state_handler(run_id: str) -> str:
    return f"swarmloco/{run_id}/state/v{PROTOCOL_VERSION}"


@dataclass(frozen=True)
class ServeLimits:
    """What one donor gives all joiners together, so that catching-up peers never starve its own round."""

    sessions: int = 4  # chunk sessions at once, all requesters together
    per_requester: int = 1  # sessions one peer may hold at once
    chunk_timeout_s: float = 20.0  # to send one whole chunk: a per-chunk deadline, not a per-read one
    idle_timeout_s: float = 10.0  # for the joiner's next request (or its TCP connection)
    session_timeout_s: float = 600.0
    # A requester whose session missed a chunk deadline gets no session for this long: a slow reader that simply
    # reconnects would otherwise win back its slot before any joiner waiting behind "busy" tries again.
    penalty_s: float = 60.0
    max_penalized: int = 4096  # requesters remembered as too slow (the oldest is forgotten first)

    def __post_init__(self) -> None:
        if not 1 <= self.per_requester <= self.sessions <= 1024:
            raise ValueError(f"need 1 <= per_requester ({self.per_requester}) <= sessions ({self.sessions}) <= 1024")
        for name in ("chunk_timeout_s", "idle_timeout_s", "session_timeout_s"):
            if not 0.05 <= getattr(self, name) <= 86400.0:
                raise ValueError(f"{name} must be in [0.05, 86400] s, got {getattr(self, name)}")
        if not 0.0 <= self.penalty_s <= 86400.0 or not 1 <= self.max_penalized <= 1 << 20:
            raise ValueError(f"penalty_s must be in [0, 86400] s (got {self.penalty_s}) and max_penalized in "
                             f"[1, {1 << 20}] (got {self.max_penalized})")


class TooSlow(WireError):
    """The joiner did not take a whole chunk within the chunk deadline."""


class Channel(Protocol):
    """Frame I/O of a session: a `DataConn` as it is, or the libp2p stream through `StreamChannel`."""

    async def send_frame(self, header: Message, payload: bytes | bytearray | memoryview = b"", *,
                         timeout: float) -> None: ...

    async def recv_frame(self, header_type: type[M], *, max_payload: int, timeout: float,
                         into: memoryview | None = None) -> tuple[M, bytearray | memoryview]: ...

    async def send_headers(self, headers: list[Message], *, timeout: float) -> None: ...

    def close(self) -> None: ...


class StreamChannel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send_frame(self, header: Message, payload: bytes | bytearray | memoryview = b"", *,
                         timeout: float) -> None:
        await write_frame(self.writer, header, payload, timeout=timeout)

    async def recv_frame(self, header_type: type[M], *, max_payload: int, timeout: float,
                         into: memoryview | None = None) -> tuple[M, bytearray | memoryview]:
        return await read_frame(self.reader, header_type, max_payload=max_payload, timeout=timeout, into=into)

    async def send_headers(self, headers: list[Message], *, timeout: float) -> None:
        for header in headers:
            await write_frame(self.writer, header, timeout=timeout)

    def close(self) -> None:
        close_writer(self.writer)


async def serve_chunks(channel: Channel, blob: memoryview, first: pb.StateChunkRequest | None, *,
                       limits: ServeLimits, on_chunk: ChunkCallback) -> int:
    """Answer chunk requests until the joiner hangs up, stalls, or the session's time is up; returns chunks sent."""
    leaves = -(-len(blob) // LEAF_BYTES)
    clock = asyncio.get_running_loop()  # the transport's clock (virtual on the in-memory one)
    deadline = clock.time() + limits.session_timeout_s
    sent, req = 0, first
    while True:
        if req is None:
            left = deadline - clock.time()
            if left <= 0:
                return sent
            try:
                req, _ = await channel.recv_frame(pb.StateChunkRequest, max_payload=0,
                                                  timeout=min(limits.idle_timeout_s, left))
            except WireError:  # the joiner is done (it closes), gone, or silent: either way the session ends
                return sent
        if req.index >= leaves:
            await channel.send_frame(pb.StateChunk(index=req.index, ok=False, message="no such chunk"),
                                     timeout=limits.chunk_timeout_s)
            return sent
        start = req.index * LEAF_BYTES
        view = await on_chunk(req.index, blob[start : start + LEAF_BYTES])
        began = clock.time()
        try:
            await channel.send_frame(pb.StateChunk(index=req.index, ok=True), view, timeout=limits.chunk_timeout_s)
        except WireError as exc:
            if clock.time() - began >= 0.9 * limits.chunk_timeout_s:  # not a hang-up: it read too slowly
                raise TooSlow(f"chunk {req.index} not taken within {limits.chunk_timeout_s:.3g}s") from exc
            raise
        sent, req = sent + 1, None


class ChunkCallback(Protocol):
    async def __call__(self, index: int, view: memoryview) -> memoryview: ...


class Transfer:
    """One verified download: the shared chunk queue, the assembled blob, and what each donor did.

    A donor serves only its current state, so a swarm that certifies a round between the joiner's choice of target
    and its request has moved every donor past that target. With `follow`, the first donor to answer may move the
    download on: its manifest carries the certificate of the state it now serves, and the download takes that state
    instead when its leaves hash to the certified hash and `follow` (the caller's fork choice) accepts the
    certificate. Without it, a peer whose re-sync takes longer than a round would chase the swarm's head forever."""

    def __init__(self, node: Transport, layout: StateLayout, *, round_number: int, state_hash: str,
                 fingerprint: str, ticket: bytes, cfg: FetchConfig,
                 follow: Callable[[Certificate], bool] | None = None) -> None:
        self.node, self.layout, self.cfg = node, layout, cfg
        self.round_number, self.state_hash = round_number, state_hash
        self.follow = follow
        self.followed: Certificate | None = None  # the certificate of the newer state taken instead (see above)
        self.fingerprint, self.ticket = fingerprint, ticket
        # Not zero-filled by us (a bytearray would be: one more pass over the whole state, on the loop, before the
        # first request), its pages faulted in on another core ahead of the chunks; every byte is written by a
        # verified chunk before the blob is returned.
        self.blob = memoryview(prefaulted_buffer(layout.total_bytes))
        self.leaves: tuple[bytes, ...] | None = None
        self.pending: deque[int] = deque(range(layout.leaves))
        self.missing = layout.leaves
        self.changed = asyncio.Event()
        self.bad: list[str] = []  # donors that failed or lied, in the order they did
        self.liars: set[str] = set()
        self.busy: list[str] = []
        self.chunks_from: dict[str, int] = {}
        self.depth = cfg.window  # chunks requested ahead per donor (see `run`)

    async def run(self, donors: Sequence[str]) -> memoryview:
        queue = list(dict.fromkeys(d for d in donors if d != self.node.peer_id))
        # Each donor's pipeline is at most its share of the chunks: a small state is still spread over the donors.
        self.depth = min(self.cfg.window, -(-self.layout.leaves // max(1, min(self.cfg.max_donors, len(queue)))))
        active: set[asyncio.Task[None]] = set()
        pause = self.cfg.busy_retry_s
        try:
            while self.missing > 0:
                while len(active) < self.cfg.max_donors and queue:
                    active.add(asyncio.ensure_future(self._donor(queue.pop(0))))
                if not active:
                    if not self.busy:
                        raise StateSyncError(f"no donor served verified state for round {self.round_number} "
                                             f"({len(self.bad)} failed, {len(self.chunks_from)} helped)")
                    # Only load stood in the way: ask the busy donors again, later (the caller's deadline bounds it).
                    await asyncio.sleep(pause * (0.5 + random.random()))
                    pause = min(pause * 2, 8.0)
                    queue, self.busy = self.busy, []
                    continue
                _, active = await asyncio.wait(active, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in active:
                task.cancel()
            if active:
                await asyncio.gather(*active, return_exceptions=True)
        assert self.leaves is not None
        remember_leaves(self.state_hash, self.leaves)  # we now serve this state without hashing it again
        return self.blob

    def _fail(self, donor: str, why: str, *, lied: bool = False) -> None:
        if lied:
            self.liars.add(donor)
        if donor in self.bad:
            return
        self.bad.append(donor)
        log = logger.warning if lied else logger.info
        log("state donor %s %s: %s", short_id(donor), "lied" if lied else "failed", why)

    async def _donor(self, donor: str) -> None:
        try:
            reader, writer = await self.node.open_stream(donor, state_handler(self.node.run_id),
                                                         timeout=self.cfg.control_timeout_s)
        except Exception as exc:  # e.g. p2pd cannot reach the donor
            self._fail(donor, f"unreachable: {exc!r}")
            return
        channel: Channel | None = None
        try:
            header = await self._manifest(StreamChannel(reader, writer))
            conn = None
            if header.data_addrs and header.data_token:
                conn = await connect(list(header.data_addrs)[:MAX_DATA_ADDRS], header.data_token,
                                     timeout=self.cfg.connect_timeout_s, identity=signer_of(self.node),
                                     receiver=donor, run_id=self.node.run_id)
            channel = conn if conn is not None else StreamChannel(reader, writer)
            await self._pump(donor, channel)
        except _Busy:
            self.busy.append(donor)
        except _Lied as exc:
            self._fail(donor, str(exc), lied=True)
        except (StateSyncError, WireError, OSError, TimeoutError) as exc:
            self._fail(donor, str(exc) or repr(exc))
        finally:
            if channel is not None:
                channel.close()
            close_writer(writer)

    async def _manifest(self, control: StreamChannel) -> pb.StateHeader:
        """Ask for a session; returns the donor's header once its leaves are proven against the certified root."""
        timeout = self.cfg.control_timeout_s
        request = pb.StateRequest(run_id=self.node.run_id, fingerprint=self.fingerprint, ticket=self.ticket,
                                  manifest=True)
        await control.send_frame(request, timeout=timeout)
        header, payload = await control.recv_frame(pb.StateHeader, max_payload=self.layout.leaves * DIGEST_BYTES,
                                                   timeout=timeout)
        if not header.ok:
            raise (_Busy if header.busy else StateSyncError)(f"donor refused: {bounded(header.message, 200)}")
        if header.total_bytes != self.layout.total_bytes or header.leaf_bytes != LEAF_BYTES:
            raise _Lied(f"donor's blob size {header.total_bytes} / leaf {header.leaf_bytes} do not fit the model")
        leaves = tuple(bytes(payload[i : i + DIGEST_BYTES]) for i in range(0, len(payload), DIGEST_BYTES))
        if header.round != self.round_number or header.state_hash != self.state_hash:
            self._move_on(header, leaves)
        if self.layout.root(leaves) != self.state_hash:
            raise _Lied("its leaf digests do not hash to the certified state hash")
        self.leaves = leaves  # any list that passed is the same list: the root commits to it
        return header

    def _move_on(self, header: pb.StateHeader, leaves: tuple[bytes, ...]) -> None:
        """Take the newer state this donor serves as the download's target, or raise StateSyncError. Only before
        any donor's manifest was taken (no chunk is in flight yet), and only a state whose certificate names the
        leaves the donor just committed to: a certificate anyone can copy moves nothing unless the donor can serve
        its state. `follow` comes last, so that once it accepts, the download takes that state."""
        moved = f"donor now serves round {header.round}, wanted {self.round_number}"
        if self.follow is None or self.leaves is not None or not header.certificate:
            raise StateSyncError(moved)
        try:
            cert = Certificate.from_bytes(bytes(header.certificate))
        except ValueError as exc:
            raise _Lied(f"{moved}, with a malformed certificate: {exc}") from None
        s = cert.statement
        if (s.round, s.new_hash) != (header.round, header.state_hash) or self.layout.root(leaves) != s.new_hash:
            raise _Lied(f"{moved}, but its certificate or its leaf digests are not of that state")
        if not self.follow(cert):
            raise StateSyncError(f"{moved}, a state we do not take instead")
        logger.info("state download moves on from round %d to round %d: the donors serve it now", self.round_number,
                    s.round)
        self.round_number, self.state_hash, self.followed = s.round, s.new_hash, cert

    async def _pump(self, donor: str, channel: Channel) -> None:
        """Pull chunks from the shared queue through this donor, `window` ahead, until nothing is missing."""
        loop = asyncio.get_running_loop()
        in_flight: deque[int] = deque()
        checks: set[asyncio.Future[bool]] = set()
        timeout = self.cfg.chunk_timeout_s
        try:
            while donor not in self.liars:
                asked = []
                while len(in_flight) < self.depth and self.pending:
                    asked.append(self.pending.popleft())
                    in_flight.append(asked[-1])
                if asked:  # the requests of a refill in one write
                    await channel.send_headers([pb.StateChunkRequest(index=i) for i in asked], timeout=timeout)
                if not in_flight:
                    if checks:
                        await asyncio.wait(checks, return_when=asyncio.FIRST_COMPLETED)
                    elif self.missing == 0:
                        return
                    else:  # others hold the rest in flight; wake when one hands chunks back, or all arrived
                        self.changed.clear()
                        await self.changed.wait()
                    continue
                index = in_flight[0]
                start, length = self.layout.chunk(index)
                # straight into its place in the blob (no copy): only this donor writes there until it is checked
                header, payload = await channel.recv_frame(pb.StateChunk, max_payload=LEAF_BYTES, timeout=timeout,
                                                           into=self.blob[start : start + length])
                if not header.ok or header.index != index or len(payload) != length:
                    raise _Lied(f"chunk {index}: got #{header.index}, {len(payload)} bytes, ok={header.ok}")
                in_flight.popleft()
                check = loop.run_in_executor(_VERIFY, self._check, index)
                check.add_done_callback(lambda f, i=index: self._checked(donor, i, f))
                checks.add(check)
                check.add_done_callback(checks.discard)
                if len(checks) >= self.depth:
                    await asyncio.wait(checks, return_when=asyncio.FIRST_COMPLETED)
            raise _Lied("served a chunk that does not match its leaf digest")
        finally:
            self.pending.extendleft(reversed(in_flight))  # whatever this donor still owed goes to the others
            if in_flight:
                self.changed.set()

    def _check(self, index: int) -> bool:
        """On a verify thread: whether the chunk received in place matches its leaf (the hash releases the GIL)."""
        assert self.leaves is not None
        start, length = self.layout.chunk(index)
        return leaf_digest(self.blob[start : start + length]) == self.leaves[index]

    def _checked(self, donor: str, index: int, check: asyncio.Future[bool]) -> None:
        ok = not check.cancelled() and check.exception() is None
        if ok and check.result():
            self.missing -= 1
            self.chunks_from[donor] = self.chunks_from.get(donor, 0) + 1
            if self.missing == 0:
                self.changed.set()
            return
        if ok:  # a wrong chunk: this donor is done; the chunk comes from another one
            self._fail(donor, f"chunk {index} does not match its leaf digest", lied=True)
        self.pending.appendleft(index)
        self.changed.set()
