"""A run's accounts: who contributed what, what it cost, and what the run bought with it.

The store keeps per-peer accounts (`swarmloco.coordinator.store_accounts`); this module prices them and derives the
run's figures for `GET /api/accounting`, the dashboard and `swarmloco status`:

- **goodput**: verified tokens (credited by certified rounds) per second of the run's wall time;
- **cost**: device-hours of the peers holding credit, by device kind, times `--price KIND=PER_HOUR,...`. Device
  time of peers no certified round ever credited is listed apart and not billed: identities are free, and one that
  never did verified work must not be able to inflate what the run appears to cost;
- **eval loss per token and per device-hour**: how far the eval loss fell from the first certified state that
  reported one to the last, per million verified tokens and per billed device-hour, and the cost of each point.
"""
from __future__ import annotations

import math
import re
from typing import Any

from swarmloco.protocol.trust.reports import DEVICE_KINDS

__all__ = ["parse_prices", "prices_problem", "run_accounting", "run_cost", "wasted_tokens"]

MAX_PRICE = 1e6  # per device-hour
PROGRESS_POINTS = 2000  # certified rounds in the progress curve (the newest)
_PRICE = re.compile(r"\s*([a-z]+)\s*=\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*")


def prices_problem(prices: dict[str, float]) -> str:
    """Why a price table cannot be used ("" when it can)."""
    for kind, price in prices.items():
        if kind not in DEVICE_KINDS:
            return f"unknown device kind {kind!r}; prices are per device-hour of {', '.join(DEVICE_KINDS)}"
        if not (isinstance(price, int | float) and math.isfinite(price) and 0 <= price <= MAX_PRICE):
            return f"the price of {kind} must be a number in [0, {MAX_PRICE:g}] per device-hour, got {price!r}"
    return ""


def parse_prices(text: str) -> dict[str, float]:
    """`cuda=2.1,cpu=0.05` (per device-hour) as a price table; raises ValueError saying what is wrong."""
    prices: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _PRICE.fullmatch(part)
        if match is None:
            raise ValueError(f"{part!r} is not KIND=PRICE (e.g. cuda=2.1,cpu=0.05, per device-hour)")
        if match[1] in prices:
            raise ValueError(f"device kind {match[1]!r} is priced twice")
        prices[match[1]] = float(match[2])
    if not prices:
        raise ValueError("no prices given (e.g. cuda=2.1,cpu=0.05, per device-hour)")
    if problem := prices_problem(prices):
        raise ValueError(problem)
    return prices


def wasted_tokens(peer: dict[str, Any]) -> int:
    """A peer's wasted work: refused by certified rounds, dropped on resync, lost with ended sessions — and, once
    the peer is no longer online, the work it still held."""
    held = 0 if peer.get("online") else peer["pending_tokens"]
    return int(peer["refused_tokens"] + peer["dropped_tokens"] + peer["exit_tokens"] + held)


def _cost(hours: dict[str, float], prices: dict[str, float]) -> float | None:
    """The cost of device-hours by kind; None without a price for every kind used."""
    used = {kind: h for kind, h in hours.items() if h > 0}
    if not prices or any(kind not in prices for kind in used):
        return None
    return sum(h * prices[kind] for kind, h in used.items())


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den or den <= 0 else num / den


def _device_hours(store: Any, run_id: str) -> tuple[dict[str, float], dict[str, float], float]:
    """(billed device-hours by kind, unbilled ones by kind, billed compute-hours) of the run's peers."""
    billed: dict[str, float] = {}
    unbilled: dict[str, float] = {}
    compute = 0.0
    for kind, credited, device_s, compute_s in store.device_seconds(run_id):
        side = billed if credited else unbilled
        side[kind] = side.get(kind, 0.0) + device_s / 3600
        compute += compute_s / 3600 if credited else 0.0
    return billed, unbilled, compute


def run_cost(store: Any, run_id: str, prices: dict[str, float]) -> float | None:
    """The run's cost so far (None without a price for every device kind billed); what `/metrics` exports."""
    return _cost(_device_hours(store, run_id)[0], prices)


def run_accounting(store: Any, run_id: str, *, prices: dict[str, float], now: float,
                   online_window_s: float) -> dict[str, Any]:
    """The run's accounts as `GET /api/accounting` serves them (see the module docstring)."""
    totals = store.account_totals(run_id, online_since=now - online_window_s)
    billed, unbilled, compute = _device_hours(store, run_id)
    cost = _cost(billed, prices)
    progress = []
    for point in store.certified_progress(run_id, PROGRESS_POINTS):
        hours = {kind: s / 3600 for kind, s in point["billed"].items()}
        progress.append({"round": point["round"], "at": point["at"], "tokens": point["tokens"],
                         "device_hours": sum(hours.values()), "cost": _cost(hours, prices),
                         "eval_loss": point["eval_loss"]})
    evals = [p for p in progress if p["eval_loss"] is not None]
    drop = evals[0]["eval_loss"] - evals[-1]["eval_loss"] if len(evals) > 1 else None
    tokens = evals[-1]["tokens"] - evals[0]["tokens"] if len(evals) > 1 else 0
    hours = evals[-1]["device_hours"] - evals[0]["device_hours"] if len(evals) > 1 else 0.0
    spent = evals[-1]["cost"] - evals[0]["cost"] if len(evals) > 1 and None not in (evals[0]["cost"],
                                                                                     evals[-1]["cost"]) else None
    start = totals["first_seen"] or (progress[0]["at"] if progress else now)
    end = progress[-1]["at"] if progress else start
    wall_s = max(0.0, end - start)
    return {
        "run_id": run_id,
        "prices": prices,
        "verified_tokens": int(totals["verified_tokens"]),
        "wasted_tokens": int(totals["wasted_tokens"]),
        "pending_tokens": int(totals["pending_tokens"]),
        "wall_s": wall_s,
        "goodput_tokens_per_s": _ratio(totals["verified_tokens"], wall_s),
        "device_hours": billed,
        "unbilled_device_hours": unbilled,
        "compute_hours": compute,
        "cost": cost,
        "unpriced": sorted(k for k, h in billed.items() if h > 0 and k not in prices) if prices else [],
        "eval_loss_first": evals[0]["eval_loss"] if evals else None,
        "eval_loss_last": evals[-1]["eval_loss"] if evals else None,
        "eval_loss_drop_per_mtoken": _ratio(drop, tokens / 1e6 if tokens else None),
        "eval_loss_drop_per_device_hour": _ratio(drop, hours),
        # over the same stretch as the drop: from the first certified state with an eval loss to the last
        "cost_per_eval_loss_point": _ratio(spent, drop) if drop and drop > 0 else None,
        **{k: int(totals[k]) for k in ("bytes_sent", "bytes_received", "rounds_led", "rounds_failed",
                                       "rounds_missed", "resyncs")},
        "progress": progress,
    }
