"""The default task's model sizes: plain data without torch, so the command line can list them without loading it."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    context: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {name}: got {value!r}, allowed a positive integer")
        if self.d_model % self.n_heads:
            raise ValueError(f"model d_model: got {self.d_model}, must be divisible by n_heads={self.n_heads}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


# ~0.1M, ~1M, ~10M and ~50M parameters. "nano" is too small to be worth training: it is for runs that exercise the
# protocol, not the model (a step is ~7x cheaper than tiny's on one CPU core); "tiny" is sized for CI on 2 CPU cores.
PRESETS: dict[str, GPTConfig] = {
    "nano": GPTConfig(context=64, d_model=64, n_layers=2, n_heads=4),
    "tiny": GPTConfig(context=128, d_model=128, n_layers=4, n_heads=4),
    "small": GPTConfig(context=256, d_model=320, n_layers=8, n_heads=5),
    "base": GPTConfig(context=512, d_model=512, n_layers=16, n_heads=8),
}

DEFAULT_TASK = "stdlib-gpt"  # the default task (swarmloco.peer.task.default_task); one model per preset


def default_task_name(preset: str) -> str:
    """The name the default task goes by with the model of `preset`, as peers log it and run manifests name it."""
    return f"{DEFAULT_TASK}-{preset}"


def builtin_tasks() -> tuple[str, ...]:
    """Every task this install trains without a plug-in."""
    return tuple(default_task_name(preset) for preset in PRESETS)
