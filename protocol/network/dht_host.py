"""hivemind's DHT node on this peer's own event loop, instead of in a forked process.

`hivemind.DHT` forks a child that inherits the whole peer (torch, the model, the optimizer) and then dirties those
pages copy-on-write: on a tiny model that child costs about as much memory as the peer itself. `LocalDHT` runs the
same `DHTNode` (same protocol, same record validators, same p2pd daemon) as a task of the swarm loop and offers the
subset of `hivemind.DHT`'s interface that `SwarmNode` and the tests use, so either can sit behind `SwarmNode.dht`.
The price is that DHT requests share the peer's GIL; they are small and rare (one record per heartbeat).
`LocalDHT.on_own_thread` runs the node on a loop thread of its own, for processes with no loop to lend it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Iterable
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmloco.protocol.network.dht_entries import keep_valid_entries

logger = logging.getLogger(__name__)
HANDLERS_TIMEOUT_S = 1.0  # for unregistering the DHT's RPC handlers with a daemon that is about to stop
# Every DHT node of a process that uses this module (ours, or a forked hivemind.DHT) keeps the valid entries of a
# reply that also holds invalid ones: one forged record must not hide the others (`dht_entries`).
keep_valid_entries()


class LocalDHT:
    """A `DHTNode` owned by one event loop; `store`/`get` may be called from any other thread."""

    def __init__(self, node: DHTNode, loop: asyncio.AbstractEventLoop, maddrs: list[Multiaddr]) -> None:
        self.node, self.loop, self._maddrs = node, loop, maddrs
        self._replica: P2P | None = None
        self._closed = False
        self._own_thread: threading.Thread | None = None  # set when the node runs on a loop thread of its own

    @classmethod
    async def create(cls, *, record_validators: Iterable[RecordValidatorBase] = (), **kwargs: Any) -> LocalDHT:
        """Start the node (and its p2pd daemon) on the running loop; kwargs as for `hivemind.DHT`."""
        node = await DHTNode.create(record_validator=CompositeValidator(record_validators), **kwargs)
        # Addresses are read once: the sync accessor below is also called on the loop thread, which must not wait
        # on itself, and hivemind's own DHT answers the same cached list unless asked for the latest.
        return cls(node, asyncio.get_running_loop(), await node.get_visible_maddrs())

    @classmethod
    def on_own_thread(cls, *, name: str = "dht", timeout: float = 60.0, **kwargs: Any) -> LocalDHT:
        """Start the node on a new loop thread, for a process that has no event loop to lend it (the coordinator's
        bootstrap node, the swarm launcher's): no forked child, unlike `hivemind.DHT`, so nothing (not even torch's
        shared-memory manager, which the fork starts) outlives the process. `shutdown` also ends that thread."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
        thread.start()
        future = asyncio.run_coroutine_threadsafe(cls.create(**kwargs), loop)
        try:
            dht = future.result(timeout)
        except BaseException:
            future.cancel()
            _stop_loop(loop, thread)
            raise
        dht._own_thread = thread
        return dht

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    def get_visible_maddrs(self, latest: bool = False) -> list[Multiaddr]:
        return list(self._maddrs)

    def _run(self, coro: Any, return_future: bool) -> Any:
        future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future if return_future else future.result()

    def store(self, key: Any, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = False,
              **kwargs: Any) -> Any:
        """As `hivemind.DHT.store`; never call it with return_future=False on the loop thread (it would wait on
        itself)."""
        return self._run(self.node.store(key, value, expiration_time, subkey=subkey, **kwargs), return_future)

    def get(self, key: Any, latest: bool = False, return_future: bool = False, **kwargs: Any) -> Any:
        return self._run(self.node.get(key, latest=latest, **kwargs), return_future)

    async def replicate_p2p(self) -> P2P:
        """A second client of the node's p2pd daemon for our stream handlers, as `hivemind.DHT` hands out: closing
        it never closes the daemon the DHT still uses."""
        if self._replica is None:
            self._replica = await P2P.replicate(self.node.p2p.daemon_listen_maddr)
        return self._replica

    async def aclose(self) -> None:
        """Stop the node and its p2pd daemon; on the loop."""
        if self._closed:
            return
        self._closed = True
        # hivemind's DHTNode.shutdown first unregisters the DHT's RPC handlers one by one with the daemon, which
        # can hang for the caller's whole timeout (15 s per peer exit, measured); the daemon is about to stop, so
        # that is bounded, then the node and its p2pd are stopped regardless.
        self.node.is_alive = False
        try:
            await asyncio.wait_for(self.node.protocol.shutdown(), HANDLERS_TIMEOUT_S)
        except Exception as exc:  # a timeout included: best effort, the daemon's end removes them too
            logger.debug("removing the DHT's handlers: %r", exc)
        if getattr(self.node, "_should_shutdown_p2p", True):  # the node started this daemon (hivemind 1.1)
            await self.node.p2p.shutdown()

    def shutdown(self) -> None:
        """Stop the node from another thread if the loop still runs (a dead loop already took the node with it, and
        its p2pd daemon is stopped with its session); a loop thread of our own ends too."""
        if not self._closed and not self.loop.is_closed() and self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self.aclose(), self.loop).result(timeout=15)
            except (concurrent.futures.TimeoutError, RuntimeError) as exc:
                logger.warning("the DHT node did not stop cleanly: %r", exc)
        if self._own_thread is not None:
            _stop_loop(self.loop, self._own_thread)
            self._own_thread = None


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, timeout: float = 5.0) -> None:
    """Stop a loop running on `thread`, wait for the thread, and close the loop once it has stopped."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout)
    if not thread.is_alive() and not loop.is_closed():
        loop.close()
