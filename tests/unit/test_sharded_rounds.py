"""The sharded reduce on the in-memory transport: many members, lossy codecs, and the faults that lose a shard —
a member dying mid-reduce, a malformed part, a reducer sending a malformed result. A lost shard loses the round for
everyone: nobody keeps an average with a hole in it."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from _fake_rounds import NUMEL, by_rank, peers, whole_round

from protocol.codecs import Codec, get_codec
from protocol.hooks import Hooks
from protocol.rounds import Outcome
from protocol.testing.fake import FakeNetwork

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def net() -> Iterator[FakeNetwork]:
    with FakeNetwork() as n:
        yield n


def test_eight_members_each_reduce_one_shard_and_agree_bit_for_bit(net: FakeNetwork) -> None:
    averagers = peers(net, 8, quorum=8, codec="int8")
    results, applied = whole_round(averagers, tokens=lambda i: 10 * (i + 1))
    assert [r.outcome for r in results] == [Outcome.COMMITTED] * 8, [r.reason for r in results]
    # every shard has one source, so even with a lossy codec every member applies the same bytes
    assert all(torch.equal(a.calls[0], applied[0].calls[0]) for a in applied)
    weights = {p: w for p, w in zip(results[0].members, results[0].weights, strict=True)}
    ids = [a.transport.peer_id for a in averagers]
    exact = sum(weights[ids[i]] * (i + 1.0) for i in range(8)) / sum(weights.values())
    assert torch.allclose(applied[0].calls[0], torch.full((NUMEL,), exact), rtol=0.02)
    encoded = get_codec("int8").encoded_size(NUMEL)
    assert sum(r.bytes_sent for r in results) == sum(r.bytes_received for r in results)
    # each link carries about 2 (N - 1) / N of the encoded vector (plus frame headers), nowhere N - 1 times it
    assert all(r.bytes_sent < 2 * 7 / 8 * encoded * 1.5 and r.pipes == 7 for r in results), \
        [(r.bytes_sent, encoded) for r in results]


def test_a_member_dying_mid_reduce_loses_the_round_for_everyone(net: FakeNetwork) -> None:
    """It sent its parts, then died: its own shard is never reduced, so no survivor can assemble the average and
    none applies it (before, a star's leader would have averaged without it and committed)."""
    averagers = by_rank(peers(net, 4, quorum=3))
    victim = averagers[2].transport.peer_id

    class DieAfterSending(Hooks):
        def after_send(self, round_number: int) -> None:  # runs on the network's loop: kill from there
            asyncio.ensure_future(net._kill(victim))

    averagers[2].hooks = DieAfterSending()
    averagers[2].steps.hooks = averagers[2].hooks  # type: ignore[union-attr]
    results, applied = whole_round(averagers)
    survivors = [(r, a) for r, a, av in zip(results, applied, averagers, strict=True) if av.transport.peer_id != victim]
    assert all(r.outcome == Outcome.DISCARDED for r, _ in survivors), [r.reason for r, _ in survivors]
    assert all(not a.holds_new_state for _, a in survivors)
    assert all(av.head.round == 0 for av in averagers if av.transport.peer_id != victim)


class _TruncatingCodec(Codec):
    """Encodes one element short: what a hostile member (or a hostile reducer) sends."""

    def encode(self, flat: torch.Tensor) -> bytes | memoryview:
        return bytes(super().encode(flat))[:-4]


def test_a_malformed_shard_from_one_member_loses_the_round_for_everyone(net: FakeNetwork) -> None:
    averagers = peers(net, 3, quorum=3)
    averagers[1].steps.codec = _TruncatingCodec("fp32", lossless=True)  # type: ignore[union-attr]
    results, applied = whole_round(averagers)
    assert [r.outcome for r in results] == [Outcome.DISCARDED] * 3, [r.reason for r in results]
    assert any("malformed" in r.reason for r in results), [r.reason for r in results]
    assert not any(a.holds_new_state for a in applied)
    assert all(a.head.round == 0 for a in averagers)
