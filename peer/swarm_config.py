"""Swarm settings: the network section (protocol.node.NetworkConfig) and the round section
(protocol.group.RoundConfig), registered with the peer's config loader so they get flags, env vars and TOML keys."""
from __future__ import annotations

from peer.config import Option, register_section
from protocol.group import RoundConfig
from protocol.node import NetworkConfig

register_section("network", NetworkConfig, [
    Option("--run-id", "network", "run_id", "name of the training run; all DHT keys live under it"),
    Option("--initial-peer", "network", "initial_peers", "multiaddr of a peer already in the swarm (repeatable)", repeat=True),
    Option("--host-maddr", "network", "host_maddrs", "multiaddr to listen on (repeatable), e.g. /ip4/0.0.0.0/tcp/31337", repeat=True),
    Option("--announce-maddr", "network", "announce_maddrs", "public multiaddr others should dial (repeatable)", repeat=True),
    Option("--identity", "network", "identity", "private key file giving a stable peer id (created if missing; default WORKDIR/identity.key)"),
    Option("--client-mode", "network", "client_mode", "do not accept incoming connections (behind NAT without relays)"),
    Option("--use-relay", "network", "use_relay", "allow libp2p circuit relays (hivemind use_relay)"),
    Option("--data-plane", "network", "data_plane", "send round tensors over direct TCP when reachable (--no-data-plane: libp2p only)"),
    Option("--use-auto-relay", "network", "use_auto_relay", "look for relays automatically when behind NAT (hivemind use_auto_relay)"),
])

register_section("round", RoundConfig, [
    Option("--quorum", "round", "quorum", "K: minimum peers in an averaging group"),
    Option("--grace-min", "round", "grace_min_s", "seconds a leader waits after reaching quorum when nobody else is expected"),
    Option("--grace-max", "round", "grace_max_s", "upper bound of the adaptive grace window, in seconds"),
    Option("--round-timeout", "round", "round_timeout_s", "seconds a ready peer waits for a group before giving the round up"),
    Option("--exchange-timeout", "round", "exchange_timeout_s", "deadline in seconds for moving one pseudo-gradient"),
    Option("--codec", "round", "codec", "pseudo-gradient wire codec: fp32 (lossless), fp16, bf16, int8, int4"),
    Option("--round-tokens", "round", "round_tokens", "round budget in tokens (slow peers take longer; 0 = --inner-steps)"),
    Option("--round-seconds", "round", "round_seconds", "round budget in seconds (slow peers run fewer steps; 0 = --inner-steps)"),
    Option("--weight-cap-factor", "round", "weight_cap_factor", "cap a member's token weight at this multiple of the leader's"),
    Option("--stale-discount", "round", "stale_discount", "weight multiplier per round of staleness of a late pseudo-gradient"),
    Option("--max-staleness", "round", "max_staleness", "drop local progress that is more than this many rounds stale"),
])
