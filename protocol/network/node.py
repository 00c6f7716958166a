"""The real transport: hivemind's DHT (on our own loop by default, or in hivemind's forked process), its p2pd
daemon, a P2P replica, and an asyncio loop on a background thread that serves our stream protocols while the training
thread keeps the accelerator busy.

The training thread talks to the loop only through `submit` / `call` (thread-safe futures with timeouts) and
`update_record`; see `swarmloco.protocol.network.transport.Transport` for the interface the round code relies on.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import hivemind
import uvloop
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from swarmloco.protocol.base.clock import SYSTEM, Clock
from swarmloco.protocol.base.records import PeerRecord, checkpoint_key, peers_key, revocations_key
from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.network.config import NetworkConfig
from swarmloco.protocol.network.data_plane import hosts_from_maddrs
from swarmloco.protocol.network.dht_host import LocalDHT
from swarmloco.protocol.network.transport import Stream, StreamHandler, run_on
from swarmloco.protocol.trust.admission import Credentials, Gate, Ticket
from swarmloco.protocol.trust.signed_records import RecordError, RunValidator, open_record, seal

logger = logging.getLogger(__name__)
T = TypeVar("T")


MAX_VERIFIED = 4096
REVOCATIONS_EVERY_S = 15.0  # how often the authority's revocation list and checkpoint are re-read from the DHT


class SwarmNode:
    """Owns the DHT, the P2P replica and the loop thread; publishes this peer's signed record on a heartbeat and
    reads others' records, trusting only those signed by their own peer with a valid ticket (`gate`)."""

    def __init__(self, net: NetworkConfig, *, credentials: Credentials, gate: Gate) -> None:
        self.net, self.credentials, self.gate = net, credentials, gate
        self.store_failures = 0  # record stores the DHT refused or that failed, in a row
        self._verified: dict[tuple[str, str], tuple[PeerRecord, float]] = {}  # (peer, signature) -> checked record
        self.dht: hivemind.DHT | LocalDHT | None = None
        self.p2p: P2P | None = None
        self.loop = uvloop.new_event_loop()  # roughly twice asyncio's stream throughput for the bulk tensors
        self.clock: Clock = SYSTEM
        # behind NAT (client mode, or looking for relays): dialled by nobody, so it dials its pipes and never leads
        self.reachable = not (net.client_mode or net.use_auto_relay)
        self._thread = threading.Thread(target=self._run_loop, name="swarm-loop", daemon=True)
        self._record: PeerRecord | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._handlers: list[str] = []
        self._closing = threading.Event()  # set by shutdown: DHT calls in flight stop waiting for their answers

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def start(self, *, timeout: float = 120.0) -> None:
        kwargs: dict[str, Any] = dict(
            initial_peers=list(self.net.initial_peers),
            host_maddrs=list(self.net.host_maddrs),
            client_mode=self.net.client_mode,
            use_relay=self.net.use_relay,
            use_auto_relay=self.net.use_auto_relay,
            record_validators=[RunValidator(self.net.run_id, self.gate.authority)],
            wait_timeout=self.net.dht_timeout_s,
            start=True,
        )
        if self.net.announce_maddrs:
            kwargs["announce_maddrs"] = list(self.net.announce_maddrs)
        if self.net.identity:
            # The identity file is ours (Ed25519, libp2p format); hivemind's own "is it taken" probe only reads RSA.
            kwargs.update(identity_path=self.net.identity, check_if_identity_free=False)
        if self.net.dht_process:
            self.dht = hivemind.DHT(**kwargs)  # forked before our loop thread exists
            self._thread.start()
        else:
            self._thread.start()
            del kwargs["start"]
            self.dht = self.call(LocalDHT.create(**kwargs), timeout=timeout)
        if self.dht.peer_id.to_base58() != self.credentials.peer_id:
            raise RuntimeError("the DHT runs under another identity than the one this peer signs with")
        self.p2p = self.call(self.dht.replicate_p2p(), timeout=timeout)
        self._heartbeat = self.call(self._start_heartbeat(), timeout=timeout)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _start_heartbeat(self) -> asyncio.Task[None]:
        return asyncio.create_task(self._heartbeat_loop())

    def shutdown(self, *, timeout: float = 15.0) -> None:
        self._closing.set()
        if self._thread.is_alive():
            try:
                self.call(self._async_shutdown(), timeout=timeout)
            except (concurrent.futures.TimeoutError, RuntimeError) as exc:
                logger.warning("swarm loop did not stop cleanly: %r", exc)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if self.dht is not None:
            self.dht.shutdown()  # stops the DHT (process, or node if the loop did not) and its p2pd daemon
            self.dht = None

    async def _async_shutdown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.p2p is not None:
            for name in self._handlers:
                try:
                    await asyncio.wait_for(self.p2p.remove_binary_stream_handler(name), 5)
                except Exception as exc:  # best effort while shutting down
                    logger.debug("removing handler %s: %r", name, exc)
            await self.p2p.shutdown()
        if isinstance(self.dht, LocalDHT):
            await self.dht.aclose()  # before the tasks below are cancelled: the node's own tasks are among them
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()

    # --- bridging the training thread and the loop ----------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], *, timeout: float) -> T:
        return run_on(self.loop, coro, timeout=timeout)

    # --- identity, addresses, handlers ----------------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        assert self.dht is not None
        return self.dht.peer_id.to_base58()

    @property
    def run_id(self) -> str:
        return self.net.run_id

    def visible_maddrs(self) -> list[str]:
        assert self.dht is not None
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def data_plane_hosts(self) -> tuple[str, list[str]] | None:
        if not self.net.data_plane:
            return None
        listen = hosts_from_maddrs(list(self.net.host_maddrs))
        advertise = hosts_from_maddrs(list(self.net.announce_maddrs) or self.visible_maddrs())
        if not advertise:
            return None
        return (listen[0] if len(listen) == 1 else "0.0.0.0"), advertise

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        assert self.p2p is not None

        async def serve(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await handler(info.peer_id.to_base58(), reader, writer)

        await self.p2p.add_binary_stream_handler(name, serve)
        self._handlers.append(name)

    async def open_stream(self, peer_id: str, name: str, *, timeout: float) -> Stream:
        assert self.p2p is not None
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name), timeout
        )
        return reader, writer

    # --- the peer record: written on the loop thread only -----------------------------------------------------------
    def update_record(self, **changes: Any) -> None:
        """Change fields of this peer's record (every field, the first time) and publish it now; thread-safe.
        The change is applied on the loop thread, in call order, so concurrent updates never undo each other."""
        if self._on_loop():
            self._apply_record(changes)
        else:
            self.loop.call_soon_threadsafe(self._apply_record, changes)

    def own_record(self) -> PeerRecord | None:
        return self._record

    def _on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def _apply_record(self, changes: dict[str, Any]) -> None:
        changes = {**changes, "reachable": self.reachable}
        record = replace(self._record, **changes) if self._record is not None else PeerRecord(**changes)
        if record == self._record:
            return  # nothing new to tell (a leader re-states its member count on every poll); the heartbeat refreshes
        self._record = record
        self.loop.create_task(self._publish())

    async def _publish(self) -> None:
        record, dht = self._record, self.dht
        if record is None or dht is None:
            return
        expiration = get_dht_time() + self.net.record_ttl_s
        value = seal(self.credentials.identity, self.net.run_id, record, self.credentials.ticket.decode(), expiration)
        try:
            stored = await self._dht_call(lambda: dht.store(
                peers_key(self.net.run_id), value, expiration, subkey=self.peer_id, return_future=True),
                self.net.record_ttl_s)
        except Exception as exc:  # the DHT may be briefly unreachable; the heartbeat retries
            stored = False
            logger.debug("storing our DHT record: %r", exc)
        if stored:
            if self.store_failures:
                logger.info("our DHT record is stored again after %d failed attempt(s)", self.store_failures)
            self.store_failures = 0
            return
        self.store_failures += 1
        if self.store_failures in (3, 10) or self.store_failures % 100 == 0:
            # Others stop seeing us once the last stored copy expires: say so instead of failing silently.
            logger.warning("the DHT refused or lost our record %d time(s) in a row; retrying every %.1fs",
                           self.store_failures, self.net.heartbeat_s)

    async def _dht_call(self, start: Any, timeout: float) -> Any:
        """The result of `start()`, a DHT call that returns a future, waited for on an executor thread for at most
        `timeout` s. The thread looks every quarter second whether the node is shutting down: a call the stopped DHT
        will never answer must not hold the process for its whole timeout, since the interpreter joins executor
        threads at exit."""
        def wait() -> Any:
            future, deadline = start(), time.monotonic() + timeout
            while True:
                try:
                    return future.result(timeout=max(0.0, min(0.25, deadline - time.monotonic())))
                except concurrent.futures.TimeoutError:
                    if self._closing.is_set() or time.monotonic() >= deadline:
                        raise

        return await asyncio.get_running_loop().run_in_executor(None, wait)

    async def _heartbeat_loop(self) -> None:
        last_revocations = -REVOCATIONS_EVERY_S
        while True:
            await self._publish()
            if self.gate.authority is not None and time.monotonic() - last_revocations >= REVOCATIONS_EVERY_S:
                last_revocations = time.monotonic()
                await self._read_revocations()
            await asyncio.sleep(self.net.heartbeat_s)

    async def _read_revocations(self) -> None:
        """The authority's newest revocation list and checkpoint, from the DHT (each under the authority's subkey)."""
        if self.dht is None or self.gate.authority is None:
            return
        value = await self._authority_value(revocations_key(self.net.run_id), "revocations")
        if value is not None and self.gate.update_revocations(value):
            logger.info("the run's authority revoked %d peer(s) (list %d)", len(self.gate.revoked), self.gate.serial)
            if self.peer_id in self.gate.revoked:
                logger.error("this peer is revoked by the run's authority: other peers refuse it")
        value = await self._authority_value(checkpoint_key(self.net.run_id), "the checkpoint")
        if value is not None and self.gate.update_checkpoint(value):
            cp = self.gate.checkpoint
            assert cp is not None
            logger.info("the run's authority checkpointed round %d %s… (%d seniors)", cp.round, cp.state_hash[:12],
                        len(cp.seniors))

    async def _authority_value(self, key: str, what: str) -> Any:
        """The value the run's authority stored under `key` (its own subkey), or None; the caller verifies it."""
        dht, authority = self.dht, self.gate.authority
        try:
            found = await self._dht_call(lambda: dht.get(key, latest=True, return_future=True), 10.0)
        except Exception as exc:  # looked up again on the next heartbeat
            logger.debug("reading %s: %r", what, exc)
            return None
        item = found.value.get(authority) if found is not None and isinstance(found.value, dict) else None
        return getattr(item, "value", None) if item is not None else None

    async def fetch_records(self, *, timeout: float) -> dict[str, PeerRecord]:
        """Every other admitted peer's live record of this run, signed by that peer (anything else is dropped)."""
        dht = self.dht
        assert dht is not None
        found = await asyncio.wait_for(
            self._dht_call(lambda: dht.get(peers_key(self.net.run_id), latest=True, return_future=True), timeout),
            timeout + 1,
        )
        records: dict[str, PeerRecord] = {}
        if found is None or not isinstance(found.value, dict):
            return records
        now = time.time()
        for subkey, item in found.value.items():
            if not isinstance(subkey, str) or subkey == self.peer_id:
                continue
            value = getattr(item, "value", None)
            sig = value.get("sig") if isinstance(value, dict) else None
            known = self._verified.get((subkey, sig)) if isinstance(sig, str) else None
            if known is not None and known[1] > now and subkey not in self.gate.revoked:
                records[subkey] = known[0]  # the same signed bytes as last time: already checked
                continue
            try:
                record = open_record(value, run_id=self.net.run_id, subkey=subkey, gate=self.gate,
                                     expiration=getattr(item, "expiration_time", None))
            except RecordError as exc:
                logger.debug("ignoring the record under …%s: %s", short_id(subkey), exc)
                continue
            records[subkey] = record
            self._remember_verified(subkey, value, record)
        return records

    def _remember_verified(self, subkey: str, value: dict[str, Any], record: PeerRecord) -> None:
        """Cache a checked record by its signature until its ticket expires (a record is re-read every poll)."""
        valid_until = float(value["expires"])
        if self.gate.authority is not None:
            try:
                valid_until = min(valid_until, Ticket.from_bytes(value["ticket"]).expires_at)
            except ValueError:
                return
        if len(self._verified) >= MAX_VERIFIED:
            self._verified.clear()
        self._verified[(subkey, value["sig"])] = (record, valid_until)
