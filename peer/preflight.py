"""Start-up checks of `swarmloco peer` that turn a new user's mistakes into one line each, before anything starts:
a second peer in the same workdir, a listen port another process owns, an --initial-peer that is not a full
multiaddr; and afterwards, the libp2p daemon's refusal to start, reworded (unreachable bootstrap peer, bad address).
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import IO

from swarmloco.peer.config import ConfigError, PeerConfig
from swarmloco.protocol.network.ports import port_taken, tcp_listen_addresses

LOCK_NAME = "peer.lock"
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
# Multihash codes a libp2p peer id uses: identity (an inlined Ed25519 key) and sha2-256 (a hashed RSA key).
_MULTIHASH_CODES = (0x00, 0x12)
_DAEMON_TIME = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ")
EXAMPLE = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."


class WorkdirInUse(ConfigError):
    pass


def lock_workdir(cfg: PeerConfig) -> list[IO[str]]:
    """Hold exclusive locks on the workdir and on the identity file until this process exits: a second peer on
    either gets one line, instead of a shared peer id and a fight over one checkpoint."""
    workdir = Path(cfg.run.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    identity = Path(cfg.identity_path)
    identity.parent.mkdir(parents=True, exist_ok=True)
    targets = [(workdir / LOCK_NAME, f"workdir {workdir}", "give each peer its own --workdir"),
               (identity.with_name(identity.name + ".lock"), f"identity {identity}",
                "give each peer its own --identity (or leave it out: each --workdir then has one)")]
    held: list[IO[str]] = []
    for path, what, fix in targets:
        f = open(path, "a+")  # noqa: SIM115 - held open for the life of the process: the lock lives with the fd
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "unknown"
            f.close()
            for other in held:
                other.close()
            raise WorkdirInUse(f"{what} is in use by another swarmloco peer (pid {owner}): two peers there would "
                               f"share one peer id and one checkpoint; {fix}") from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        held.append(f)
    return held


def _checkpoint_sidecar(cfg: PeerConfig) -> Path:
    """The file a saved checkpoint is known by (`swarmloco.peer.checkpoint.SIDECAR`, which imports torch)."""
    return Path(cfg.run.workdir) / "checkpoint" / "state.json"


def check_resume(cfg: PeerConfig) -> None:
    """--resume with no checkpoint to resume from: said before the model is built (the checkpoint's own checks of
    what is there come when it is loaded)."""
    sidecar = _checkpoint_sidecar(cfg)
    if cfg.run.resume and not sidecar.exists():
        raise ConfigError(f"no checkpoint at {sidecar}; drop --resume to start fresh")


def set_aside_checkpoint(cfg: PeerConfig) -> Path | None:
    """Without --resume, an existing checkpoint would be overwritten by this run's first, earlier one: move it to
    checkpoint.previous (replacing an older one) and return where it went; None when there was none."""
    sidecar = _checkpoint_sidecar(cfg)
    if cfg.run.resume or not sidecar.exists():
        return None
    directory = sidecar.parent
    previous = directory.with_name("checkpoint.previous")
    if previous.exists():
        shutil.rmtree(previous)
    directory.rename(previous)
    return previous


def peer_id_problem(peer_id: str) -> str | None:
    """Why `peer_id` cannot be a libp2p peer id (base58 multihash), or None: catches a truncated copy-paste."""
    if not peer_id or any(c not in _B58 for c in peer_id):
        return "is not base58"
    n = 0
    for c in peer_id:
        n = n * 58 + _B58.index(c)
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    raw = b"\0" * (len(peer_id) - len(peer_id.lstrip("1"))) + raw
    if len(raw) < 2 or raw[0] not in _MULTIHASH_CODES or raw[1] != len(raw) - 2:
        return f"is not a whole peer id ({len(peer_id)} characters; a peer id such as 12D3KooW... has 52)"
    return None


def check_network(cfg: PeerConfig) -> None:
    """Refuse, with one ConfigError line, what would otherwise fail deep inside the libp2p daemon."""
    net = cfg.network
    for maddr in net.initial_peers:
        _, sep, rest = maddr.partition("/p2p/")
        if not sep:
            raise ConfigError(f"initial_peer: {maddr!r} has no /p2p/PEER_ID part: copy the whole multiaddr, e.g. "
                              f"{EXAMPLE} (the coordinator prints it, and every peer logs its own in [joined])")
        problem = peer_id_problem(rest.split("/", 1)[0])
        if problem:
            raise ConfigError(f"initial_peer: the peer id in {maddr!r} {problem}: copy the whole multiaddr again")
    for maddr, host, port in tcp_listen_addresses(net.host_maddrs):
        why = port_taken(host, port)
        if why:
            raise ConfigError(f"host_maddr: cannot listen on {maddr} ({why}): another peer or coordinator is "
                              "probably listening there; stop it, or use another port (tcp/0 = any free port)")


def explain_start_failure(exc: BaseException, cfg: PeerConfig) -> str | None:
    """The libp2p daemon's start-up failure as one line that says what to try; None for any other error."""
    if type(exc).__name__ != "P2PDaemonError":
        return None
    text = str(exc).removeprefix("Daemon failed to start: ")
    text = _DAEMON_TIME.sub("", text.strip())
    peers = ", ".join(cfg.network.initial_peers) or "none"
    if "failed to connect to bootstrap peers" in text:
        return (f"could not reach any --initial-peer ({peers}): is that peer running, and is its address and port "
                "reachable from here (firewall, NAT)? Copy the multiaddr the coordinator or the peer printed")
    if "multiaddr" in text:
        return f"libp2p refused an address ({text}): check --initial-peer, --host-maddr and --announce-maddr"
    return f"the libp2p daemon did not start: {text}"
