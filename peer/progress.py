"""Progress output: a live tqdm bar for people, or one JSON object per line for machines (`--log-format json`)."""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

from swarmloco.protocol.base.text import short_id

logger = logging.getLogger(__name__)
PEER_ID_PREFIXES = ("12D3KooW", "Qm")  # libp2p ids of an Ed25519 and of an RSA key


class Progress:
    def __init__(self, *, log_format: str = "text", total_steps: int | None = None, initial_step: int = 0,
                 stream: TextIO | None = None, log_interval_s: float = 5.0) -> None:
        self.log_format = log_format
        self.stream = stream or (sys.stdout if log_format == "json" else sys.stderr)
        self.log_interval_s = log_interval_s
        self._last_log = 0.0
        self._tokens_window: list[tuple[float, int]] = []
        self.bar: tqdm | None = None
        if log_format == "text" and self.stream.isatty():
            self.bar = tqdm(
                total=total_steps or None, initial=initial_step, file=self.stream, unit="step", dynamic_ncols=True
            )

    def tokens_per_second(self) -> float:
        if len(self._tokens_window) < 2:
            return 0.0
        (t0, _), (t1, _) = self._tokens_window[0], self._tokens_window[-1]
        tokens = sum(n for _, n in self._tokens_window[1:])
        return tokens / (t1 - t0) if t1 > t0 else 0.0

    def step(self, *, step: int, round: int, loss: float, tokens: int, lr: float) -> None:
        now = time.monotonic()
        self._tokens_window.append((now, tokens))
        while len(self._tokens_window) > 50:
            self._tokens_window.pop(0)
        tok_s = self.tokens_per_second()
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(round=round, loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            return
        if now - self._last_log < self.log_interval_s:
            return
        self._last_log = now
        if self.log_format == "json":
            self.event("step", step=step, round=round, loss=round_float(loss), tokens_per_s=round_float(tok_s), lr=lr)
        else:
            self.stream.write(f"step {step} | round {round} | loss {loss:.4f} | {tok_s:,.0f} tok/s | lr {lr:.2e}\n")
            self.stream.flush()

    def event(self, name: str, **fields: Any) -> None:
        """A notable moment (eval, round closed, checkpoint); always shown."""
        if self.log_format == "json":
            self.stream.write(json.dumps({"event": name, "time": time.time(), **fields}, default=str) + "\n")
            self.stream.flush()
            return
        text = f"[{name}] " + " ".join(f"{k}={_short(v)}" for k, v in fields.items() if not k.endswith("_full"))
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _short(value: Any) -> Any:
    """A value as a person reads it in one line: collections by their size, a peer id by its last characters (the
    JSON log keeps everything in full)."""
    if isinstance(value, (list, tuple, dict, set)):
        return len(value)
    if isinstance(value, str) and value.startswith(PEER_ID_PREFIXES) and len(value) > 40:
        return "…" + short_id(value)
    return value


def round_float(x: float, digits: int = 5) -> float:
    return float(f"{x:.{digits}g}")


def finite_or_none(x: float) -> float | None:
    """`round_float(x)`, or None for NaN and ±inf (which JSON cannot carry)."""
    return round_float(x) if math.isfinite(x) else None
