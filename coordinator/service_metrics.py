"""The coordinator's Prometheus families (`GET /metrics`), computed from the store at scrape time, so that they
survive restarts."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from swarmloco.coordinator.accounting import run_cost
from swarmloco.coordinator.store import Store


class _Settings(Protocol):
    online_window_s: float
    run_id: str
    prices: Mapping[str, float]


class _Service(Protocol):
    """What the collector reads of the coordinator's service (named here, so this module does not import it)."""

    store: Store
    config: _Settings
    clock: Callable[[], float]

__all__ = ["DURATION_BUCKETS", "StoreCollector"]

DURATION_BUCKETS: tuple[float, ...] = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class StoreCollector:
    """Computes the Prometheus families from the store at scrape time, so they survive restarts."""

    def __init__(self, service: _Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        store, cfg = self.service.store, self.service.config
        online = GaugeMetricFamily("swarmloco_peers_online", "Peers seen within the online window and not gone")
        online.add_metric([], store.peers_online(self.service.clock() - cfg.online_window_s))
        yield online
        rounds = CounterMetricFamily("swarmloco_rounds", "Distinct rounds recorded, by outcome", labels=["outcome"])
        for outcome, n in sorted(store.rounds_by_outcome().items()):
            rounds.add_metric([outcome], n)
        yield rounds
        tokens = CounterMetricFamily("swarmloco_tokens", "Tokens all peers report having processed (their word)")
        tokens.add_metric([], store.tokens_total())
        yield tokens
        credited = CounterMetricFamily("swarmloco_credited_tokens", "Tokens certified rounds credited as verified "
                                       "work, all peers")
        credited.add_metric([], store.credited_tokens())
        yield credited
        counts, total, seconds = store.round_duration_histogram(DURATION_BUCKETS)
        buckets = [(repr(float(edge)), n) for edge, n in zip(DURATION_BUCKETS, counts, strict=True)]
        buckets.append(("+Inf", total))
        hist = HistogramMetricFamily("swarmloco_round_duration_seconds",
                                     "Per-peer round duration (train + wait + average)")
        hist.add_metric([], buckets, sum_value=seconds)
        yield hist
        yield from _account_families(store, self.service)
        reports = CounterMetricFamily("swarmloco_reports", "Reports stored")
        reports.add_metric([], store.counts()["reports"])
        yield reports


def _account_families(store: Store, service: _Service) -> Iterator[Any]:
    """Contribution and cost counters of every run, from the peers' accounts."""
    seconds = CounterMetricFamily("swarmloco_device_seconds", "Device seconds peers were in a run, by device kind "
                                  "and whether a certified round credited them", labels=["kind", "credited"])
    compute = CounterMetricFamily("swarmloco_compute_seconds", "Seconds peers report training, by device kind",
                                  labels=["kind", "credited"])
    for kind, credited, device_s, compute_s in store.device_seconds():
        seconds.add_metric([kind, str(credited).lower()], device_s)
        compute.add_metric([kind, str(credited).lower()], compute_s)
    yield seconds
    yield compute
    totals = store.account_totals(online_since=service.clock() - service.config.online_window_s)
    wasted = CounterMetricFamily("swarmloco_wasted_tokens", "Tokens trained and not merged: refused by certified "
                                 "rounds, dropped on resync, lost with peers that left")
    wasted.add_metric([], totals["wasted_tokens"])
    yield wasted
    moved = CounterMetricFamily("swarmloco_averaging_bytes", "Bytes peers report moving in rounds",
                                labels=["direction"])
    moved.add_metric(["sent"], totals["bytes_sent"])
    moved.add_metric(["received"], totals["bytes_received"])
    yield moved
    rounds = CounterMetricFamily("swarmloco_peer_rounds", "Rounds per peer role or fate, summed over peers",
                                 labels=["kind"])
    for kind in ("led", "failed", "missed"):
        rounds.add_metric([kind], totals[f"rounds_{kind}"])
    yield rounds
    resyncs = CounterMetricFamily("swarmloco_resyncs", "Newer states peers adopted")
    resyncs.add_metric([], totals["resyncs"])
    yield resyncs
    cost = run_cost(store, service.config.run_id, service.config.prices)
    if cost is not None:
        gauge = GaugeMetricFamily("swarmloco_run_cost", "The coordinator's run: billed device-hours times --price")
        gauge.add_metric([], cost)
        yield gauge
