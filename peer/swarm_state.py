"""Bridges a Replica's named tensors and the protocol's flat views: pseudo-gradients as one fp32 vector, the
global state as one blob (θ then m) for donors, and re-basing local progress onto a newer global state."""
from __future__ import annotations

import json

import torch

from peer.replica import Replica
from protocol.group import LocalModel
from protocol.hashing import state_hash
from protocol.records import fingerprint


def local_model(replica: Replica, seed: int) -> LocalModel:
    config = {**dict(replica.task.config), "seed": seed}
    config = json.loads(json.dumps(config, sort_keys=True, default=str))
    layout = [(n, tuple(replica.global_params[n].shape)) for n in replica.names]
    numel = sum(replica.global_params[n].numel() for n in replica.names)
    return LocalModel(fingerprint=fingerprint(config, layout), config=config, numel=numel)


def flatten(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1).to(torch.float32) for n in names])


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for n in names:
        numel = like[n].numel()
        out[n] = flat[offset : offset + numel].view_as(like[n]).clone()
        offset += numel
    if offset != flat.numel():
        raise ValueError(f"flat tensor has {flat.numel()} elements, model needs {offset}")
    return out


def state_blob(replica: Replica) -> bytes:
    flat = torch.cat([flatten(replica.global_params, replica.names), flatten(replica.momentum, replica.names)])
    return flat.numpy().tobytes()


def parse_blob(blob: bytes, replica: Replica) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    flat = torch.frombuffer(bytearray(blob), dtype=torch.float32)
    half = flat.numel() // 2
    if flat.numel() != 2 * sum(replica.global_params[n].numel() for n in replica.names):
        raise ValueError(f"state blob of {len(blob)} bytes does not fit this model")
    return unflatten(flat[:half], replica.global_params, replica.names), unflatten(flat[half:], replica.global_params, replica.names)


def blob_hash(blob: bytes, replica: Replica) -> str:
    try:
        params, momentum = parse_blob(blob, replica)
    except ValueError:
        return ""
    return state_hash(params, momentum)


@torch.no_grad()
def rebase(replica: Replica, params: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor], round_number: int, *, keep_progress: bool) -> None:
    """Adopt a newer global state. With keep_progress, local ← θ_new − (θ_old − local): the local pseudo-gradient
    survives (it will be merged later as a stale contribution); otherwise local ← θ_new."""
    delta = replica.pseudo_gradient() if keep_progress else None
    round_steps, round_tokens = replica.round_steps, replica.round_tokens
    replica.load_global(params, momentum, round_number, keep_local=False)
    if delta is not None:
        for name, p in replica.model.named_parameters():
            p.copy_((replica.global_params[name] - delta[name]).to(p.device, p.dtype))
        replica.round_steps, replica.round_tokens = round_steps, round_tokens
