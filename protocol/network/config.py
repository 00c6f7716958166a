"""How a peer reaches the swarm: the hivemind and libp2p settings of `swarmloco.protocol.network.node.SwarmNode`,
torch- and hivemind-free, so that a command line can be parsed and validated without importing either."""
from __future__ import annotations

from dataclasses import dataclass

from swarmloco.protocol.base.records import MAX_RECORD_TTL_S


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """How this peer reaches the swarm (all hivemind/libp2p options that matter to users)."""

    run_id: str = "swarmloco"
    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity: str | None = None
    client_mode: bool = False
    use_relay: bool = True
    use_auto_relay: bool = False
    data_plane: bool = True  # move round tensors over direct TCP when the leader is reachable (libp2p otherwise)
    record_ttl_s: float = 20.0
    heartbeat_s: float = 2.0
    # hivemind's forked DHT process copies the whole peer (torch, model) copy-on-write and dirties it: on a tiny
    # model it doubles the peer's memory. In-process, DHT requests share our GIL instead; they are few and small.
    dht_process: bool = False
    dht_timeout_s: float = 3.0  # one DHT RPC (hivemind's wait_timeout); a machine running dozens of peers needs more

    def __post_init__(self) -> None:
        if not self.run_id or len(self.run_id) > 64 or not all(c.isalnum() or c in "-_." for c in self.run_id):
            raise ValueError(f"run_id: got {self.run_id!r}, allowed 1-64 characters of letters, digits, '-', '_', '.'")
        for maddr in (*self.initial_peers, *self.host_maddrs, *self.announce_maddrs):
            if not maddr.startswith("/"):
                raise ValueError(
                    f"multiaddr: got {maddr!r}, allowed a multiaddr such as /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo..."
                )
        if not 1.0 <= self.record_ttl_s <= MAX_RECORD_TTL_S:
            raise ValueError(f"record_ttl_s: got {self.record_ttl_s}, allowed 1 .. {MAX_RECORD_TTL_S:.0f}")
        if not 0.5 <= self.dht_timeout_s <= 120:
            raise ValueError(f"dht_timeout_s: got {self.dht_timeout_s}, allowed 0.5 .. 120")
        if not 0.1 <= self.heartbeat_s < self.record_ttl_s:
            raise ValueError(f"heartbeat_s: got {self.heartbeat_s}, allowed 0.1 .. record_ttl_s ({self.record_ttl_s})")
