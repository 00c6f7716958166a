"""A training peer watches the swarm from its network loop, on a timer of its own, not between its steps.

A peer on slow hardware (or a loaded machine) takes seconds per step. When it looked at the records only after a
step and read the answer after the next, it saw a forming group two steps late, and the leader, whose grace waits
for peers that say they are about to be ready, had closed without it; and its record said "ready in 60 s" for the
whole first step of every round. Here a step is `STEP_S` of virtual time (the fake network's clock).
"""
from __future__ import annotations

import time
import types
from collections.abc import Awaitable, Callable

import pytest

from swarmloco.peer.config import PeerConfig
from swarmloco.peer.round_watch import ETA_EVERY_S, PEEK_S, RoundWatch
from swarmloco.peer.training import TrainingLoop
from swarmloco.protocol.base.records import PeerRecord
from swarmloco.protocol.testing.fake import FakeNetwork, FakeTransport

STEP_S = 3.0
FAR = 1e6  # an eta budget far away: what a peer publishes then is its close-early promise


def _train(net: FakeNetwork, watch: RoundWatch, *, max_steps: int = 10) -> int:
    """The training thread's loop: a step, then a look at the flag; how many steps it took."""
    steps = 0
    while steps < max_steps:
        net.sleep(STEP_S)
        steps += 1
        if watch.seen():
            break
    return steps


def _forming_after(net: FakeNetwork, at: float) -> Callable[[], Awaitable[bool]]:
    async def forming() -> bool:
        return net.clock.monotonic() >= at
    return forming


def _peer(net: FakeNetwork) -> FakeTransport:
    """A fake peer holding θ_0, its record published (a watch only changes the record's `eta`)."""
    peer = net.peer()
    record = PeerRecord.announce(fingerprint="f", config_json="{}", round=0, state_hash="00" * 32,
                                 now=net.clock.time())
    peer.update_record(**record.to_value())
    return peer


def _eta(net: FakeNetwork, peer: FakeTransport) -> float:
    record = peer.own_record()
    assert record is not None
    return record.eta - net.clock.time()


def test_a_group_seen_mid_step_stops_training_after_that_step() -> None:
    """A group starts forming 0.2 s into the peer's second step: it stops after that step, not one look later."""
    with FakeNetwork() as net:
        peer = _peer(net)
        watch = RoundWatch(peer, eta=lambda: net.clock.time() + FAR, step_s=lambda: STEP_S,
                           forming=_forming_after(net, net.clock.monotonic() + STEP_S + 0.2)).start()
        try:
            assert _train(net, watch) == 2
        finally:
            watch.stop()


def test_the_ready_time_counts_the_step_in_flight_and_is_published_while_it_runs() -> None:
    with FakeNetwork() as net:
        peer = _peer(net)
        watch = RoundWatch(peer, eta=lambda: net.clock.time() + FAR, step_s=lambda: STEP_S,
                           forming=_forming_after(net, net.clock.monotonic() + 5.0)).start()
        try:
            net.sleep(1.5)  # mid-step, nothing forming: a look and the rest of a step away, not its budget
            assert _eta(net, peer) == pytest.approx(2 * PEEK_S + STEP_S, abs=ETA_EVERY_S)
            assert net.until(watch.seen, timeout=10)  # seen: joining once the step in flight ends
            assert _eta(net, peer) == pytest.approx(STEP_S, abs=0.01)
        finally:
            watch.stop()


def test_a_peer_that_never_ends_early_publishes_its_budget_and_never_looks() -> None:
    with FakeNetwork() as net:
        peer = _peer(net)
        budget_end = net.clock.time() + 40.0
        watch = RoundWatch(peer, eta=lambda: budget_end, step_s=lambda: STEP_S, forming=None).start()
        try:
            net.sleep(2.5)
            assert _eta(net, peer) == pytest.approx(40.0 - 2.5, abs=0.01)
            assert not watch.seen()
        finally:
            watch.stop()


def test_a_failed_look_is_followed_by_another_and_nothing_is_published_after_stop() -> None:
    with FakeNetwork() as net:
        peer, looks = _peer(net), []

        async def forming() -> bool:
            looks.append(1)
            if len(looks) < 3:
                raise TimeoutError("records read timed out")
            return True

        later = [net.clock.time() + 20.0]
        watch = RoundWatch(peer, eta=lambda: later[0], step_s=lambda: STEP_S, forming=forming).start()
        assert net.until(watch.seen, timeout=10) and len(looks) == 3
        watch.stop()
        published = _eta(net, peer)
        later[0] += 100.0
        net.sleep(3 * ETA_EVERY_S)
        assert _eta(net, peer) == pytest.approx(published - 3 * ETA_EVERY_S, abs=0.01)


def test_a_rounds_first_step_expects_the_step_time_of_the_rounds_before() -> None:
    """Before a round's first step the estimate was 60 s, whatever the peer's real pace: a leader then closed its
    group without a slow peer that would have been ready within its grace."""
    cfg = PeerConfig()
    replica = types.SimpleNamespace(round_steps=0, round_tokens=0, step=0)
    loop = TrainingLoop(replica, cfg, stop=types.SimpleNamespace())  # type: ignore[arg-type]
    assert loop.eta(0.0) - time.time() == pytest.approx(60, abs=1)  # nothing measured yet
    loop.step_times.extend([0.2, 0.3, 0.25])
    assert loop.eta(0.0) - time.time() == pytest.approx(cfg.train.inner_steps * 0.25, abs=0.5)


def test_an_estimate_that_fails_once_does_not_end_the_publishing() -> None:
    with FakeNetwork() as net:
        peer, calls = _peer(net), []

        def eta() -> float:
            calls.append(1)
            if len(calls) == 1:
                raise ZeroDivisionError("a counter read mid-update")
            return net.clock.time() + 20.0

        watch = RoundWatch(peer, eta=eta, step_s=lambda: STEP_S, forming=None).start()
        try:
            net.sleep(1.5 * ETA_EVERY_S)
            assert _eta(net, peer) == pytest.approx(20.0 - 0.5 * ETA_EVERY_S, abs=0.01)
        finally:
            watch.stop()
