"""Multi-peer integration tests: real peer processes over 127.0.0.1: a local swarm, joins, kills, stragglers, lying
donors, incompatible peers and bad senders.

After every round test: peers that completed a round hold the same state hash, losses are finite, and no process
the test started (p2pd included) is left running.
"""
from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
from conftest import run_cli
from swarm_harness import PRESET, Swarm, assert_no_split

from swarmloco.peer.presets import PRESETS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _finite_losses(swarm: Swarm, name: str) -> None:
    """The final state's eval loss (in the summary), and any per-round one the peer logged, are finite."""
    assert math.isfinite(swarm.summary(name)["final_eval_loss"]), swarm.summary(name)
    for e in swarm.events(name, "round"):
        if "eval_loss" in e:
            assert math.isfinite(e["eval_loss"]), e


def test_local_swarm_three_peers_three_rounds(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """The README's command: hashes equal after every round, eval loss falls, nothing left."""
    summary_path = tmp_path / "s.json"
    proc = run_cli(
        [
            "swarm",
            "--peers",
            "3",
            "--preset",  # the model the harness's peers train too: the launcher and the rounds are what is tested
            PRESET,
            "--rounds",
            "3",
            "--inner-steps",
            "10",
            "--no-coordinator",
            "--workdir",
            str(tmp_path / "w"),
            "--summary-json",
            str(summary_path),
            "--peer-arg=--batch-size=4",
            "--peer-arg=--warmup-steps=5",
            "--peer-arg=--inner-lr=1e-3",
            "--peer-arg=--grace-max=3",
        ],
        cli_env,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]
    for rnd in summary["rounds"]:
        assert rnd["outcome"] == "committed" and len(rnd["hashes"]) == 3 and len(set(rnd["hashes"].values())) == 1, rnd
    assert len(set(summary["final_state_hashes"].values())) == 1
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert all(math.isfinite(s["final_eval_loss"]) for s in summary["peer_summaries"].values())


def test_late_joiner_gets_verified_state_before_contributing(swarm: Swarm) -> None:
    """A peer joining at round 2 downloads the swarm's state, verified by hash, before it contributes."""
    # A cap, not the test's length: every peer is stopped once the joiner has committed two rounds (on a busy
    # machine its start can take many rounds of the others').
    swarm.start("a", rounds=40)
    swarm.start("b", rounds=40)
    swarm.wait_for(lambda: 2 in swarm.committed("a"), 150, "round 2 on a")
    swarm.start("c", rounds=40)
    swarm.wait_for(lambda: len(swarm.committed("c")) >= 2, 200, "two rounds committed by the joiner")
    assert all(code == 0 for code in swarm.stop(["a", "b", "c"]).values()), swarm.tails()
    hashes = assert_no_split(swarm, ["a", "b", "c"])
    events = [e for e in swarm.events("c") if e["event"] in ("resync", "round")]
    assert events and events[0]["event"] == "resync", events[:3]
    first = events[0]
    assert first["round"] >= 2 and hashes[first["round"]].startswith(first["state_hash"])
    joined = [r for r in swarm.committed("c") if r > first["round"]]
    assert len(joined) >= 2 and set(joined) <= set(swarm.committed("a")) | set(swarm.committed("b")), joined
    for name in ("a", "b", "c"):  # every peer stopped on the one certified chain
        assert swarm.summary(name)["state_hash"] in hashes.values(), (name, swarm.summary(name))


def test_peer_killed_during_inner_steps(swarm: Swarm) -> None:
    """SIGKILL one of three peers while it trains; the survivors complete the next rounds."""
    swarm.start("a", rounds=4, wait_for=3)
    swarm.start("b", rounds=4, wait_for=3)
    swarm.start("c", rounds=4, faults="inner_step=kill@1")
    codes = swarm.wait_exit(220)
    assert codes["c"] == -signal.SIGKILL
    assert swarm.events("c", "fault"), "the fault never fired"
    hashes = assert_no_split(swarm, ["a", "b"])
    assert max(hashes) == 4 and codes["a"] == 0 and codes["b"] == 0
    after_kill = [e for e in swarm.events("a", "round") if e.get("outcome") == "committed" and e["round"] >= 2]
    assert after_kill and all(e["member_count"] == 2 for e in after_kill)
    _finite_losses(swarm, "a")


def test_leader_killed_mid_averaging_all_members_discard(swarm: Swarm) -> None:
    """The leader dies after averaging but before anyone has the result: every member discards the
    round, nobody applies half of it, and the survivors go on to commit the round together."""
    (id_low, low), (_, mid), (_, high) = swarm.identities(3)
    # The doomed leader insists on all three (quorum 3), so both others are in the group it abandons. It leads the
    # first view (the best rank) as long as it is ready in time to be a candidate; the others train 10x slower
    # (sleeping, not computing), so it is ready first, and the first peer ready is always a candidate.
    swarm.start("leader", "--quorum", "3", identity=low, faults="leader_before_commit=kill", rounds=3, wait_for=3)
    swarm.start("b", "--slowdown", "10", identity=mid, rounds=3, wait_for=3)
    swarm.start("c", "--slowdown", "10", identity=high, rounds=3, wait_for=3)
    codes = swarm.wait_exit(240)
    assert codes["leader"] == -signal.SIGKILL and swarm.events("leader", "fault")
    for name in ("b", "c"):
        rounds = swarm.events(name, "round")
        aborted = [e for e in rounds if e["outcome"] == "discarded" and e.get("leader")]
        assert aborted and aborted[0]["leader"] == id_low and aborted[0]["member_count"] == 3, rounds
        assert codes[name] == 0
    hashes = assert_no_split(swarm, ["b", "c"])
    assert max(hashes) == 3


def test_member_killed_mid_averaging_survivors_agree(swarm: Swarm) -> None:
    """A member dies after sending its pseudo-gradient: all survivors apply the same result."""
    (_, low), (_, mid), (_, high) = swarm.identities(3)
    swarm.start("a", identity=low, rounds=3, wait_for=3)
    swarm.start("b", identity=mid, rounds=3, wait_for=3)
    # the first round it takes part in as a member (which round it leads, if any, depends on the certified seed)
    swarm.start("victim", identity=high, faults="member_after_send=kill", rounds=3, wait_for=3)
    codes = swarm.wait_exit(240)
    assert codes["victim"] == -signal.SIGKILL and swarm.events("victim", "fault")
    hashes = assert_no_split(swarm, ["a", "b"])
    assert max(hashes) == 3 and codes["a"] == 0 and codes["b"] == 0


def test_slow_peer_contributes_fewer_tokens_and_ends_on_the_swarm_state(swarm: Swarm) -> None:
    """A 10x slower peer with the same token budget does not hold the others back, yet contributes: it ends its
    local training early when a group for its round is forming (or the swarm moved on), so its tokens are in
    committed rounds, with less weight than the fast peers', and it ends on the swarm's final state. (10x: its
    budget takes it longer than the grace, however fast a step of the harness's model is.) It can join only groups
    whose grace outlasts a step of its own (it stops between steps), and under CI's load beside two burners a 40x
    step outlasted a 3 s grace: the grace is 8 s. Its looks run on its network loop, not between its steps
    (tests/unit/test_round_watch.py)."""
    (_, low), (_, mid), (slow_id, high) = swarm.identities(3)
    budget = ["--round-tokens", str(40 * 4 * PRESETS[swarm.preset].context), "--grace-max", "8"]
    swarm.start("a", *budget, identity=low, rounds=4, wait_for=3)
    swarm.start("b", *budget, identity=mid, rounds=4, wait_for=3)
    swarm.start("slow", *budget, "--slowdown", "10", identity=high, rounds=4, wait_for=3)
    codes = swarm.wait_exit(240)
    assert codes == {"a": 0, "b": 0, "slow": 0}, swarm.tails()
    fast = [e for e in swarm.events("a", "round") if e.get("outcome") == "committed"]
    assert len(fast) == 4 and max(e["wait_s"] for e in fast) < 15, fast
    led = [
        e
        for n in ("a", "b", "slow")
        for e in swarm.events(n, "round")
        if e.get("outcome") == "committed" and e.get("role") == "leader"
    ]
    with_slow = [e for e in led if slow_id in e.get("members", [])]
    assert len(with_slow) >= len(led) // 2, f"the slow peer's tokens are in {len(with_slow)} committed rounds: {led}"
    for e in with_slow:
        weights = dict(zip(e["members"], e["weights"], strict=False))
        assert 0 < weights[slow_id] < max(w for p, w in weights.items() if p != slow_id), e
    assert_no_split(swarm, ["a", "b", "slow"])
    assert swarm.summary("slow")["state_hash"] == swarm.summary("a")["state_hash"]


def test_lying_donor_rejected_by_hash(swarm: Swarm) -> None:
    """A donor serving corrupted state is rejected; the joiner verifies and uses the honest donor.

    Both donors finish their rounds and linger on the same final state, and the honest one answers its first
    download "busy": so the joiner certainly asks the liar and must reject its bytes. (While rounds still run, the
    joiner may see only one of them at the newest state, and a one-chunk state is served by whoever answers first.)
    """
    linger = ("--linger", "60")
    swarm.start("honest", *linger, faults="serve_session=busy", rounds=3)
    swarm.start("liar", *linger, faults="serve_state=corrupt", rounds=3)
    swarm.wait_for(lambda: all(swarm.events(n, "linger") for n in ("honest", "liar")), 150, "both donors done")
    assert swarm.committed("honest")[3] == swarm.committed("liar")[3]
    joiner = swarm.start("joiner", rounds=3)
    assert joiner.proc is not None and joiner.proc.wait(120) == 0, swarm.tails()
    resync = swarm.events("joiner", "resync")
    assert resync, swarm.tails()
    liar_id = swarm.events("liar", "joined")[0]["peer_id"]
    assert resync[0]["failures"] == [liar_id], "the corrupt donor's bytes were never rejected"
    assert swarm.events("honest", "fault"), "the honest donor never answered busy: the liar was not forced in"
    assert swarm.summary("joiner")["state_hash"] == swarm.committed("honest")[3]


def test_incompatible_peer_is_refused_with_reason(swarm: Swarm) -> None:
    """A peer with another model config is refused, and the message names what differs."""
    # A cap, not the test's length: a and b must still be up when the other peer looks (a few rounds of the
    # harness's model can be over before it has built its own); they are stopped once it has been refused.
    swarm.start("a", rounds=40)
    swarm.start("b", rounds=40)
    swarm.wait_for(lambda: bool(swarm.events("a", "joined")) and bool(swarm.events("b", "joined")), 90, "a and b up")
    other = swarm.start("other", "--preset", "small", rounds=3)
    assert other.proc is not None and other.proc.wait(120) == 3
    err = (other.workdir / "stderr.log").read_text()
    theirs = PRESETS[swarm.preset].d_model
    assert "the swarm trains a different model" in err and f"d_model: ours 320 vs theirs {theirs}" in err, err[-2000:]
    assert swarm.stop(["a", "b"]) == {"a": 0, "b": 0, "other": 3}, swarm.tails()


def test_bad_sender_excluded_round_succeeds(swarm: Swarm) -> None:
    """NaN parts: every reducer refuses its part, the leader settles the contributors without the sender, and the
    round still commits for everyone else. One real-process case; the other malformed contributions (wrong size,
    zero weight: refused at the claim) are covered on the in-memory transport (tests/unit/test_rounds.py,
    tests/unit/test_sharded_rounds.py)."""
    fault, reason = "nan", "malformed part"
    (_, low), (_, mid), (bad_id, high) = swarm.identities(3)
    swarm.start("a", identity=low, rounds=2, wait_for=3)
    swarm.start("b", identity=mid, rounds=2, wait_for=3)
    swarm.start("bad", identity=high, faults=f"contribute={fault}@0", rounds=2, wait_for=3)
    codes = swarm.wait_exit(200)
    assert codes == {"a": 0, "b": 0, "bad": 0}, swarm.tails()
    first = next(
        e
        for e in swarm.events("a", "round") + swarm.events("b", "round")
        if e.get("role") == "leader" and e["round"] == 1
    )
    assert bad_id in first["excluded"] and reason in first["excluded"][bad_id], first
    assert first["member_count"] == 2
    assert_no_split(swarm, ["a", "b", "bad"])


def test_inflated_weight_is_capped(swarm: Swarm) -> None:
    """A member claiming 1e12 tokens is capped at weight_cap_factor × the group's median claim."""
    ids = swarm.identities(3)
    (_, low), (_, mid), (greedy_id, high) = ids
    swarm.start("a", identity=low, rounds=2, wait_for=3)
    swarm.start("b", identity=mid, rounds=2, wait_for=3)
    swarm.start("greedy", identity=high, faults="contribute=inflate@0", rounds=2, wait_for=3)
    swarm.wait_exit(200)
    first = next(
        e
        for e in swarm.events("a", "round") + swarm.events("b", "round")
        if e.get("role") == "leader" and e["round"] == 1
    )
    assert first["member_count"] == 3, first
    # the leader lists members sorted by id
    by_peer = dict(zip(sorted(pid for pid, _ in ids), first["weights"], strict=True))
    # the (lower) median of three claims, one of them 1e12, is the larger honest claim; its weight here may carry
    # a staleness discount (at most 0.5² with --max-staleness 2), hence 4 × 4
    median = max(w for p, w in by_peer.items() if p != greedy_id)
    assert 0 < by_peer[greedy_id] <= 16 * median + 1 and by_peer[greedy_id] < 10**6, first
    assert_no_split(swarm, ["a", "b", "greedy"])


def test_libp2p_fallback_without_data_plane(swarm: Swarm) -> None:
    """A peer that refuses the TCP data plane still averages with the others over libp2p streams."""
    swarm.start("a", rounds=2, wait_for=2)
    swarm.start("b", "--no-data-plane", rounds=2, wait_for=2)
    assert swarm.wait_exit(200) == {"a": 0, "b": 0}, swarm.tails()
    hashes = assert_no_split(swarm, ["a", "b"])
    assert sorted(hashes) == [1, 2]
    leader_rounds = [e for n in ("a", "b") for e in swarm.events(n, "round") if e.get("role") == "leader"]
    assert leader_rounds and all(e["direct"] == 0 for e in leader_rounds), leader_rounds
