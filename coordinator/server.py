"""Running the coordinator: store + service + HTTP server (+ optional hivemind DHT bootstrap node).

:class:`CoordinatorServer` binds its socket itself, so ``port=0`` works and :attr:`CoordinatorServer.url` is known
before the first request. It can run in the foreground (:meth:`run`, handles SIGINT/SIGTERM) or in a background
thread (:meth:`start`/:meth:`stop`, used by tests). When ``ready_file`` is set, a JSON document is written
atomically once the server accepts connections::

    {"url": "http://127.0.0.1:41234", "host": "127.0.0.1", "port": 41234, "run_id": "default",
     "db": "/abs/runs.sqlite", "pid": 1234, "authority": "12D3KooW...", "admission": "open",
     "dht_peer_id": "12D3KooW..." | null, "dht_maddrs": ["/ip4/127.0.0.1/tcp/38211/p2p/12D3KooW..."],
     "join_command": "swarmloco peer ...", "invite": "..."}

``invite`` is there only when the config names a ``local_invite`` (the code ``swarmloco coordinator`` generated
for an invite run): peers on this host (``swarmloco swarm``, a compose service with ``--bootstrap-file``) read it
from the file, which is then readable by its owner only.

The identity file (``<db>.key`` unless given) is the run's authority key, which signs tickets and revocation
lists; it exists even without a DHT node, and the DHT node runs under the same key. With a DHT node, the signed
revocation list is published under ``revocations_key(run_id)`` (subkey: the authority's peer id) at start and every
``REVOCATIONS_EVERY_S``, so peers learn of revocations without asking the coordinator. The authority's newest
checkpoint (coordinator/checkpoints.py) goes under ``checkpoint_key(run_id)`` at the same times, re-signed when due.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import uvicorn

from swarmloco.coordinator.app import create_app, with_fast_reports
from swarmloco.coordinator.connections import ConnectionGuard, ConnectionLimits, guarded_protocol
from swarmloco.coordinator.files import write_atomically
from swarmloco.coordinator.ingest import IngestConfig, IngestPipeline
from swarmloco.coordinator.service import CoordinatorService, ServiceConfig
from swarmloco.coordinator.store import SQLiteStore
from swarmloco.protocol.base.records import checkpoint_key, revocations_key
from swarmloco.protocol.trust.checkpoints import MAX_CHECKPOINT_TTL_S
from swarmloco.protocol.trust.identity import load_or_create_identity

__all__ = ["CoordinatorConfig", "CoordinatorServer", "join_command"]

logger = logging.getLogger(__name__)

REVOCATIONS_EVERY_S = 30.0
REVOCATIONS_TTL_S = 120.0  # a few missed publications do not make the list vanish from the DHT
CHECKPOINT_TTL_S = 300.0  # likewise the checkpoint (re-published with the list, re-signed when due)


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """Where the coordinator listens and stores, and whether it runs a DHT bootstrap node."""

    db: Path
    host: str = "127.0.0.1"
    port: int = 8000
    dht: bool = True
    dht_host: str = "127.0.0.1"
    dht_port: int = 0
    identity_path: Path | None = None  # default: <db>.key
    ready_file: Path | None = None
    local_invite: str = ""  # written into the ready file (only there) for peers on this host; "" writes none
    service: ServiceConfig = field(default_factory=ServiceConfig)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    group_commit: bool = True  # reports that arrive together share one commit (False: one each; for benchmarks)
    ingest: IngestConfig = field(default_factory=IngestConfig)  # verifier threads and bounds of the report pipeline

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.dht_port <= 65535:
            raise ValueError(f"dht_port must be in [0, 65535], got {self.dht_port}")
        if len(self.local_invite) > 256 or "\n" in self.local_invite:
            raise ValueError("local_invite must be one line of at most 256 chars")
        if not Path(self.db).parent.is_dir():
            raise ValueError(f"directory of --db {self.db} does not exist; create it first")


def join_command(url: str, invite: str = "") -> str:
    """The exact command a volunteer runs to join this coordinator's run: its manifest says the rest."""
    return shlex.join(["swarmloco", "peer", "--join", url] + (["--invite", invite] if invite else []))


class CoordinatorServer:
    """Owns the store, the HTTP server and the DHT node for one coordinator process."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.identity_path = config.identity_path or Path(str(config.db) + ".key")
        self.identity = load_or_create_identity(self.identity_path)
        self.store = SQLiteStore(config.db, group_commit=config.group_commit,
                                 online_window_s=config.service.online_window_s)
        self.service = CoordinatorService(self.store, config.service, identity=self.identity)
        self._sock = socket.create_server((config.host, config.port), reuse_port=False)
        self.port: int = self._sock.getsockname()[1]
        shown = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
        self.url = f"http://{shown}:{self.port}" if ":" not in shown else f"http://[{shown}]:{self.port}"
        self.service.url = self.url
        # Connections are capped and timed out by the guard (see swarmloco.coordinator.connections); uvicorn's own
        # limit_concurrency would count idle connections and answer real requests 503.
        self.connections = ConnectionGuard.for_process(config.connections)
        # Reports go through the ingest pipeline (coordinator/ingest.py), on a route in front of FastAPI's.
        self.pipeline = IngestPipeline(self.service, config.ingest)
        app = with_fast_reports(create_app(self.service, self.pipeline), self.service, self.pipeline)
        self._server = uvicorn.Server(uvicorn.Config(
            app, http=guarded_protocol(self.connections), ws="none", log_level="warning",
            access_log=False, timeout_keep_alive=max(1, round(config.connections.idle_timeout_s)),
            limit_concurrency=None, h11_max_incomplete_event_size=config.connections.max_header_bytes,
            timeout_graceful_shutdown=3))
        self._thread: threading.Thread | None = None
        self.dht: Any = None
        self.dht_maddrs: list[str] = []
        self.dht_peer_id: str | None = None
        self._stopping = threading.Event()
        self._publisher: threading.Thread | None = None

    # -- DHT -------------------------------------------------------------------------------------------------

    def start_dht(self) -> None:
        """Start the DHT bootstrap node (idempotent); afterwards :meth:`info` lists its multiaddrs."""
        if self.dht is not None:
            return
        from swarmloco.protocol.network.dht_host import LocalDHT  # heavy (hivemind); only when the node is wanted
        from swarmloco.protocol.trust.signed_records import RunValidator

        # The bootstrap node checks what it stores like every peer does: signed records with tickets only.
        authority = None if self.service.authority.mode == "none" else self.identity.peer_id
        validator = RunValidator(self.config.service.run_id, authority)
        # On a thread of this process, not hivemind.DHT's forked child: a fork left torch's shared-memory manager
        # behind, in a session of its own, whenever the coordinator was killed.
        self.dht = LocalDHT.on_own_thread(
            name="coordinator-dht", host_maddrs=[f"/ip4/{self.config.dht_host}/tcp/{self.config.dht_port}"],
            identity_path=str(self.identity_path), check_if_identity_free=False, record_validators=[validator])
        self.dht_peer_id = self.dht.peer_id.to_base58()
        if self.dht_peer_id != self.identity.peer_id:
            logger.warning("DHT peer id %s differs from identity %s", self.dht_peer_id, self.identity.peer_id)
        self.dht_maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        # the manifest names addresses other machines can dial first; loopback ones only help on this machine
        self.service.bootstrap = sorted(self.dht_maddrs, key=lambda m: m.startswith(("/ip4/127.", "/ip6/::1/")))
        self.publish_revocations()
        self.publish_checkpoint()
        self._publisher = threading.Thread(target=self._publish_loop, name="revocations", daemon=True)
        self._publisher.start()

    def publish_revocations(self, timeout: float = 20.0) -> bool:
        """Store the signed revocation list in the DHT once; returns whether the DHT accepted it."""
        from hivemind.utils import get_dht_time

        dht = self.dht
        if dht is None:
            return False
        value = self.service.authority.revocations()
        try:
            future = dht.store(revocations_key(self.config.service.run_id), value,
                               expiration_time=get_dht_time() + REVOCATIONS_TTL_S, subkey=self.identity.peer_id,
                               return_future=True)
            stored = bool(future.result(timeout=timeout))
        except Exception as e:  # a DHT hiccup must not take the coordinator down; the next round retries
            logger.warning("could not publish the revocation list (serial %d) to the DHT: %s: %s", value["serial"],
                           type(e).__name__, e)
            return False
        if not stored:
            logger.warning("the DHT refused the revocation list (serial %d); retrying in %.0fs", value["serial"],
                           REVOCATIONS_EVERY_S)
        return stored

    def publish_checkpoint(self, timeout: float = 20.0) -> bool:
        """Sign a checkpoint when one is due and store the newest in the DHT; returns whether the DHT took it."""
        from hivemind.utils import get_dht_time

        dht, value = self.dht, self.service.checkpoint(refresh=True)
        if dht is None or value is None:
            return False
        expires = min(get_dht_time() + CHECKPOINT_TTL_S, value["issued_at"] + MAX_CHECKPOINT_TTL_S)
        try:
            future = dht.store(checkpoint_key(self.config.service.run_id), value, expiration_time=expires,
                               subkey=self.identity.peer_id, return_future=True)
            return bool(future.result(timeout=timeout))
        except Exception as e:  # a DHT hiccup must not take the coordinator down; the next round retries
            logger.warning("could not publish the checkpoint (round %s) to the DHT: %s: %s", value.get("round"),
                           type(e).__name__, e)
            return False

    def _publish_loop(self) -> None:
        while not self._stopping.wait(REVOCATIONS_EVERY_S):
            self.publish_revocations()
            self.publish_checkpoint()

    # -- lifecycle -------------------------------------------------------------------------------------------

    def info(self, *, invite: str = "") -> dict[str, Any]:
        """What the ready file says; `invite`: also the invite code, in the join command and on its own."""
        run_id = self.config.service.run_id
        return {"url": self.url, "host": self.config.host, "port": self.port, "run_id": run_id,
                "db": str(Path(self.config.db).resolve()), "pid": os.getpid(), "authority": self.identity.peer_id,
                "admission": self.service.authority.mode, "dht_peer_id": self.dht_peer_id,
                "dht_maddrs": self.dht_maddrs, "join_command": join_command(self.url, invite),
                **({"invite": invite} if invite else {})}

    def _write_ready_file(self) -> None:
        if self.config.ready_file is None:
            return
        invite = self.config.local_invite
        write_atomically(Path(self.config.ready_file), json.dumps(self.info(invite=invite), indent=2),
                         private=bool(invite))

    def _wait_started(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._server.started:
                return True
            if self._thread is not None and not self._thread.is_alive():
                return False
            time.sleep(0.01)
        return False

    def _announce_when_started(self) -> None:
        if self._wait_started(timeout=30.0):
            self._write_ready_file()
            logger.info("coordinator listening on %s", self.url)

    def run(self) -> None:
        """Serve in the foreground until SIGINT/SIGTERM."""
        if self.config.dht:
            self.start_dht()
        threading.Thread(target=self._announce_when_started, name="ready-file", daemon=True).start()
        # uvicorn restores the previous handlers and re-raises the signal after its graceful shutdown; with the
        # default handler that would kill us before the DHT and the database are closed.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: logger.info("stopping on signal %d", signum))
        self.pipeline.start()
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._cleanup()

    def start(self, timeout: float = 30.0) -> Self:
        """Serve in a background thread; returns once connections are accepted."""
        if self.config.dht:
            self.start_dht()
        self.pipeline.start()
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="coordinator-http", daemon=True)
        self._thread.start()
        if not self._wait_started(timeout):
            self.stop()
            raise RuntimeError(f"coordinator did not start listening within {timeout}s")
        self._write_ready_file()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._cleanup()

    def _cleanup(self) -> None:
        self._stopping.set()
        if self._publisher is not None:
            self._publisher.join(timeout=25)
            self._publisher = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        try:
            self._sock.close()
            self.pipeline.stop()  # answers what it holds before the database closes
        finally:
            self.store.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
