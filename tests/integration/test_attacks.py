"""Attacks on the swarm's state by hostile peers built from the project's own code, against real honest peers.

One swarm of three honest peers meets, at once: an admitted peer that claims round 1001 and serves its own random
state without a certificate; an admitted peer that claims round 2002 and serves a NaN state under a forged
certificate (its own signature and a key the authority never admitted); an admitted peer at the honest state that
claims the farthest view and holds every member that joins it; an attempt to overwrite an honest peer's record;
and peers without a ticket, with an expired one and with a revoked one, each asking every honest peer to join its
group and to send its state. A second swarm is split 2+2, certifies rounds on both sides, and heals into one chain.

Each test ends with the honest peers on one certified hash with finite parameters. On the code before tickets,
signed records and certificates, the first swarm adopts round 1001's state (or stops at it, past --max-rounds) and
follows the claimed leader; the split swarm commits two histories and keeps them apart.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

import hivemind
import pytest
import torch
from _hostile_nodes import announce as _announce
from _hostile_nodes import ask_state
from _hostile_nodes import fingerprint as _fingerprint
from _hostile_nodes import key as _key
from _hostile_nodes import node as _node
from _hostile_nodes import serve as _serve
from _hostile_nodes import ticket as _ticket
from hivemind.utils import get_dht_time
from swarm_harness import Swarm, assert_no_split, genesis_hash, replica

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.records import MAX_VIEW, PROTOCOL_VERSION, PeerRecord, peers_key, revocations_key
from swarmloco.protocol.base.wire import close_writer, read_frame, write_frame
from swarmloco.protocol.chain.state_sync import ServedState
from swarmloco.protocol.network.node import SwarmNode
from swarmloco.protocol.trust.admission import Revocations
from swarmloco.protocol.trust.certificates import Certificate, Statement
from swarmloco.protocol.trust.identity import load_or_create_identity
from swarmloco.protocol.trust.signed_records import seal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
HONEST = ["a", "b", "c"]
ROUND_CAP = 40


async def _ask_join(node: SwarmNode, peer: str, fingerprint: str) -> pb.JoinReply:
    reader, writer = await node.open_stream(peer, f"swarmloco/{node.run_id}/avg/v{PROTOCOL_VERSION}", timeout=10)
    try:
        await write_frame(writer, pb.JoinRequest(protocol_version=PROTOCOL_VERSION, run_id=node.run_id,
                                                 fingerprint=fingerprint, round=0, state_hash="0" * 64,
                                                 ticket=node.credentials.ticket), timeout=10)
        reply, _ = await read_frame(reader, pb.JoinReply, max_payload=0, timeout=10)
        return reply
    finally:
        close_writer(writer)


def _peer_ids(swarm: Swarm) -> dict[str, str]:
    return {name: swarm.summary(name)["peer_id"] for name in HONEST}


def test_hostile_peers_cannot_move_the_swarm(swarm: Swarm) -> None:
    for name in HONEST:
        # More rounds than the test needs: the honest peers must still be running while every attack is checked
        # (on a busy machine six rounds can be over before that); they are stopped once six rounds are certified.
        swarm.start(name, "--round-timeout", "20", rounds=ROUND_CAP, wait_for=3, inner_steps=10)
    fingerprint = _fingerprint(swarm)
    numel = _numel_of(swarm)
    hostile: list[SwarmNode] = []
    try:
        # 1. Round inflation with its own served state, and no certificate.
        inflator = _node(swarm, "inflator", ticket=_ticket(swarm, "inflator"))
        hostile.append(inflator)
        noise = torch.randn(2 * numel).numpy().tobytes()
        _serve(inflator, fingerprint, ServedState(round=1001, state_hash="1" * 64, blob=noise))
        _announce(inflator, fingerprint, 1001, "1" * 64, work=10**12)
        # 2. Round inflation with a NaN state under a forged certificate (itself and an unadmitted key signing).
        forger = _node(swarm, "forger", ticket=_ticket(swarm, "forger"))
        hostile.append(forger)
        sybil = _key(swarm, "sybil")
        signers = sorted([forger.credentials.identity, sybil], key=lambda i: i.peer_id)
        statement = Statement(run_id=swarm.run_id, round=2002, prev_hash="e" * 64, new_hash="2" * 64,
                              members=tuple(i.peer_id for i in signers), weights=(10**9, 10**9), swarm=2, work=10**13)
        forged = Certificate(statement, {i.peer_id: Certificate.sign(i, statement) for i in signers},
                             {forger.peer_id: forger.credentials.ticket.decode()})
        nan_blob = torch.full((2 * numel,), float("nan")).numpy().tobytes()
        _serve(forger, fingerprint, ServedState(round=2002, state_hash="2" * 64, blob=nan_blob,
                                                certificate=forged.to_bytes()))
        _announce(forger, fingerprint, 2002, "2" * 64, work=10**13)
        # 3. A peer at the honest state claiming the farthest view, ready: it accepts joins and never closes a group.
        claimer = _node(swarm, "claimer", ticket=_ticket(swarm, "claimer"))
        hostile.append(claimer)
        joined: list[str] = []

        async def hold(caller: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            joined.append(caller)
            await read_frame(reader, pb.JoinRequest, max_payload=0, timeout=10)
            await write_frame(writer, pb.JoinReply(status=pb.JoinReply.ACCEPTED, ticket=claimer.credentials.ticket),
                              timeout=10)
            await asyncio.sleep(600)

        claimer.call(claimer.add_handler(f"swarmloco/{swarm.run_id}/avg/v{PROTOCOL_VERSION}", hold), timeout=30)
        stop_following = threading.Event()

        def follow() -> None:  # keep claiming a far view at whatever state the honest peers hold
            while not stop_following.wait(0.5):
                try:
                    records = claimer.call(claimer.fetch_records(timeout=5), timeout=10)
                except Exception:  # the next look retries
                    continue
                honest = [r for r in records.values() if r.round < 1000 and r.view < MAX_VIEW]
                if honest:
                    top = max(honest, key=lambda r: r.work)
                    _announce(claimer, fingerprint, top.round, top.state_hash, work=top.work, ready=True,
                              view=MAX_VIEW)

        _announce(claimer, fingerprint, 0, genesis_hash(swarm.preset), work=0, ready=True, view=MAX_VIEW)
        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        # 4. No ticket, an expired one, a revoked one.
        strangers = {
            "no ticket": _node(swarm, "stranger", ticket=b""),
            "expired": _node(swarm, "expired", ticket=_ticket(swarm, "expired", lifetime_s=60, now=time.time() - 3600)),
            "revoked": _node(swarm, "revoked", ticket=_ticket(swarm, "revoked")),
        }
        hostile += strangers.values()
        authority = load_or_create_identity(swarm.authority_key)
        revocations = Revocations.issue(authority, run_id=swarm.run_id, serial=1,
                                        peer_ids=[strangers["revoked"].peer_id])
        assert swarm.dht.store(revocations_key(swarm.run_id), revocations.to_value(), get_dht_time() + 120,
                               subkey=authority.peer_id)
        # 5. Record overwrite: a forged round under an honest peer's subkey, with an hour's expiry.
        # a hostile node's own record can pass the round filter before its claim is published: never the victim.
        # The honest ids are taken before the forgery is stored: the harness's stock bootstrap node (no validator)
        # keeps it in place of the victim's record, so a reader that asks that node gets the victim's record only
        # from the others. (A reader once lost every record of that node's reply with the forgery; it now drops the
        # invalid entry only: tests/unit/test_dht_entries.py.)
        honest_ids = set(_wait_for_records(inflator, 3, all_ids=True, exclude=frozenset(p.peer_id for p in hostile)))
        victim = sorted(honest_ids)[0]
        envelope = seal(inflator.credentials.identity, swarm.run_id,
                        PeerRecord.announce(fingerprint=fingerprint, config_json="{}", round=1001,
                                            state_hash="1" * 64, work=10**12), inflator.credentials.ticket.decode(),
                        get_dht_time() + 3600)
        assert inflator.dht is not None
        # What the store returns is not the defence: hivemind reports a store as done if any node kept the value, and
        # a stock node without our validator (this harness's bootstrap node, or a stranger's) keeps anything. The
        # defence is that every reader checks the envelope: nobody reads the forged round under the victim's name.
        inflator.dht.store(peers_key(swarm.run_id), envelope, get_dht_time() + 3600, subkey=victim)
        # ... and the victim stays visible: the validating nodes refused the forgery and still answer with its own
        # record (a reader once dropped the stock node's whole reply with the forgery in it: test_dht_entries.py).
        # Visible to a reader other than the forger: under load the forger's own node sometimes missed the victim for
        # the whole wait while another node polled beside it saw the victim every time (1 of 12 runs), most likely
        # because a hivemind node keeps what it stored itself (the forgery, an hour's expiry, newer than the victim's
        # record). An attacker blinding itself is no attack; what matters is that other readers keep the victim and
        # that nobody reads the forged round.
        def victim_seen() -> bool:
            forger_view = inflator.call(inflator.fetch_records(timeout=5), timeout=10)
            seen = claimer.call(claimer.fetch_records(timeout=5), timeout=10)
            for view in (forger_view, seen):
                assert victim not in view or view[victim].round < 1000, view[victim]
            return victim in seen

        swarm.wait_for(victim_seen, 30, "the victim's own record beside the forged one")

        # Every honest peer refuses the strangers' join requests and state downloads (revocations are read from
        # the DHT every few seconds, so the revoked peer is refused within a heartbeat or two).
        deadline = time.monotonic() + 60
        for why, node in strangers.items():
            for peer in honest_ids:
                while True:
                    reply = node.call(_ask_join(node, peer, fingerprint), timeout=30)
                    if reply.status == pb.JoinReply.NOT_ADMITTED or time.monotonic() > deadline:
                        break
                    time.sleep(1)
                assert reply.status == pb.JoinReply.NOT_ADMITTED, (why, reply)
                header = node.call(ask_state(node, peer, fingerprint, length=1), timeout=60)
                assert not header.ok and "not admitted" in header.message, (why, header)
        swarm.wait_for(lambda: all(len(swarm.committed(n)) >= 6 for n in HONEST), 300,
                       "six certified rounds on every honest peer")
        assert all(code == 0 for code in swarm.stop(HONEST).values()), swarm.tails()
        stop_following.set()
        follower.join(15)
        seen = inflator.call(inflator.fetch_records(timeout=5), timeout=10)
        assert not ({strangers["no ticket"].peer_id, strangers["revoked"].peer_id} & set(seen))
    finally:
        for node in hostile:
            node.shutdown()

    committed = assert_no_split(swarm, HONEST)
    last = max(committed)
    assert sorted(committed) == list(range(1, last + 1)) and 6 <= last < ROUND_CAP, committed  # none skipped to 1001
    for name in HONEST:
        summary = swarm.summary(name)
        assert summary["state_hash"] in committed.values(), summary  # every peer stopped on the one certified chain
        assert summary["rounds"] >= 6 and math.isfinite(summary["final_eval_loss"]), summary
        assert summary["final_eval_loss"] < summary["initial_eval_loss"]
        assert not [e for e in swarm.events(name, "resync") if e["round"] >= 1000]
    assert victim in _peer_ids(swarm).values()
    # The claimer leads some views and holds whoever joins it: each costs that view. Its far view moves nobody on
    # (one record is no majority), and it never leads a committed round.
    leaders = {e["leader"] for n in HONEST for e in swarm.events(n, "round") if e.get("outcome") == "committed"}
    assert leaders <= set(_peer_ids(swarm).values()), leaders


def _numel_of(swarm: Swarm) -> int:
    r = replica(swarm.preset)
    return sum(r.global_params[n].numel() for n in r.names)


def _wait_for_records(node: SwarmNode, n: int, *, all_ids: bool = False, exclude: frozenset[str] = frozenset()) -> Any:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        records = node.call(node.fetch_records(timeout=5), timeout=10)
        honest = [p for p, r in records.items() if r.round < 1000 and r.view < MAX_VIEW and p not in exclude]
        if len(honest) >= n:
            return honest if all_ids else honest[0]
        time.sleep(0.5)
    raise AssertionError("honest records not seen")


def _committed_on(swarm: Swarm, name: str, chain: dict[int, str]) -> bool:
    """`name` re-synced and then committed a round of `chain` (round -> hash)."""
    resyncs = swarm.events(name, "resync")
    after = {r: h for r, h in swarm.committed(name).items() if resyncs and r > resyncs[0]["round"]}
    return any(chain.get(r) == h for r, h in after.items())


def test_a_split_swarm_certifies_both_sides_and_heals_into_one_chain(swarm: Swarm) -> None:
    """Two halves on two DHTs that do not know each other each certify their own rounds (each sees a swarm of two).
    A bridge node then joins the DHTs: every peer sees both chains and applies the same fork choice, so the half with
    less certified work re-syncs to the other's state, keeping its local progress, and all four end on one chain."""
    other = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    other_bootstrap = [str(m) for m in other.get_visible_maddrs()]
    names, heavy_half, light_half = ["h1", "h2", "l1", "l2"], ["h1", "h2"], ["l1", "l2"]
    bridge = None
    try:
        # ROUND_CAP is a cap, not the test's length: every peer is stopped once the light half commits on the heavy
        # chain (a fixed count of rounds could all be over on the heavy side before the bridge is up). The light
        # half's steps are stretched 40x by sleeping, so it certifies fewer rounds. The heavy half is not paced: its
        # rounds take well under a second, shorter than a re-sync, so the light peers' downloads only end on the
        # heavy chain because a donor that moved on hands over its newer certified state (docs/reliability.md, 4a).
        for name in heavy_half:
            swarm.start(name, rounds=ROUND_CAP, wait_for=2, inner_steps=5)
        for name in light_half:
            swarm.start(name, "--slowdown", "40", rounds=ROUND_CAP, wait_for=2, inner_steps=5,
                        bootstrap=other_bootstrap)
        swarm.wait_for(lambda: len(swarm.committed("h1")) >= 2 and len(swarm.committed("l1")) >= 1, 240,
                       "both halves to certify rounds on their own")
        heavy, light = swarm.committed("h1"), swarm.committed("l1")
        assert heavy[1] != light[1]  # two histories: the halves never averaged together
        bridge = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                              initial_peers=swarm.bootstrap + other_bootstrap)
        swarm.wait_for(lambda: all(_committed_on(swarm, n, assert_no_split(swarm, heavy_half)) for n in light_half),
                       240, "the light half to re-sync to the heavy chain and commit on it")
        assert all(code == 0 for code in swarm.stop(names).values()), swarm.tails()
    finally:
        if bridge is not None:
            bridge.shutdown()
        other.shutdown()
    chain = assert_no_split(swarm, heavy_half)
    finals = {n: swarm.summary(n)["state_hash"] for n in names}
    assert set(finals.values()) <= set(chain.values()), {n: h[:12] for n, h in finals.items()}
    assert not [e for n in heavy_half for e in swarm.events(n, "resync") if e["round"] <= 2], \
        "the heavier half gave up its own chain"
    assert all(math.isfinite(swarm.summary(n)["final_eval_loss"]) for n in names)
