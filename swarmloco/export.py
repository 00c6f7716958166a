"""Using what a run learned: `swarmloco export` and `swarmloco sample`.

`swarmloco export --workdir DIR --out model.safetensors` writes the agreed θ from a peer's checkpoint (DIR/checkpoint)
as a plain safetensors file: one tensor per model parameter, named as the task's model names them, and the task's
config in the file's metadata. It verifies the checkpoint first (the tensor file's sha256, and the state hash of θ
and the outer momentum, the hash the swarm certified), so what it writes is the state the run agreed on. The file
loads without this package: `safetensors.torch.load_file` and the task's model class (for the default task,
`GPT(GPTConfig(**config))` of swarmloco.peer.model, a plain PyTorch module).

`swarmloco sample --checkpoint model.safetensors --prompt "def "` prints text the default task's byte-level model
generates from a prompt, so a volunteer sees what the run has learned. It also takes a workdir's checkpoint.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
EXPORT_FORMAT = "swarmloco-export-1"
DEFAULT_TASK = "stdlib-gpt"


class ExportError(ValueError):
    pass


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", required=True, type=Path, help="the peer's workdir (its checkpoint/ is read)")
    parser.add_argument("--out", required=True, type=Path, help="the safetensors file to write")


def add_sample_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="an exported .safetensors file, or a peer's workdir (its checkpoint/ is read)")
    parser.add_argument("--prompt", default="def ", help="the text generation starts from")
    parser.add_argument("--tokens", type=int, default=200, help="how many bytes to generate (1 .. 10000)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: always the likeliest)")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")


def agreed_state(workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(θ by parameter name, the checkpoint's sidecar) of a peer's checkpoint, verified. Raises ExportError."""
    from safetensors.torch import load_file

    from swarmloco.peer.checkpoint import SIDECAR, sha256_file
    from swarmloco.protocol.base.hashing import state_hash

    directory = workdir / "checkpoint"
    try:
        meta = json.loads((directory / SIDECAR).read_text())
        file_path = directory / str(meta["file"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"no readable checkpoint in {directory} ({type(exc).__name__}): run a peer with "
                          "--checkpoint-every 1 (the default) first") from None
    if file_path.parent != directory or not file_path.is_file() or sha256_file(file_path) != meta.get("file_sha256"):
        raise ExportError(f"checkpoint {file_path} is missing or does not match its recorded sha256")
    tensors = load_file(str(file_path))
    params = {k.removeprefix("global/"): v for k, v in tensors.items() if k.startswith("global/")}
    momentum = {k.removeprefix("momentum/"): v for k, v in tensors.items() if k.startswith("momentum/")}
    names = meta.get("names")
    if not params or set(params) != set(momentum):
        raise ExportError(f"checkpoint {file_path} holds no global state")
    if not isinstance(names, list) or set(names) != set(params):
        logger.warning("checkpoint %s does not list its parameters' order (written by an older swarmloco): its state "
                       "hash is not re-checked, only its file's sha256", file_path)
    elif state_hash(params, momentum, names) != meta.get("state_hash"):
        raise ExportError(f"checkpoint {file_path}: θ and momentum do not hash to the recorded state "
                          f"{str(meta.get('state_hash'))[:12]}…")
    return params, meta


def export(workdir: Path, out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    params, meta = agreed_state(workdir)
    info = {"format": EXPORT_FORMAT, "task": str(meta.get("task")),
            "task_config": json.dumps(meta.get("task_config")), "round": str(meta.get("round")),
            "state_hash": str(meta.get("state_hash")), "tokens": str(meta.get("tokens"))}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file({k: v.contiguous() for k, v in params.items()}, str(tmp), metadata=info)
    tmp.replace(out)
    return info


def run_export(args: argparse.Namespace) -> int:
    try:
        info = export(args.workdir, args.out)
    except ExportError as exc:
        print(f"swarmloco export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: round {info['round']}, state {info['state_hash'][:12]}…, task {info['task']} "
          f"({info['task_config']})")
    return 0


def load_model(path: Path) -> Any:
    """The default task's model holding the exported (or checkpointed) θ, in eval mode."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from swarmloco.peer.model import GPT
    from swarmloco.peer.presets import GPTConfig

    if path.is_dir():
        params, meta = agreed_state(path)
        config = meta.get("task_config") or {}
    else:
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
            params, config = load_file(str(path)), json.loads(metadata.get("task_config", "{}"))
        except (OSError, ValueError) as exc:
            raise ExportError(f"{path} is not an exported model: {exc}") from None
    if not isinstance(config, dict) or config.get("task") != DEFAULT_TASK:
        raise ExportError(f"sample knows the default task's byte-level model only; {path} holds "
                          f"{config.get('task') if isinstance(config, dict) else config!r}")
    fields = {k: config[k] for k in ("vocab_size", "context", "d_model", "n_layers", "n_heads")}
    model = GPT(GPTConfig(**fields))
    model.load_state_dict(params, strict=True)
    return model.eval()


def generate(model: Any, prompt: bytes, *, tokens: int, temperature: float, top_k: int, seed: int) -> bytes:
    import torch

    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt) or [10]], dtype=torch.long)
    context = model.cfg.context
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(idx[:, -context:])[0, -1].float()
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                if 0 < top_k < logits.numel():
                    cut = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < cut, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            idx = torch.cat([idx, torch.tensor([[nxt]])], dim=1)
    return bytes(idx[0, len(prompt):].tolist())


def run_sample(args: argparse.Namespace) -> int:
    if not 1 <= args.tokens <= 10_000 or args.temperature < 0 or args.top_k < 0:
        print("swarmloco sample: --tokens must be 1 .. 10000, --temperature and --top-k at least 0", file=sys.stderr)
        return 2
    try:
        model = load_model(args.checkpoint)
    except ExportError as exc:
        print(f"swarmloco sample: {exc}", file=sys.stderr)
        return 2
    prompt = args.prompt.encode()
    out = generate(model, prompt, tokens=args.tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    sys.stdout.write((prompt + out).decode("utf-8", errors="replace") + "\n")
    return 0
