"""Checkpoints: tensors in safetensors, metadata in a JSON sidecar, both written atomically.

Layout in the checkpoint directory:
    state-<step>.safetensors   global θ, outer momentum, local replica params, inner AdamW state
    state.json                 round, step, tokens, config, state hash, file name and its sha256
`state.json` is replaced last (temp file, fsync, rename), so it always names a complete tensor file; loading
verifies the file's sha256 and the state hash, and never unpickles anything.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from swarmloco.peer.replica import Replica

SIDECAR = "state.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save(replica: Replica, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name in replica.names:
        tensors[f"global/{name}"] = replica.global_params[name]
        tensors[f"momentum/{name}"] = replica.momentum[name]
    for name, p in replica.model.named_parameters():
        tensors[f"local/{name}"] = p.detach().to("cpu")
    param_index = {id(p): i for i, p in enumerate(replica.model.parameters())}
    adam_steps: dict[str, float] = {}
    for p, state in replica.optimizer.state.items():
        i = param_index[id(p)]
        tensors[f"adam/{i}/exp_avg"] = state["exp_avg"].detach().to("cpu")
        tensors[f"adam/{i}/exp_avg_sq"] = state["exp_avg_sq"].detach().to("cpu")
        adam_steps[str(i)] = float(state["step"])
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    file_name = f"state-{replica.step:09d}.safetensors"
    _atomic_write(directory / file_name, lambda tmp: save_file(tensors, str(tmp)))
    meta = {
        "format": FORMAT_VERSION,
        "file": file_name,
        "file_sha256": sha256_file(directory / file_name),
        "round": replica.round,
        "step": replica.step,
        "round_steps": replica.round_steps,
        "round_tokens": replica.round_tokens,
        "tokens": replica.tokens,
        "adam_steps": adam_steps,
        "state_hash": replica.state_hash(),
        "names": list(replica.names),  # the parameters in the model's order: the order the state hash reads them in
        "task": replica.task.name,
        "task_config": dict(replica.task.config),
        **(extra or {}),
    }
    _atomic_write(directory / SIDECAR, lambda tmp: tmp.write_text(json.dumps(meta, indent=2, sort_keys=True)))
    for old in directory.glob("state-*.safetensors"):
        if old.name != file_name:
            old.unlink(missing_ok=True)
    return directory / file_name


def load(replica: Replica, directory: str | Path) -> dict[str, Any]:
    """Restore everything `save` wrote into `replica`; returns the sidecar. Raises CheckpointError."""
    directory = Path(directory)
    sidecar = directory / SIDECAR
    if not sidecar.is_file():
        raise CheckpointError(f"no checkpoint at {sidecar}; drop --resume to start fresh")
    try:
        meta = json.loads(sidecar.read_text())
        file_path = directory / str(meta["file"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint sidecar {sidecar} is unreadable: {exc}") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint format {meta.get('format')!r} is not supported (expected {FORMAT_VERSION})")
    if file_path.parent != directory or not file_path.is_file():
        raise CheckpointError(f"checkpoint tensor file {file_path} is missing")
    if sha256_file(file_path) != meta.get("file_sha256"):
        raise CheckpointError(f"checkpoint {file_path} does not match its recorded sha256; it is corrupt")
    if meta.get("task_config") != dict(replica.task.config):
        raise CheckpointError(
            f"checkpoint was written for task config {meta.get('task_config')}, not {dict(replica.task.config)}"
        )
    tensors = load_file(str(file_path))
    try:
        params = {n: tensors[f"global/{n}"] for n in replica.names}
        momentum = {n: tensors[f"momentum/{n}"] for n in replica.names}
        replica.load_global(params, momentum, int(meta["round"]), keep_local=True)
        with torch.no_grad():
            for name, p in replica.model.named_parameters():
                src = tensors[f"local/{name}"]
                if src.shape != p.shape:
                    raise CheckpointError(
                        f"checkpoint tensor local/{name} has shape {tuple(src.shape)}, model expects {tuple(p.shape)}"
                    )
                p.copy_(src)
        params_list = list(replica.model.parameters())
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, step in meta["adam_steps"].items():
            i = int(key)
            state[i] = {
                "step": torch.tensor(float(step)),
                "exp_avg": tensors[f"adam/{i}/exp_avg"].to(params_list[i].device),
                "exp_avg_sq": tensors[f"adam/{i}/exp_avg_sq"].to(params_list[i].device),
            }
    except KeyError as exc:
        raise CheckpointError(f"checkpoint {file_path} lacks tensor {exc}") from None
    opt_state = replica.optimizer.state_dict()
    opt_state["state"] = state
    replica.optimizer.load_state_dict(opt_state)
    replica.step = int(meta["step"])
    replica.round_steps = int(meta["round_steps"])
    replica.round_tokens = int(meta["round_tokens"])
    replica.tokens = int(meta["tokens"])
    replica._batches = None  # restart the data stream at the restored step
    if replica.state_hash() != meta.get("state_hash"):
        raise CheckpointError(f"checkpoint {file_path}: state hash differs from the recorded one")
    return meta
