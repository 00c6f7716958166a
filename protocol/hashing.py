"""Canonical hashing of the global training state (θ and outer momentum).

Peers compare these hashes to prove they hold bit-identical state after a round, and a joiner checks a downloaded
state against the hash the swarm agreed on. The byte layout is fixed: tensors sorted by name, each contributes its
name, dtype, shape and its contiguous little-endian bytes, so the hash does not depend on dict order or device.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Mapping, Sequence

import torch

_HASH_VERSION = b"swarmloco-state-v1"


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    t = tensor.detach().to("cpu").contiguous()
    if sys.byteorder != "little" and t.element_size() > 1:
        raise RuntimeError("state hashing assumes a little-endian host")
    # uint8 view avoids numpy (bf16 has no numpy dtype) and copies nothing.
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def hash_tensors(tensors: Mapping[str, torch.Tensor], *, digest: hashlib._Hash | None = None) -> str:
    """Hex sha256 of a name → tensor mapping in canonical order."""
    h = digest if digest is not None else hashlib.sha256()
    h.update(_HASH_VERSION)
    for name in sorted(tensors):
        t = tensors[name]
        encoded = name.encode()
        h.update(struct.pack("<I", len(encoded)) + encoded)
        dtype = str(t.dtype).encode()
        h.update(struct.pack("<I", len(dtype)) + dtype)
        h.update(struct.pack("<I", t.dim()) + struct.pack(f"<{t.dim()}q", *t.shape))
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def state_hash(params: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor]) -> str:
    """Hash of the global state: parameters θ and outer momentum m, kept in separate namespaces."""
    combined = {f"param/{k}": v for k, v in params.items()}
    combined.update({f"momentum/{k}": v for k, v in momentum.items()})
    return hash_tensors(combined)


def pack_state(params: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor], names: Sequence[str]) -> bytes:
    """The global state as donors serve it: θ then m, fp32, little-endian, parameters in `names` order."""
    flat = [params[n].reshape(-1).to(torch.float32) for n in names] + [
        momentum[n].reshape(-1).to(torch.float32) for n in names
    ]
    return torch.cat(flat).numpy().tobytes() if flat else b""


def unpack_state(
    blob: bytes | bytearray, shapes: Mapping[str, torch.Size], names: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Inverse of `pack_state` for a model of these parameter shapes; ValueError when the size does not fit."""
    sizes = [int(torch.Size(shapes[n]).numel()) for n in names]
    if len(blob) != 8 * sum(sizes):
        raise ValueError(f"state blob of {len(blob)} bytes does not fit this model ({8 * sum(sizes)} bytes)")
    flat = torch.frombuffer(bytearray(blob), dtype=torch.float32) if len(blob) else torch.zeros(0)
    parts: list[dict[str, torch.Tensor]] = [{}, {}]
    offset = 0
    for part in parts:
        for name, size in zip(names, sizes, strict=False):
            part[name] = flat[offset : offset + size].view(shapes[name])
            offset += size
    return parts[0], parts[1]


def blob_hash(blob: bytes | bytearray, shapes: Mapping[str, torch.Size], names: Sequence[str]) -> str:
    """The state hash of a served blob; "" when the blob does not fit the model (so it never matches a real hash)."""
    try:
        params, momentum = unpack_state(blob, shapes, names)
    except ValueError:
        return ""
    return state_hash(params, momentum)
