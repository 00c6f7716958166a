"""What a joiner's state download is configured by (`swarmloco.protocol.chain.state_transfer` runs it): how many
donors at once, how deep each pipeline, and the bound of every wait. Torch-free, like protocol/network/config.py and
protocol/round/config.py, so that it is built and checked without importing torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class FetchConfig:
    """The joiner's side: how many donors at once, how deep each pipeline, and every wait's bound."""

    max_donors: int = 4
    # chunks requested ahead per donor: each lands in place, so depth costs the joiner no memory, and keeps the
    # donor sending while the joiner's loop is busy; a slow donor holds at most this many when it is dropped
    window: int = 8
    chunk_timeout_s: float = 20.0
    connect_timeout_s: float = 3.0
    control_timeout_s: float = 15.0
    busy_retry_s: float = 1.0  # first pause before asking busy donors again (doubles, with jitter)
