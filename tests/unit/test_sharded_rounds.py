"""The sharded reduce on the in-memory transport: many members, lossy codecs, and the faults that lose a shard —
a member dying mid-reduce, a malformed part, a reducer sending a malformed result. A lost shard loses the round for
everyone: nobody keeps an average with a hole in it."""
from __future__ import annotations

import asyncio

import pytest
import torch
from _fake_rounds import H0, NUMEL, by_rank, peers, round_from_heads, whole_round

from swarmloco.protocol.base.codecs import Codec, get_codec
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.round.config import LocalModel
from swarmloco.protocol.round.plans import shard_bounds
from swarmloco.protocol.round.schedule import view_leader
from swarmloco.protocol.testing.fake import FakeNetwork

pytestmark = pytest.mark.timeout(60)


def test_eight_members_each_reduce_one_shard_and_agree_bit_for_bit(net: FakeNetwork) -> None:
    # 64 Ki elements: large enough that the signed headers and the audit's scalars (a few KB per member) are small
    # next to the data, so the byte count below measures the data path
    numel = 64 * 1024 + 1000
    model = LocalModel(fingerprint="fp", config={"numel": numel}, numel=numel)
    averagers = peers(net, 8, quorum=8, codec="int8", model=model)
    results, applied = whole_round(averagers, tokens=lambda i: 10 * (i + 1))
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 8, [r.reason for r in results]
    # every shard has one source, so even with a lossy codec every member applies the same bytes
    assert all(torch.equal(a.calls[0], applied[0].calls[0]) for a in applied)
    weights = {p: w for p, w in zip(results[0].members, results[0].weights, strict=True)}
    ids = [a.transport.peer_id for a in averagers]
    exact = sum(weights[ids[i]] * (i + 1.0) for i in range(8)) / sum(weights.values())
    assert torch.allclose(applied[0].calls[0], torch.full((numel,), exact), rtol=0.02)
    encoded = get_codec("int8").encoded_size(numel)
    assert sum(r.bytes_sent for r in results) == sum(r.bytes_received for r in results)
    # each link carries about 2 (N - 1) / N of the encoded vector (plus frame headers), nowhere N - 1 times it
    assert all(r.bytes_sent < 2 * 7 / 8 * encoded * 1.5 and r.pipes == 7 for r in results), \
        [(r.bytes_sent, encoded) for r in results]


def test_a_member_dying_mid_reduce_leaves_every_survivor_on_one_state(net: FakeNetwork) -> None:
    """It sent its parts, then died, so its own shard is never reduced. No survivor may apply an average the others
    do not: either the loss is found in the results exchange and every survivor commits the round reduced again
    without it (backup reducers), or it is found earlier (the settle, the leader's link to it) and every survivor
    discards the round and certifies it in a later view. Which one depends on which survivor's thread notices the
    death first, so both are checked; before backup reducers it was always the second (and before shards, a star's
    leader averaged without it and committed alone)."""
    averagers = by_rank(peers(net, 4, quorum=3))
    victim = averagers[2].transport.peer_id

    class DieAfterSending(Hooks):
        def after_send(self, round_number: int) -> None:  # runs on the network's loop: kill from there
            asyncio.ensure_future(net._kill(victim))

    averagers[2].hooks = DieAfterSending()
    averagers[2].steps.hooks = averagers[2].hooks  # type: ignore[union-attr]
    results, applied = whole_round(averagers)
    survivors = [(r, a) for r, a, av in zip(results, applied, averagers, strict=True) if av.transport.peer_id != victim]
    alive = [av for av in averagers if av.transport.peer_id != victim]
    outcomes = {r.outcome for r, _ in survivors}
    assert len(outcomes) == 1, [(r.outcome, r.reason) for r, _ in survivors]
    if outcomes == {Outcome.COMMITTED}:
        assert len({r.state_hash for r, _ in survivors}) == 1 and all(av.head.round == 1 for av in alive)
        assert all(victim not in r.members for r, _ in survivors), survivors
        return
    assert outcomes == {Outcome.DISCARDED}, [r.reason for r, _ in survivors]
    assert all(not a.holds_new_state for _, a in survivors)
    assert all(av.head.round == 0 for av in alive)
    # Every survivor was in the lost group, so all of them move on to the next view together, and certify the round
    # around that view's leader (nobody skips anyone on its own judgement).
    again, _ = round_from_heads(alive, attempts=3)
    assert [r.outcome for r in again] == [Outcome.COMMITTED] * 3, [r.reason for r in again]
    views = {av.matchmaker.views.current for av in alive}  # type: ignore[union-attr]
    assert len(views) == 1 and views != {0}, views
    assert {r.leader for r in again} == {view_leader(H0, views.pop(), [av.transport.peer_id for av in alive])}


class _BadResultCodec(Codec):
    """Encodes its member's parts honestly, then its reduced shard one element short: a hostile reducer."""

    def __init__(self, parts: int) -> None:
        super().__init__("fp32", lossless=True)
        object.__setattr__(self, "left", parts)

    def encode(self, flat: torch.Tensor) -> bytes | memoryview:
        object.__setattr__(self, "left", self.left - 1)  # type: ignore[attr-defined]
        data = bytes(super().encode(flat))
        return data if self.left >= 0 else data[:-4]  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["everywhere", "own shard"])
def test_a_malformed_part_drops_its_sender_from_every_shard_and_the_round_commits(net: FakeNetwork,
                                                                                  where: str) -> None:
    """One member sends NaN: every reducer refuses its part, the leader settles on the three others, and the round
    is certified without it (before settling, one bad part would have lost every round). A NaN only in the shard
    the member reduces itself is caught by its own check of its own part, not by anyone else's."""
    averagers = by_rank(peers(net, 4, quorum=3))
    bad = averagers[3]
    own = shard_bounds(NUMEL, [0.25] * 4)
    k = sorted(a.transport.peer_id for a in averagers).index(bad.transport.peer_id)

    class NaNs(Hooks):
        def contribution(self, round_number: int, delta: torch.Tensor, tokens: int, *,
                         leader: bool = False) -> tuple[torch.Tensor, int]:
            if where == "everywhere":
                return torch.full_like(delta, float("nan")), tokens
            poisoned = delta.clone()
            poisoned[(own[k] + own[k + 1]) // 2] = float("nan")
            return poisoned, tokens

    bad.hooks = NaNs()
    results, applied = whole_round(averagers)
    good = [r for r, a in zip(results, averagers, strict=True) if a is not bad]
    assert all(r.outcome == Outcome.COMMITTED for r in good), [r.reason for r in results]
    assert all(bad.transport.peer_id not in r.members and len(r.members) == 3 for r in good)
    assert "malformed part" in good[0].excluded[bad.transport.peer_id], good[0].excluded
    assert all(not torch.isnan(a.calls[0]).any() for a in applied)
    assert len({r.certificate.statement for r in good}) == 1  # type: ignore[union-attr]


def test_a_reducer_sending_a_malformed_shard_loses_the_round_for_everyone(net: FakeNetwork) -> None:
    averagers = peers(net, 3, quorum=3)
    averagers[1].steps.codec = _BadResultCodec(parts=2)  # type: ignore[union-attr]
    results, applied = whole_round(averagers)
    others = [r for i, r in enumerate(results) if i != 1]
    assert all(r.outcome == Outcome.DISCARDED for r in others), [r.reason for r in results]
    assert all("malformed result" in r.reason for r in others), [r.reason for r in others]
    assert not any(a.holds_new_state for a in applied)
    assert all(a.head.round == 0 for a in averagers)


def test_a_member_whose_shard_is_empty_takes_part_and_the_round_commits(net: FakeNetwork,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A small vector cut by bandwidth can leave a reducer nothing to reduce (shard_bounds allows an empty shard).
    Its own part of that shard is empty, which is finite: it still sends its parts, takes part in the audit, and
    the round commits. (Checking the empty part with aminmax raised, and every such round was discarded.)"""
    from swarmloco.protocol.round import steps

    monkeypatch.setattr(steps, "bandwidth_shares", lambda bandwidths: [0.0] + [1.0 / (len(bandwidths) - 1)] *
                        (len(bandwidths) - 1))
    averagers = peers(net, 3, quorum=3)
    results, applied = whole_round(averagers)
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 3, [r.reason for r in results]
    assert shard_bounds(NUMEL, [0.0, 0.5, 0.5])[:2] == (0, 0)  # the first reducer's shard is empty
    assert all(torch.allclose(a.calls[0], torch.full((NUMEL,), 2.0)) for a in applied)
