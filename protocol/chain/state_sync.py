"""State download: donors serve the flattened global state in verified chunks; a joiner fetches it from several
donors in parallel and adopts nothing that does not hash, chunk by chunk, to the state hash the swarm certified.

The served blob is θ then m, fp32, in the model's parameter order (`swarmloco.protocol.base.hashing.pack_state`), and
the state hash is the root of a digest tree over its chunks. This module is the libp2p side: the admitted request, the
certificate, the donor's session bounds and the manifest (leaf digests, TCP data-plane offer);
`swarmloco.protocol.chain.state_transfer` moves and checks the chunks.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.hashing import LEAF_BYTES, StateLayout, known_leaves, leaf_digests
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.base.wire import WireError, close_writer, read_frame, write_frame
from swarmloco.protocol.chain.config import FetchConfig
from swarmloco.protocol.chain.state_transfer import (
    Channel,
    ServeLimits,
    StateSyncError,
    StreamChannel,
    TooSlow,
    Transfer,
    serve_chunks,
    state_handler,
)
from swarmloco.protocol.network.data_plane import DataConn, DataPlane
from swarmloco.protocol.network.transport import Transport
from swarmloco.protocol.trust.admission import Credentials, Gate
from swarmloco.protocol.trust.certificates import Certificate

__all__ = ["ServeLimits", "ServedState", "StateServer", "StateSyncError", "download_latest", "download_state",
           "fetch_certificate", "state_handler"]
logger = logging.getLogger(__name__)
# A manifest's header carries the served state's certificate up to this size (the frame header's cap is 64 KiB);
# a larger one is left out, and a joiner that asked for an older state then only learns that the donor moved on.
MANIFEST_CERT_BYTES = 48 * 1024


@dataclass(frozen=True)
class ServedState:
    round: int
    state_hash: str
    blob: bytes
    certificate: bytes = b""  # the commit certificate of this state (empty for θ_0)
    leaves: tuple[bytes, ...] = ()  # the blob's leaf digests when the publisher has them (else found or computed)


@dataclass
class ServeStats:
    """What the donor handed out, for its logs and for tests of its bounds."""

    sessions: int = 0
    peak_sessions: int = 0
    busy: int = 0
    penalized: int = 0  # sessions refused because the requester read too slowly before
    chunks: int = 0
    via_data_plane: int = 0


class StateServer:
    """Serves this peer's current global state and its certificate to admitted peers, in bounded chunk sessions."""

    def __init__(self, node: Transport, fingerprint: str, *, gate: Gate, credentials: Credentials,
                 max_concurrent: int | None = None, limits: ServeLimits | None = None,
                 data_plane: DataPlane | None = None, control_timeout_s: float = 10.0,
                 hooks: Hooks | None = None) -> None:
        self.gate, self.credentials, self.data_plane = gate, credentials, data_plane
        self.node, self.fingerprint, self.control_timeout_s = node, fingerprint, control_timeout_s
        limits = limits or ServeLimits()
        if max_concurrent is not None:
            limits = ServeLimits(**{**limits.__dict__, "sessions": max_concurrent})
        self.limits = limits
        self.handler_name = state_handler(node.run_id)
        self.state: ServedState | None = None
        self.hooks = hooks or Hooks()
        self.stats = ServeStats()
        self._open: dict[str, int] = {}  # requester -> sessions it holds now
        self._slow: OrderedDict[str, float] = OrderedDict()  # requester -> until when it gets no session
        self._leaves: tuple[ServedState, asyncio.Future[tuple[bytes, ...]]] | None = None

    async def register(self) -> None:
        await self.node.add_handler(self.handler_name, self._handle)

    def publish(self, state: ServedState) -> None:
        self.state = state  # a single reference swap: readers see the old or the new blob, never a mix

    async def _handle(self, caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        control = self.control_timeout_s
        try:
            req, _ = await read_frame(reader, pb.StateRequest, max_payload=0, timeout=control)
            state = self.state
            refusal = ""
            if req.run_id != self.node.run_id or req.fingerprint != self.fingerprint:
                refusal = "run id or model fingerprint differs"
            elif problem := self.gate.check(req.ticket, caller):
                refusal = f"not admitted: {problem}"
            elif state is None:
                refusal = "no state yet"
            elif not (req.certificate_only or req.manifest):
                refusal = "this donor serves verified chunk sessions only (ask for a manifest)"
            if refusal:
                await write_frame(writer, pb.StateHeader(ok=False, message=refusal), timeout=control)
                return
            assert state is not None
            if req.certificate_only:
                header = pb.StateHeader(ok=True, round=state.round, state_hash=state.state_hash,
                                        total_bytes=len(state.blob), certificate=state.certificate,
                                        ticket=self.credentials.ticket)
                await write_frame(writer, header, timeout=control)
                return
            await self._session(caller, state, reader, writer)
        except (TimeoutError, WireError, ConnectionError) as exc:
            logger.debug("state download by a peer ended: %r", exc)
        finally:
            close_writer(writer)

    def _penalized_for(self, caller: str) -> float:
        """Seconds `caller` must still wait after a session it let miss a chunk deadline (0: none)."""
        now = self.node.clock.monotonic()
        while self._slow and next(iter(self._slow.values())) <= now:  # oldest first: they also expire first
            self._slow.popitem(last=False)
        return max(0.0, self._slow.get(caller, now) - now)

    def _penalize(self, caller: str) -> None:
        self._slow.pop(caller, None)
        self._slow[caller] = self.node.clock.monotonic() + self.limits.penalty_s
        while len(self._slow) > self.limits.max_penalized:
            self._slow.popitem(last=False)

    async def _session(self, caller: str, state: ServedState, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        control, stats = self.control_timeout_s, self.stats
        held = self._open.get(caller, 0)
        if (wait := self._penalized_for(caller)) > 0:
            stats.penalized += 1
            await write_frame(writer, pb.StateHeader(ok=False, message=f"too slow on its last download from us: "
                                                     f"ask again in {wait:.0f}s"), timeout=control)
            return
        if sum(self._open.values()) >= self.limits.sessions or held >= self.limits.per_requester or \
                self.hooks.refuse_download():
            stats.busy += 1
            await write_frame(writer, pb.StateHeader(ok=False, busy=True, message="busy: too many downloads"),
                              timeout=control)
            return
        self._open[caller] = held + 1  # taken before the first await: the check and the claim are one step
        stats.sessions += 1
        stats.peak_sessions = max(stats.peak_sessions, sum(self._open.values()))
        token, conn = "", None
        channel: Channel | None = None
        try:
            leaves = await self._leaf_list(state)
            addrs: list[str] = []
            if self.data_plane is not None and (addrs := self._data_addrs()):
                token, conn = self.data_plane.expect(me=self.node.peer_id, run_id=self.node.run_id, sender=caller)
            # the certificate lets a joiner that asked for an older state take this one instead (Transfer)
            cert = state.certificate if len(state.certificate) <= MANIFEST_CERT_BYTES else b""
            header = pb.StateHeader(ok=True, round=state.round, state_hash=state.state_hash,
                                    total_bytes=len(state.blob), leaf_bytes=LEAF_BYTES, data_addrs=addrs,
                                    data_token=token, certificate=cert)
            await write_frame(writer, header, b"".join(leaves), timeout=control)
            channel, first = await self._channel(reader, writer, conn)
            blob = memoryview(self.hooks.served_state(state.blob)).cast("B")
            try:
                served = await serve_chunks(channel, blob, first, limits=self.limits, on_chunk=self._on_chunk)
                stats.chunks += served  # (not `+= await`: concurrent sessions would overwrite each other's counts)
            except TooSlow:
                if self.limits.penalty_s > 0:
                    self._penalize(caller)
                raise
        finally:
            if token and self.data_plane is not None:
                self.data_plane.forget(token)
            if channel is not None:
                channel.close()
            if conn is not None and conn.done() and not conn.cancelled() and conn.exception() is None:
                conn.result().close()
            self._open[caller] -= 1
            if not self._open[caller]:
                del self._open[caller]

    async def _channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       conn: asyncio.Future[DataConn] | None) -> tuple[Channel, pb.StateChunkRequest | None]:
        """The joiner's TCP connection if it makes one, else its first chunk request on the libp2p stream."""
        stream = StreamChannel(reader, writer)
        first = asyncio.ensure_future(stream.recv_frame(pb.StateChunkRequest, max_payload=0,
                                                        timeout=self.limits.idle_timeout_s))
        waits: set[asyncio.Future[object]] = {first, *([conn] if conn is not None else [])}  # type: ignore[list-item]
        try:
            done, _ = await asyncio.wait(waits, timeout=self.limits.idle_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            first.cancel()
            raise
        if conn is not None and conn in done and not conn.cancelled():
            first.cancel()
            self.stats.via_data_plane += 1
            return conn.result(), None
        if first in done:
            request, _ = first.result()  # WireError when the joiner hung up or broke the frame
            return stream, request
        first.cancel()
        raise WireError("the joiner neither connected nor asked for a chunk")

    def _data_addrs(self) -> list[str]:
        return self.data_plane.addrs if self.data_plane is not None else []

    async def _on_chunk(self, index: int, view: memoryview) -> memoryview:
        """Called before each chunk is sent; tests slow a donor down or make it vanish here."""
        return view

    async def _leaf_list(self, state: ServedState) -> tuple[bytes, ...]:
        """The leaves of the served state: as published, remembered from hashing it, or computed once off-loop."""
        if state.leaves:
            return state.leaves
        if (known := known_leaves(state.state_hash)) is not None:
            return known
        if self._leaves is None or self._leaves[0] is not state:
            future = asyncio.get_running_loop().run_in_executor(None, lambda: tuple(leaf_digests([state.blob])))
            self._leaves = (state, future)
        return await asyncio.shield(self._leaves[1])


async def fetch_certificate(node: Transport, donor: str, *, fingerprint: str, ticket: bytes,
                            timeout: float) -> Certificate:
    """The commit certificate of the state `donor` serves (parsed, not verified). Raises StateSyncError."""
    reader, writer = await node.open_stream(donor, state_handler(node.run_id), timeout=timeout)
    try:
        request = pb.StateRequest(run_id=node.run_id, fingerprint=fingerprint, ticket=ticket, certificate_only=True)
        await write_frame(writer, request, timeout=timeout)
        header, _ = await read_frame(reader, pb.StateHeader, max_payload=0, timeout=timeout)
    finally:
        close_writer(writer)
    if not header.ok:
        raise StateSyncError(f"donor refused: {header.message}")
    if not header.certificate:
        raise StateSyncError(f"donor serves round {header.round} without a certificate")
    try:
        return Certificate.from_bytes(header.certificate)
    except ValueError as exc:
        raise StateSyncError(f"malformed certificate: {exc}") from None


async def download_state(
    node: Transport,
    *,
    donors: Sequence[str],
    round_number: int,
    state_hash: str,
    layout: StateLayout,
    fingerprint: str,
    ticket: bytes = b"",
    config: FetchConfig | None = None,
    timeout: float = 300.0,
) -> tuple[memoryview, list[str]]:
    """Fetch the state from up to `config.max_donors` donors at once, every chunk verified against the leaves the
    certified root commits to; returns (blob: a writable byte view, failures: donors that failed or lied). Raises
    StateSyncError, also when `timeout` passes."""
    blob, bad, _ = await download_latest(node, donors=donors, round_number=round_number, state_hash=state_hash,
                                         layout=layout, follow=None, fingerprint=fingerprint, ticket=ticket,
                                         config=config, timeout=timeout)
    return blob, bad


async def download_latest(
    node: Transport,
    *,
    donors: Sequence[str],
    round_number: int,
    state_hash: str,
    layout: StateLayout,
    follow: Callable[[Certificate], bool] | None,
    fingerprint: str,
    ticket: bytes = b"",
    config: FetchConfig | None = None,
    timeout: float = 300.0,
) -> tuple[memoryview, list[str], Certificate | None]:
    """`download_state`, but a donor that has moved on since the target was chosen may move the download to the
    certified state it now serves, when `follow` accepts that state's certificate (None: never). Returns (blob,
    failures, the certificate of the state downloaded instead, or None when it is the one asked for)."""
    transfer = Transfer(node, layout, round_number=round_number, state_hash=state_hash, fingerprint=fingerprint,
                        ticket=ticket, cfg=config or FetchConfig(), follow=follow)
    try:
        blob = await asyncio.wait_for(transfer.run(donors), timeout)
    except TimeoutError:
        raise StateSyncError(f"state download of round {transfer.round_number} timed out after {timeout:.0f}s "
                             f"(failures: {[short_id(d) for d in transfer.bad]})") from None
    return blob, transfer.bad, transfer.followed
