"""Hostile peers for attack tests: bare `SwarmNode`s of a test swarm's run, with identities under the swarm's workdir
and tickets signed by its authority key (an admitted peer gone bad) or forged to order."""
from __future__ import annotations

import time
from typing import Any

from swarm_harness import Swarm

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.records import PeerRecord
from swarmloco.protocol.base.wire import close_writer, read_frame, write_frame
from swarmloco.protocol.chain.state_sync import ServedState, StateServer, state_handler
from swarmloco.protocol.network.config import NetworkConfig
from swarmloco.protocol.network.node import SwarmNode
from swarmloco.protocol.trust.admission import Credentials, Gate, Ticket
from swarmloco.protocol.trust.identity import Identity, load_or_create_identity


def key(swarm: Swarm, name: str) -> Identity:
    return load_or_create_identity(swarm.workdir / f"{name}.key")


def ticket(swarm: Swarm, name: str, **kw: Any) -> bytes:
    """A ticket for `name` signed by the run's authority (`kw`: lifetime_s, now, ... to make it expired)."""
    authority = load_or_create_identity(swarm.authority_key)
    return Ticket.issue(authority, run_id=swarm.run_id, peer_id=key(swarm, name).peer_id, **kw).to_bytes()


def node(swarm: Swarm, name: str, *, ticket: bytes) -> SwarmNode:
    """A started node on the swarm's DHT that presents `ticket`; the caller shuts it down."""
    net = NetworkConfig(run_id=swarm.run_id, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                        initial_peers=tuple(swarm.bootstrap), identity=str(swarm.workdir / f"{name}.key"),
                        heartbeat_s=0.5)
    out = SwarmNode(net, credentials=Credentials(key(swarm, name), ticket), gate=Gate(swarm.run_id, swarm.authority))
    out.start()
    return out


def fingerprint(swarm: Swarm) -> str:
    """The honest peers' model fingerprint, read from a peer's own record."""
    reader = node(swarm, "fingerprint-reader", ticket=ticket(swarm, "fingerprint-reader"))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                records = reader.call(reader.fetch_records(timeout=5), timeout=10)
            except TimeoutError:  # a DHT read past its deadline on a loaded machine: read again
                continue
            if records:
                return next(iter(records.values())).fingerprint
            time.sleep(0.5)
        raise AssertionError("no honest record seen")
    finally:
        reader.shutdown()


def announce(node: SwarmNode, fingerprint: str, round_number: int, state_hash: str, *, work: int,
              **extra: Any) -> None:
    record = PeerRecord.announce(fingerprint=fingerprint, config_json="{}", round=round_number, state_hash=state_hash,
                                 work=work)
    node.update_record(**{**record.to_value(), **extra})


def serve(node: SwarmNode, fingerprint: str, state: ServedState) -> None:
    server = StateServer(node, fingerprint, gate=node.gate, credentials=node.credentials)
    node.call(server.register(), timeout=30)
    server.publish(state)


async def ask_state(node: SwarmNode, peer: str, fingerprint: str, **request: Any) -> pb.StateHeader:
    """`peer`'s answer to one state request from `node` (`request`: the StateRequest's other fields, such as
    `length=1` or `manifest=True`); the session is dropped after the header."""
    reader, writer = await node.open_stream(peer, state_handler(node.run_id), timeout=10)
    try:
        await write_frame(writer, pb.StateRequest(run_id=node.run_id, fingerprint=fingerprint,
                                                  ticket=node.credentials.ticket, **request), timeout=10)
        header, _ = await read_frame(reader, pb.StateHeader, max_payload=2**31, timeout=30)
        return header
    finally:
        close_writer(writer)
