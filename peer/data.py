"""The default corpus: the Python standard library's own source files, found at run time (no download).

Files are assigned to shards by a hash of their path relative to the stdlib root, so the split is deterministic on
every machine and the shards are disjoint. A fixed slice of files is held out for evaluation. Batches are a pure
function of (seed, shard, step), which makes an exact resume possible without saving any RNG state.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
EVAL_PERCENT = 5  # files whose path hash falls in the first 5% form the held-out eval shard


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """Which slice of the training files this peer reads."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"shard count: got {self.count}, allowed >= 1")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index: got {self.index}, allowed 0 <= index < {self.count}")


def stdlib_root() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library not found at {root}; pass a custom --task instead")
    return root


def _bucket(rel_path: str) -> int:
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "little")


def list_source_files(root: Path | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files, sorted; third-party site-packages are excluded."""
    root = root or stdlib_root()
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        files.extend((rel / name).as_posix() for name in filenames if name.endswith(".py"))
    return sorted(files)


def split_files(files: list[str], shard: ShardSpec) -> tuple[list[str], list[str]]:
    """(this shard's training files, the held-out eval files)."""
    train, held_out = [], []
    for f in files:
        b = _bucket(f)
        if b % 100 < EVAL_PERCENT:
            held_out.append(f)
        elif (b // 100) % shard.count == shard.index:
            train.append(f)
    return train, held_out


def load_bytes(root: Path, files: list[str], *, max_bytes: int | None = None) -> torch.Tensor:
    """Concatenate files into one uint8 tensor (files separated by a NUL byte).

    One growing buffer that the tensor then shares: a list of chunks, their join and a copy for the tensor held the
    shard three times over, and the heap rarely gives such a peak back."""
    blob = bytearray()
    for f in files:
        blob += (root / f).read_bytes()
        blob += b"\0"
        if max_bytes is not None and len(blob) >= max_bytes:
            break
    if max_bytes:
        del blob[max_bytes:]
    if not blob:
        raise ValueError("the selected shard holds no data; use fewer shards")
    return torch.frombuffer(blob, dtype=torch.uint8)


def _step_generator(seed: int, shard_index: int, step: int) -> torch.Generator:
    mixed = hashlib.sha256(f"{seed}:{shard_index}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little") & ((1 << 63) - 1))


def sample_batch(
    data: torch.Tensor, *, batch_size: int, seq_len: int, seed: int, shard_index: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of seq_len+1 bytes; depends only on its arguments."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"shard of {data.numel()} bytes is shorter than one sequence of {seq_len + 1}")
    gen = _step_generator(seed, shard_index, step)
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    offsets = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    windows = data[offsets].long()
    return windows[:, :-1], windows[:, 1:]


def eval_batches(
    data: torch.Tensor, *, n_batches: int, batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed, evenly spaced set of windows over the eval shard."""
    total = n_batches * batch_size
    usable = data.numel() - seq_len - 1
    if usable <= 0:
        raise ValueError("eval shard too small")
    return _windows(data, torch.linspace(0, usable - 1, total).long().view(n_batches, batch_size), seq_len)


def probe_batches(
    data: torch.Tensor, *, n_batches: int, batch_size: int, seq_len: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Windows of the eval shard at offsets drawn by `seed`: held-out batches only the holder of the seed knows."""
    usable = data.numel() - seq_len - 1
    if usable <= 0:
        raise ValueError("eval shard too small")
    g = torch.Generator().manual_seed(seed)
    return _windows(data, torch.randint(0, usable, (n_batches, batch_size), generator=g), seq_len)


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (inputs, targets) batch per row of window offsets."""
    out = []
    for row in starts:
        windows = data[row[:, None] + torch.arange(seq_len + 1)[None, :]].long()
        out.append((windows[:, :-1], windows[:, 1:]))
    return out
