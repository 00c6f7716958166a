"""The outer optimiser's settings (`OuterConfig`), apart from the outer step itself (peer/outer.py, which imports
torch), so that the peer's config and command line are built without importing torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """Outer optimiser: DiLoCo's published defaults are Nesterov, lr 0.7, momentum 0.9."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.lr <= 10.0:
            raise ValueError(f"outer lr: got {self.lr}, allowed 0 < lr <= 10")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"outer momentum: got {self.momentum}, allowed 0 <= momentum < 1")
