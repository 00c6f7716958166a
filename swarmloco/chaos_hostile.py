"""Hostile peers for chaos scenarios, built from the project's own network code: admitted (they hold a ticket from
the run's authority key) but never honest.

    python -m swarmloco.chaos_hostile claimant --run-id R --authority-key KEY --workdir DIR --initial-peer MADDR

A `claimant` keeps its signed record claiming a state far ahead of the honest peers' newest one (1000 rounds on,
ten times the certified work) and accepts every certificate or state request without ever answering it: the
slowest possible liar, which no peer can prove wrong before its request times out.

A `holder` says it is ready at the honest peers' newest state the moment it sees that state, in the view they are
in, trains nothing, and accepts every join without ever closing the group: were the first peer ready the view's
only candidate, it would lead every view that begins while the honest peers train, and hold them to its end.
Both exit on SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
LOOK_S = 2.0  # how often the claimant re-reads the honest peers' records and moves its claim ahead of them
HOLDER_LOOK_S = 0.5  # how often the holder re-reads them: it is ready at a new state within this
HANG_S = 3600.0  # how long a request to the claimant waits for an answer that never comes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m swarmloco.chaos_hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["claimant", "holder"])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--authority-key", required=True, type=Path, help="the run's authority key (signs a ticket)")
    parser.add_argument("--workdir", required=True, type=Path, help="where the hostile peer keeps its identity")
    parser.add_argument("--initial-peer", action="append", default=[], help="a bootstrap multiaddr (repeatable)")
    parser.add_argument("--fingerprint", default="", help="the model fingerprint to claim (default: the swarm's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from swarmloco.protocol.network.config import NetworkConfig
    from swarmloco.protocol.network.node import SwarmNode
    from swarmloco.protocol.trust.admission import Credentials, Gate, Ticket
    from swarmloco.protocol.trust.identity import load_or_create_identity

    args.workdir.mkdir(parents=True, exist_ok=True)
    authority = load_or_create_identity(args.authority_key)
    identity = load_or_create_identity(args.workdir / "identity.key")
    credentials = Credentials(identity)
    credentials.ticket = Ticket.issue(authority, run_id=args.run_id, peer_id=identity.peer_id).to_bytes()
    config = NetworkConfig(run_id=args.run_id, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                           initial_peers=tuple(args.initial_peer), identity=str(args.workdir / "identity.key"))
    node = SwarmNode(config, credentials=credentials, gate=Gate(args.run_id, authority.peer_id))
    node.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    logger.info("%s %s up", args.kind, identity.peer_id)
    try:
        (_hold if args.kind == "holder" else _claim)(node, credentials, args, stop)
    finally:
        node.shutdown()
    return 0


def _honest_top(node: Any, period_s: float, stop: threading.Event) -> Iterator[tuple[Any, list[Any]]]:
    """Every `period_s` until `stop`: the honest peers' record with the most certified work, and all their records.
    Hostile claims carry work above 10**9 (no chaos run trains that many tokens): never the state to pass."""
    while not stop.wait(period_s):
        try:
            records = node.call(node.fetch_records(timeout=5), timeout=10)
        except Exception as exc:  # the next look retries
            logger.info("look failed: %r", exc)
            continue
        honest = [r for p, r in records.items() if p != node.peer_id and r.work < 10**9]
        if honest:
            yield max(honest, key=lambda r: (r.work, r.round)), honest


def _claim(node: Any, credentials: Any, args: argparse.Namespace, stop: threading.Event) -> None:
    from swarmloco.protocol.base.records import PeerRecord
    from swarmloco.protocol.chain.state_sync import state_handler

    async def hang(caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        logger.info("holding a request from %s", caller[-8:])
        await asyncio.sleep(HANG_S)

    node.call(node.add_handler(state_handler(args.run_id), hang), timeout=30)
    claimed: tuple[int, str] | None = None
    for top, _ in _honest_top(node, LOOK_S, stop):
        claim = (top.round + 1000, hashlib.sha256(f"{node.peer_id}{top.state_hash}".encode()).hexdigest())
        if claim == claimed:
            continue
        claimed = claim
        record = PeerRecord.announce(fingerprint=args.fingerprint or top.fingerprint, config_json=top.config_json,
                                     round=claim[0], state_hash=claim[1], work=10 * top.work + 10**9)
        node.update_record(**record.to_value())
        logger.info("claiming round %d", claim[0])


def _hold(node: Any, credentials: Any, args: argparse.Namespace, stop: threading.Event) -> None:
    from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
    from swarmloco.protocol.base.records import PROTOCOL_VERSION, PeerRecord
    from swarmloco.protocol.base.wire import read_frame, write_frame

    async def hold(caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader, pb.JoinRequest, max_payload=0, timeout=10)
        await write_frame(writer, pb.JoinReply(status=pb.JoinReply.ACCEPTED, ticket=credentials.ticket), timeout=10)
        logger.info("holding %s in a group that never closes", caller[-8:])
        await asyncio.sleep(HANG_S)

    node.call(node.add_handler(f"swarmloco/{args.run_id}/avg/v{PROTOCOL_VERSION}", hold), timeout=30)
    held: tuple[int, str] | None = None
    for top, honest in _honest_top(node, HOLDER_LOOK_S, stop):
        views = [r.view for r in honest if (r.round, r.state_hash) == (top.round, top.state_hash) and r.ready]
        if (top.round, top.state_hash) != held:  # a new state: ready at once, before anyone could have trained
            held = (top.round, top.state_hash)
            record = PeerRecord.announce(fingerprint=top.fingerprint, config_json=top.config_json, round=top.round,
                                         state_hash=top.state_hash, work=top.work, ready=True)
            node.update_record(**record.to_value())
            logger.info("ready at round %d", top.round)
        node.update_record(view=max(views, default=0))  # in the honest peers' view: waited for like one of them


if __name__ == "__main__":
    raise SystemExit(main())
