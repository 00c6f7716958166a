"""State download: donors serve the flattened global state; a joiner fetches it (from several donors in parallel
when it can), verifies it against the hash the swarm agreed on, and falls back donor by donor when a part is bad.

The served blob is θ then m, fp32, in the model's canonical parameter order (`protocol.hashing.pack_state`); the
protocol only moves bytes and calls the caller's `verify(blob) -> hash` before accepting anything.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from protocol import swarmloco_wire_pb2 as pb
from protocol.admission import Credentials, Gate
from protocol.certificates import Certificate
from protocol.hooks import Hooks
from protocol.records import PROTOCOL_VERSION
from protocol.transport import Transport
from protocol.wire import WireError, close_writer, read_frame, write_frame

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedState:
    round: int
    state_hash: str
    blob: bytes
    certificate: bytes = b""  # the commit certificate of this state (empty for θ_0)


class StateSyncError(RuntimeError):
    pass


class StateServer:
    """Serves this peer's current global state and its certificate to admitted peers, at most `max_concurrent`
    downloads at a time."""

    def __init__(self, node: Transport, fingerprint: str, *, gate: Gate, credentials: Credentials,
                 max_concurrent: int = 4, timeout_s: float = 120.0, control_timeout_s: float = 10.0,
                 hooks: Hooks | None = None) -> None:
        self.gate, self.credentials = gate, credentials
        self.node, self.fingerprint, self.timeout_s, self.control_timeout_s = (
            node,
            fingerprint,
            timeout_s,
            control_timeout_s,
        )
        self.handler_name = state_handler(node.run_id)
        self.state: ServedState | None = None
        self._slots = asyncio.Semaphore(max_concurrent)
        self.hooks = hooks or Hooks()

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
            if refusal:
                await write_frame(writer, pb.StateHeader(ok=False, message=refusal), timeout=control)
                return
            if req.certificate_only:
                header = pb.StateHeader(ok=True, round=state.round, state_hash=state.state_hash,
                                        total_bytes=len(state.blob), certificate=state.certificate,
                                        ticket=self.credentials.ticket)
                await write_frame(writer, header, timeout=control)
                return
            if self._slots.locked():
                await write_frame(writer, pb.StateHeader(ok=False, message="busy: too many downloads"), timeout=control)
                return
            async with self._slots:
                total = len(state.blob)
                start = min(req.offset, total)
                end = total if req.length == 0 else min(total, start + req.length)
                blob = self.hooks.served_state(state.blob)
                header = pb.StateHeader(
                    ok=True, round=state.round, state_hash=state.state_hash, total_bytes=total, offset=start
                )
                await write_frame(writer, header, memoryview(blob)[start:end], timeout=self.timeout_s)
                await asyncio.wait_for(
                    reader.read(1), self.timeout_s
                )  # wait for the client to close: all bytes arrived
        except (TimeoutError, WireError, ConnectionError) as exc:
            logger.debug("state download by a peer ended: %r", exc)
        finally:
            close_writer(writer)


def state_handler(run_id: str) -> str:
    return f"swarmloco/{run_id}/state/v{PROTOCOL_VERSION}"


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


async def _fetch(
    node: Transport,
    name: str,
    donor: str,
    fingerprint: str,
    offset: int,
    length: int,
    *,
    expect_round: int,
    expect_hash: str,
    total: int,
    timeout: float,
    control: float,
    ticket: bytes,
) -> bytearray:
    reader, writer = await node.open_stream(donor, name, timeout=control)
    try:
        await write_frame(
            writer,
            pb.StateRequest(run_id=node.run_id, fingerprint=fingerprint, offset=offset, length=length, ticket=ticket),
            timeout=control,
        )
        header, body = await read_frame(reader, pb.StateHeader, max_payload=total, timeout=timeout)
    finally:
        close_writer(writer)
    if not header.ok:
        raise StateSyncError(f"donor refused: {header.message}")
    if header.round != expect_round or header.state_hash != expect_hash:
        raise StateSyncError(f"donor now serves round {header.round}, wanted {expect_round}")
    if header.total_bytes != total or header.offset != offset or len(body) != (length or total - offset):
        raise StateSyncError("donor's byte range does not match the request")
    return body


async def download_state(
    node: Transport,
    *,
    donors: list[str],
    round_number: int,
    state_hash: str,
    total_bytes: int,
    fingerprint: str,
    verify: Callable[[bytes], str],
    max_parallel: int = 4,
    timeout: float = 300.0,
    control_timeout: float = 15.0,
    ticket: bytes = b"",
) -> tuple[bytearray, list[str]]:
    """Fetch and verify the state; returns (blob, failures: donors that failed or lied, plus "parallel-assembly" when
    the parallel download did not verify). Raises StateSyncError."""
    name = state_handler(node.run_id)
    bad: list[str] = []
    loop = asyncio.get_running_loop()
    kw = dict(
        expect_round=round_number, expect_hash=state_hash, total=total_bytes, timeout=timeout, control=control_timeout,
        ticket=ticket,
    )
    parallel = donors[:max_parallel]
    if len(parallel) > 1:
        bounds = [total_bytes * i // len(parallel) for i in range(len(parallel) + 1)]
        parts = await asyncio.gather(
            *(
                _fetch(node, name, d, fingerprint, bounds[i], bounds[i + 1] - bounds[i], **kw)
                for i, d in enumerate(parallel)
            ),
            return_exceptions=True,
        )
        if all(isinstance(p, bytearray) for p in parts):
            blob = bytearray().join(parts)  # type: ignore[arg-type]
            if await loop.run_in_executor(None, verify, bytes(blob)) == state_hash:
                return blob, bad
            logger.warning("state assembled from %d donors failed verification; retrying donor by donor", len(parallel))
            bad.append("parallel-assembly")
    for donor in donors:
        try:
            blob = await _fetch(node, name, donor, fingerprint, 0, 0, **kw)
        except (TimeoutError, StateSyncError, WireError, OSError) as exc:
            logger.info("donor %s failed: %s", donor[-8:], exc)
            bad.append(donor)
            continue
        except Exception as exc:  # noqa: BLE001 - e.g. p2pd cannot reach the donor
            logger.info("donor %s unreachable: %r", donor[-8:], exc)
            bad.append(donor)
            continue
        if await loop.run_in_executor(None, verify, bytes(blob)) == state_hash:
            return blob, bad
        logger.warning("donor %s served state that does not match hash %s…; rejected", donor[-8:], state_hash[:12])
        bad.append(donor)
    raise StateSyncError(f"no donor served verified state for round {round_number} ({len(donors)} tried)")
