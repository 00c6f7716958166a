"""Startup decisions that depend on where the peer runs, made once before training starts:

- whom to dial first: `--bootstrap-file` waits for the ready file a coordinator writes (`swarmloco coordinator
  --ready-file`) and dials the DHT node it names, so no peer id is ever written into a compose file; when the file
  carries the invite code the coordinator generated, a peer that reports to a coordinator and has no `--invite`
  uses it (the peers of one compose project join their own invite-only coordinator);
- which data shard to read: `--shard-index auto` gives replica n of a compose service shard (n-1) mod
  --num-shards, from the container's reverse-DNS name, so the replicas of one service read different data.

`resolve` applies both to a PeerConfig and returns the completed one. build_config stays free of I/O; the waiting
and the DNS query happen only here, and only when those options ask for them.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import random
import re
import socket
import struct
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from swarmloco.peer.config import BootstrapConfig, ConfigError, PeerConfig

logger = logging.getLogger(__name__)
PTR = 12  # DNS record type of a reverse-lookup answer
# Compose names replicas <project>-<service>-<n> (older versions: <project>_<service>_<n>), then the network's domain.
_REPLICA = re.compile(r"[-_](\d+)\Z")


class BootstrapError(ConfigError):
    """The peer cannot find its first contact; the message says what it waited for and where."""


# ------------------------------------------------------------------------------------------------ ready file
def read_ready_file(path: Path) -> dict[str, Any] | None:
    """The ready file's JSON object, or None while it is missing or unreadable (the coordinator is still starting)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def wait_for_dht_peer(path: Path, wait_s: float, *, poll_s: float = 0.5) -> dict[str, Any]:
    """Poll the ready file until it names the coordinator's DHT peer id; BootstrapError after `wait_s` seconds.

    A file without a dht_peer_id is waited on too: a coordinator started with --no-dht writes one, and so may an
    older run's coordinator whose volume is being reused while the new one starts."""
    deadline = time.monotonic() + wait_s
    while True:
        info = read_ready_file(path)
        if info is not None and isinstance(info.get("dht_peer_id"), str) and info["dht_peer_id"]:
            return info
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BootstrapError(
                f"no dht_peer_id in {path} after {wait_s:g} s: is the coordinator up, with its DHT node?"
            )
        time.sleep(min(poll_s, remaining))


def bootstrap_maddrs(info: dict[str, Any], boot: BootstrapConfig) -> tuple[str, ...]:
    """The multiaddrs to dial from a ready file: by --bootstrap-host when given (a name survives the coordinator
    getting a new IP on restart), else the ones the coordinator wrote, which are only right on its own network."""
    peer_id = info["dht_peer_id"]
    if boot.host is None:
        maddrs = tuple(m for m in info.get("dht_maddrs") or () if isinstance(m, str) and m.startswith("/"))
        if not maddrs:
            raise BootstrapError(f"{boot.file} names no dht_maddrs to dial: pass --bootstrap-host and --bootstrap-port")
        return maddrs
    try:
        proto = f"ip{ipaddress.ip_address(boot.host).version}"
    except ValueError:
        proto = "dns4"  # compose networks are IPv4; /dns would let libp2p try an AAAA answer it cannot reach
    return (f"/{proto}/{boot.host}/tcp/{boot.port}/p2p/{peer_id}",)


# ------------------------------------------------------------------------------------------------ reverse DNS
def nameserver(resolv_conf: Path = Path("/etc/resolv.conf")) -> tuple[str, int] | None:
    """The first nameserver of resolv.conf (Docker's embedded DNS, 127.0.0.11, inside a compose container)."""
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            return parts[1], 53
    return None


def ptr_query(ip: str, query_id: int) -> bytes:
    """A DNS query (recursion desired) for the PTR record of an IPv4 address."""
    labels = [*reversed(ip.split(".")), "in-addr", "arpa"]
    qname = b"".join(bytes([len(p)]) + p.encode() for p in labels) + b"\0"
    return struct.pack(">6H", query_id, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">2H", PTR, 1)


def _read_name(msg: bytes, pos: int) -> tuple[str, int]:
    """A (possibly compressed) domain name at `pos`: (the name, the offset just after it in the message)."""
    parts: list[str] = []
    end: int | None = None
    for _ in range(128):  # a pointer loop in a hostile reply must not hang us
        n = msg[pos]
        if n == 0:
            return ".".join(parts), end if end is not None else pos + 1
        if n >= 0xC0:
            end = pos + 2 if end is None else end
            pos = ((n & 0x3F) << 8) | msg[pos + 1]
        else:
            parts.append(msg[pos + 1 : pos + 1 + n].decode("ascii", "replace"))
            pos += 1 + n
    raise ValueError("DNS name has too many labels or pointers")


def parse_ptr_reply(reply: bytes, query_id: int) -> str | None:
    """The name in the first PTR answer of a DNS reply to our query; None for no answer, an error or garbage."""
    try:
        rid, flags, qdcount, ancount = struct.unpack(">4H", reply[:8])
        if rid != query_id or not flags & 0x8000 or flags & 0x000F or not ancount:
            return None
        pos = 12
        for _ in range(qdcount):
            pos = _read_name(reply, pos)[1] + 4  # qtype, qclass
        for _ in range(ancount):
            pos = _read_name(reply, pos)[1]
            rtype, _cls, _ttl, rdlength = struct.unpack(">HHIH", reply[pos : pos + 10])
            if rtype == PTR:
                return _read_name(reply, pos + 10)[0] or None
            pos += 10 + rdlength
    except (IndexError, ValueError, struct.error):
        return None
    return None


def reverse_dns_name(ip: str, server: tuple[str, int], *, timeout: float = 2.0) -> str | None:
    """Ask `server` directly for the PTR name of `ip`. Not socket.gethostbyaddr: inside a container /etc/hosts
    answers first, with the container id instead of the compose replica name."""
    query_id = random.randrange(65536)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(ptr_query(ip, query_id), server)
        reply = sock.recv(4096)
    return parse_ptr_reply(reply, query_id)


def replica_number(name: str) -> int | None:
    """n in a compose replica name such as swarmloco-peer-3.swarmloco_default; None if there is none."""
    match = _REPLICA.search(name.split(".", 1)[0])  # the host label only: the network's name may end in digits
    return int(match.group(1)) if match else None


def replica_shard(
    num_shards: int, *, server: tuple[str, int] | None = None, ip: str | None = None, rng: random.Random | None = None
) -> int:
    """Replica n reads shard (n-1) mod num_shards; without a replica number, a random shard (with a warning)."""
    name = None
    try:
        ip = ip or socket.gethostbyname(socket.gethostname())
        server = server or nameserver()
        if server is not None:
            name = reverse_dns_name(ip, server)
    except OSError as exc:
        logger.debug("reverse DNS lookup failed: %r", exc)
    replica = replica_number(name or "")
    if replica is None:
        shard = (rng or random.Random()).randrange(num_shards)
        logger.warning(
            "shard auto: no compose replica number from reverse DNS (%s): random shard %d of %d "
            "(set --shard-index to choose)",
            name or "no answer",
            shard,
            num_shards,
        )
        return shard
    shard = (replica - 1) % num_shards
    if replica > num_shards:
        logger.warning(
            "replica %d > --num-shards %d: it shares shard %d with replica %d", replica, num_shards, shard, shard + 1
        )
    return shard


# ------------------------------------------------------------------------------------------------ both
def resolve(cfg: PeerConfig, *, dns_server: tuple[str, int] | None = None, ip: str | None = None) -> PeerConfig:
    """The config with the bootstrap peer and the shard filled in. Waits for the ready file only when the peer
    needs it: in a swarm, with --bootstrap-file, and no --initial-peer (which means joining some other swarm)."""
    run, net, boot, admission = cfg.run, cfg.network, cfg.bootstrap, cfg.admission
    if boot.file and not net.initial_peers and not run.solo:
        info = wait_for_dht_peer(Path(boot.file), boot.wait_s)
        net = replace(net, initial_peers=bootstrap_maddrs(info, boot))
        logger.info("bootstrap: dialing %s (from %s)", ", ".join(net.initial_peers), boot.file)
        invite = info.get("invite")
        if run.coordinator and not admission.invite and isinstance(invite, str) and 0 < len(invite) <= 256:
            admission = replace(admission, invite=invite)
            logger.info("bootstrap: using the invite code the coordinator wrote into %s", boot.file)
    if run.shard_index is None:
        run = replace(run, shard_index=replica_shard(run.num_shards, server=dns_server, ip=ip))
        logger.info("shard auto: reading shard %d of %d", run.shard_index, run.num_shards)
    return replace(cfg, run=run, network=net, admission=admission)
