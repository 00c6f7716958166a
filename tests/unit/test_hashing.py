"""Canonical state hash: equal states hash equal; any single-element change, name or dtype changes it."""
from __future__ import annotations

import torch

from protocol.hashing import hash_tensors, state_hash


def _state(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = {"a.weight": torch.randn(5, 4, generator=g), "b.bias": torch.randn(7, generator=g)}
    return params, {k: torch.zeros_like(v) for k, v in params.items()}


def test_same_state_same_hash_regardless_of_order_and_copy() -> None:
    params, mom = _state()
    reordered = {k: params[k].clone() for k in reversed(list(params))}
    assert state_hash(params, mom) == state_hash(reordered, {k: v.clone() for k, v in mom.items()})
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
