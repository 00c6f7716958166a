"""Sybils that certify a fabricated state: admitted identities (free, in an open run) sign among themselves a
certificate for a rescaled θ far ahead of the honest chain, claim it with the most work and serve it.

The certificate is valid: enough admitted signers, a swarm they are a majority of, work that outranks the honest
chain. So fork choice picks it and every honest peer downloads it; what stops it is the check before adopting
(peer/adoption.py): the state's loss on the peer's own held-out batches is far worse than its own state's. The
attack comes twice: three signers while the honest peers are still at θ_0 (a joiner compares against θ_0), then ten
signers after the honest swarm has certified rounds. Without that check, the honest peers adopt the first state
(as they did in an open run, before it existed).
"""
from __future__ import annotations

import secrets
from typing import Any

import pytest
from _hostile_nodes import announce as _announce
from _hostile_nodes import fingerprint as _fingerprint
from _hostile_nodes import key as _key
from _hostile_nodes import node as _node
from _hostile_nodes import serve as _serve
from _hostile_nodes import ticket as _ticket
from swarm_harness import Swarm, assert_no_split, replica

from swarmloco.protocol.chain.state_sync import ServedState
from swarmloco.protocol.network.node import SwarmNode
from swarmloco.protocol.trust.certificates import Certificate, Statement

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
HONEST = ["a", "b", "c"]


def _fabricated(swarm: Swarm, scale: float) -> tuple[bytes, str]:
    """θ_0 of the swarm's model times `scale`, zero momentum: finite, well formed, and useless."""
    from swarmloco.peer.swarm_state import state_blob

    r = replica(swarm.preset)
    r.load_global({n: t * scale for n, t in r.global_params.items()}, r.momentum, 0, keep_local=False)
    return state_blob(r), r.state_hash()


def _attack(swarm: Swarm, fingerprint: str, *, tag: str, signers: int, round_number: int,
            scale: float) -> tuple[SwarmNode, str]:
    """`signers` admitted identities certify a fabricated state at `round_number`; one of them claims and serves
    it (a signer needs no record of its own). Returns the serving node and the state's hash."""
    blob, state_hash = _fabricated(swarm, scale)
    keys = {n: _key(swarm, n) for n in (f"{tag}-{i}" for i in range(signers))}
    ids = sorted(keys.values(), key=lambda i: i.peer_id)
    tickets = {n: _ticket(swarm, n) for n in keys}
    by_id = {k.peer_id: n for n, k in keys.items()}
    statement = Statement(run_id=swarm.run_id, round=round_number, prev_hash=secrets.token_hex(32),
                          new_hash=state_hash, members=tuple(i.peer_id for i in ids),
                          weights=tuple(10**9 for _ in ids), swarm=signers, work=10**14 + round_number)
    cert = Certificate(statement, {i.peer_id: Certificate.sign(i, statement) for i in ids},
                       {i.peer_id: tickets[by_id[i.peer_id]].decode() for i in ids})
    server = _node(swarm, by_id[ids[0].peer_id], ticket=tickets[by_id[ids[0].peer_id]])
    _serve(server, fingerprint, ServedState(round=round_number, state_hash=state_hash, blob=blob,
                                            certificate=cert.to_bytes()))
    _announce(server, fingerprint, round_number, state_hash, work=statement.work)
    return server, state_hash


def _refused(swarm: Swarm, name: str, state_hash: str) -> list[dict[str, Any]]:
    return [e for e in swarm.events(name, "refused") if e["state_hash"] == state_hash[:12]]


def test_sybils_certifying_a_fabricated_state_are_refused(swarm: Swarm) -> None:
    for name in HONEST:
        # The first sybil's record makes the fourth compatible peer: the honest peers start training only once the
        # fabricated claim is up, so they meet it at θ_0.
        swarm.start(name, "--round-timeout", "20", rounds=40, wait_for=4, inner_steps=10)
    fingerprint = _fingerprint(swarm)
    hostile: list[SwarmNode] = []
    try:
        node, early = _attack(swarm, fingerprint, tag="early", signers=3, round_number=500, scale=4.0)
        hostile.append(node)
        swarm.wait_for(lambda: all(_refused(swarm, n, early) for n in HONEST), 180,
                       "every honest peer to refuse the state certified by three sybils")
        swarm.wait_for(lambda: all(len(swarm.committed(n)) >= 3 for n in HONEST), 180, "three certified rounds")
        node, late = _attack(swarm, fingerprint, tag="late", signers=10, round_number=900, scale=0.25)
        hostile.append(node)
        swarm.wait_for(lambda: all(_refused(swarm, n, late) for n in HONEST), 180,
                       "every honest peer to refuse the state certified by ten sybils")
        done = max(max(swarm.committed(n)) for n in HONEST) + 3
        swarm.wait_for(lambda: all(max(swarm.committed(n)) >= done for n in HONEST), 180,
                       "three more certified rounds after the second attack")
        assert all(code == 0 for code in swarm.stop(HONEST).values()), swarm.tails()
    finally:
        for node in hostile:
            node.shutdown()

    committed = assert_no_split(swarm, HONEST)
    assert sorted(committed) == list(range(1, max(committed) + 1)), committed  # never jumped to round 500 or 900
    for name in HONEST:
        assert not [e for e in swarm.events(name, "resync") if e["round"] >= 500], name
        for state_hash in (early, late):
            refusal = _refused(swarm, name, state_hash)[0]
            assert "held-out loss" in refusal["why"] and refusal["loss"] > refusal["own_loss"], refusal
        first_round = min(e["time"] for e in swarm.events(name, "round"))
        assert _refused(swarm, name, early)[0]["time"] < first_round  # refused while still at θ_0
        summary = swarm.summary(name)
        assert summary["state_hash"] in committed.values() and summary["final_eval_loss"] < summary["initial_eval_loss"]
