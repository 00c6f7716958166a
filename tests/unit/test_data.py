"""Default corpus: deterministic, disjoint shards, a held-out eval split and step-keyed batches."""
from __future__ import annotations

import torch

from swarmloco.peer.data import ShardSpec, list_source_files, sample_batch, split_files


def test_shards_are_disjoint_deterministic_and_cover_the_corpus() -> None:
    files = list_source_files()
    assert len(files) > 500  # the stdlib has well over a thousand modules
    assert list_source_files() == files
    shards = [split_files(files, ShardSpec(index=i, count=4)) for i in range(4)]
    train_sets = [set(train) for train, _ in shards]
    eval_set = set(shards[0][1])
    assert all(set(ev) == eval_set for _, ev in shards)
    for i in range(4):
        assert train_sets[i], f"shard {i} is empty"
        assert not train_sets[i] & eval_set
        for j in range(i + 1, 4):
            assert not train_sets[i] & train_sets[j]
    assert set().union(*train_sets) | eval_set == set(files)
    assert 0.01 < len(eval_set) / len(files) < 0.10


def test_batches_depend_only_on_seed_shard_and_step() -> None:
    data = torch.arange(10_000, dtype=torch.int64).to(torch.uint8)
    a = sample_batch(data, batch_size=4, seq_len=32, seed=1, shard_index=0, step=7)
    b = sample_batch(data, batch_size=4, seq_len=32, seed=1, shard_index=0, step=7)
    c = sample_batch(data, batch_size=4, seq_len=32, seed=1, shard_index=0, step=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one


def test_bad_shard_spec_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="shard index: got 4"):
        ShardSpec(index=4, count=4)
