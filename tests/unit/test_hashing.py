"""Canonical state hash, a digest tree over the served blob: equal states hash equal; any single-element, name,
dtype, shape or order change changes it; hashing the tensors and hashing the packed blob give the same root."""
from __future__ import annotations

import torch

from swarmloco.protocol.base.hashing import (
    LEAF_BYTES,
    blob_hash,
    hash_tensors,
    known_leaves,
    leaf_digests,
    pack_state,
    state_hash,
    state_layout,
    unpack_state,
)


def _state(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = {"a.weight": torch.randn(5, 4, generator=g), "b.bias": torch.randn(7, generator=g)}
    return params, {k: torch.zeros_like(v) for k, v in params.items()}


def test_same_state_same_hash_in_the_served_order_and_by_value() -> None:
    params, mom = _state()
    names = list(params)
    reordered = {k: params[k].clone() for k in reversed(names)}
    assert state_hash(params, mom) == state_hash(reordered, {k: v.clone() for k, v in mom.items()}, names)
    assert state_hash(params, mom) != state_hash(params, mom, list(reversed(names)))  # the order is served, hashed
    # non-contiguous views hash by value
    t = torch.randn(4, 6)
    assert hash_tensors({"x": t.t()}) == hash_tensors({"x": t.t().contiguous()})


def test_any_single_element_change_changes_hash() -> None:
    params, mom = _state()
    base = state_hash(params, mom)
    seen = {base}
    for group in (params, mom):
        for _name, tensor in group.items():
            for i in range(tensor.numel()):
                flat = tensor.view(-1)
                old = flat[i].item()
                flat[i] = torch.nextafter(torch.tensor(old), torch.tensor(float("inf")))
                h = state_hash(params, mom)
                assert h not in seen
                seen.add(h)
                flat[i] = old
    assert state_hash(params, mom) == base


def test_params_and_momentum_are_separate_namespaces() -> None:
    params, mom = _state()
    assert state_hash(params, mom) != state_hash(mom, params)


def test_dtype_and_shape_are_part_of_the_hash() -> None:
    t = torch.zeros(6)
    assert hash_tensors({"x": t}) != hash_tensors({"x": t.double()})
    assert hash_tensors({"x": t}) != hash_tensors({"x": t.view(2, 3)})


def test_tree_of_tensors_equals_tree_of_the_packed_blob_across_leaf_boundaries() -> None:
    g = torch.Generator().manual_seed(1)
    shapes = {"e": torch.Size([LEAF_BYTES // 4 - 3]), "w": torch.Size([3, LEAF_BYTES // 8 + 5]), "b": torch.Size([9])}
    names = list(shapes)
    params = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    mom = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    root = state_hash(params, mom, names)
    blob = pack_state(params, mom, names)
    layout = state_layout(shapes, names)
    assert layout.total_bytes == len(blob) and layout.leaves == -(-len(blob) // LEAF_BYTES) > 4
    leaves = leaf_digests([blob])
    assert blob_hash(blob, shapes, names) == root == layout.root(leaves)
    assert known_leaves(root) == tuple(leaves)  # a donor serves these without hashing again
    assert layout.root(leaves[:-1]) == "" and layout.root([*leaves[:-1], b"x" * 32]) != root
    assert blob_hash(blob[:-4], shapes, names) == ""
    p2, m2 = unpack_state(bytearray(blob), shapes, names)
    assert state_hash(p2, m2, names) == root
