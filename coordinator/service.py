"""Coordinator business logic: report admission, listings and Prometheus metrics, on top of a :class:`Store`.

Admission order for one report (each step either passes or answers a 4xx and changes nothing):
size cap (413) -> JSON and schema (400) -> signature against the key inlined in ``peer_id`` (401) ->
known ``(peer_id, nonce)``: same content gives the stored answer again (idempotent retry), different content is a
replay (409) -> timestamp inside the window (422) -> the peer is not revoked and, unless admission is ``none``,
holds a ticket of this coordinator (403) -> the peer's own rate (429) -> one atomic store transaction (200).

A committed round report creates and credits its round only with a commit certificate that verifies (signatures
of a majority of the swarm, each signer admitted) and matches the report; the round's members, weights and state
come from the certificate. Without one the report is kept as the peer's claim. Ticket issuance and revocation
live in :mod:`swarmloco.coordinator.authority`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest

from swarmloco.coordinator.accounting import prices_problem, run_accounting, wasted_tokens
from swarmloco.coordinator.authority import (
    HOSTILE_INPUT_ERRORS,
    LONE_SURROGATE,
    Answer,
    Authority,
    AuthorityConfig,
    bad_input,
    valid_unicode,
)
from swarmloco.coordinator.checkpoints import CheckpointConfig, Checkpointer
from swarmloco.coordinator.limits import RateLimiter
from swarmloco.coordinator.service_metrics import StoreCollector
from swarmloco.coordinator.store import Page, PendingReport, Prefer, Store, StoredReport
from swarmloco.protocol.base.manifest import Manifest, model_problem, package_version, settings_problem
from swarmloco.protocol.base.records import PROTOCOL_VERSION
from swarmloco.protocol.base.text import bounded, short_hash
from swarmloco.protocol.trust.certificates import Certificate
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.reports import MAX_REPORT_BYTES, Report, ReportError, content_hash, parse_report

__all__ = ["Answer", "CoordinatorService", "Parsed", "ServiceConfig"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Admission and display policy of the coordinator."""

    run_id: str = "default"
    max_past_s: float = 900.0  # how old a *new* report may be (buffered reports are re-signed by the client)
    max_future_s: float = 60.0  # tolerated clock skew ahead of us
    online_window_s: float = 60.0  # a peer seen within this many seconds counts as online
    max_report_bytes: int = MAX_REPORT_BYTES
    rate_per_s: float = 500.0  # per-client token bucket, refuses floods with 429
    rate_burst: float = 1000.0
    authority: AuthorityConfig = field(default_factory=AuthorityConfig)
    # What one peer can make us store: reports beyond its own rate get 429, and only its newest reports (with
    # their metrics and round rows) are kept per run. Unless admission is `none`, only ticket holders report.
    peer_rate_per_s: float = 20.0
    peer_rate_burst: float = 2000.0  # room for a peer's buffer of reports held back while we were down
    keep_reports_per_peer: int = 50_000
    max_runs: int = 1000  # distinct run ids reports may create (admission `none` accepts any run id)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)  # signed heads, unless admission `none`
    # the settings every peer of the run shares, served in the run manifest (peer TOML sections; checked on load)
    run_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    prices: dict[str, float] = field(default_factory=dict)  # per device-hour, by device kind (the run's cost)
    # the task those settings train and the model fingerprint its peers will announce, both served in the manifest
    # ("": not known; computed by `swarmloco coordinator`, which may load the peer's task, from --run-config)
    run_task: str = ""
    run_fingerprint: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.max_past_s <= 86400 * 30:
            raise ValueError(f"max_past_s must be in (0, 2592000], got {self.max_past_s}")
        if not 0 <= self.max_future_s <= 3600:
            raise ValueError(f"max_future_s must be in [0, 3600], got {self.max_future_s}")
        if not self.online_window_s > 0:
            raise ValueError(f"online_window_s must be > 0, got {self.online_window_s}")
        if not 256 <= self.max_report_bytes <= 16 * 1024 * 1024:
            raise ValueError(f"max_report_bytes must be in [256, 16 MiB], got {self.max_report_bytes}")
        if not (self.rate_per_s > 0 and self.rate_burst >= 1):
            raise ValueError(f"rate_per_s must be > 0 and rate_burst >= 1, got {self.rate_per_s}, {self.rate_burst}")
        if not (self.peer_rate_per_s > 0 and self.peer_rate_burst >= 1):
            raise ValueError(f"peer_rate_per_s must be > 0 and peer_rate_burst >= 1, got {self.peer_rate_per_s}, "
                             f"{self.peer_rate_burst}")
        if not 10 <= self.keep_reports_per_peer <= 10_000_000:
            raise ValueError(f"keep_reports_per_peer must be in [10, 10000000], got {self.keep_reports_per_peer}")
        if not 1 <= self.max_runs <= 1_000_000:
            raise ValueError(f"max_runs must be in [1, 1000000], got {self.max_runs}")
        if problem := settings_problem(self.run_settings):
            raise ValueError(f"run settings: {problem}")
        if problem := prices_problem(self.prices):
            raise ValueError(f"prices: {problem}")
        if problem := model_problem(self.run_task, self.run_fingerprint):
            raise ValueError(f"run model: {problem}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Parsed:
    """A report whose signature verified, with its content hash and when it arrived."""

    report: Report
    digest: str
    received_at: float


MIN_CHECKPOINT_GAP_S = 5.0  # checkpoints are not re-signed more often than this, however often they are asked for


class CoordinatorService:
    """Everything the HTTP layer calls; owns no sockets and no SQL.

    ``identity`` is the run's authority key (the coordinator's ``<db>.key``); tests may leave it out and get a
    throwaway one."""

    def __init__(self, store: Store, config: ServiceConfig, *, identity: Identity | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.config, self.clock = store, config, clock
        if identity is None:
            identity = Identity(path=Path("(in memory)"), private_key=Identity.generate())
        self.authority = Authority(store, identity, config.run_id, config.authority, clock=clock,
                                   max_future_s=config.max_future_s)
        self._limiter = RateLimiter(config.rate_per_s, config.rate_burst)
        self._per_peer = RateLimiter(config.peer_rate_per_s, config.peer_rate_burst)
        self.store.ensure_run(config.run_id, clock())
        self.checkpoints = None
        if self.authority.mode != "none" and config.checkpoints.every_s > 0:
            active = max(config.online_window_s, 3 * config.checkpoints.every_s)  # seniors active lately
            self.checkpoints = Checkpointer(store, identity, config.run_id, active_window_s=active, clock=clock,
                                            gate=lambda: self.authority.gate(config.run_id),
                                            founders=config.checkpoints.founders)
        self.bootstrap: list[str] = []  # the DHT node's multiaddrs, once it runs (the manifest names them)
        self.url = ""  # where this coordinator is served, once it is
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(self))  # type: ignore[arg-type]
        self.started_at = clock()

    def manifest(self) -> dict[str, Any]:
        """The run manifest (`GET /api/manifest`): what a peer needs to join this coordinator's run in one command."""
        info = self.authority.info()
        return Manifest(run_id=info["run_id"], protocol_version=PROTOCOL_VERSION, package_version=package_version(),
                        authority="" if info["admission"] == "none" else info["authority"],
                        admission=info["admission"], work_bits=info["work_bits"], bootstrap=tuple(self.bootstrap),
                        coordinator=self.url, settings=self.config.run_settings, task=self.config.run_task,
                        fingerprint=self.config.run_fingerprint).to_value()

    def checkpoint(self, *, refresh: bool = False) -> dict[str, Any] | None:
        """The newest signed checkpoint, as published (None: none yet, or no authority); `refresh`: first sign a new
        one when the last is older than `checkpoints.every_s`, or (at most every few seconds) when rounds were
        certified after it."""
        cp = self.checkpoints
        if cp is None:
            return None
        if refresh:
            age = self.clock() - cp.latest.issued_at if cp.latest is not None else math.inf
            moved = cp.latest is None or bool(self.store.certified_after(self.config.run_id, cp.latest.round, 1))
            if age >= self.config.checkpoints.every_s or (moved and age >= MIN_CHECKPOINT_GAP_S):
                cp.refresh()
        return None if cp.latest is None else cp.latest.to_value()

    # -- ingest ----------------------------------------------------------------------------------------------

    def ingest(self, raw: bytes, *, client: str = "?") -> Answer:
        """Admit one raw report; never raises for bad input."""
        parsed = self.parse(raw, client=client)
        if isinstance(parsed, Answer):
            return parsed
        item = self.check(parsed)
        if isinstance(item, Answer):
            return item
        stored = self.store.add_report(item.report, content_hash=item.content_hash, received_at=item.received_at,
                                       certificate=item.certificate, uncredited=item.uncredited,
                                       keep_reports=item.keep_reports, prefer=item.prefer)
        return self.stored(stored, parsed.digest)

    def parse(self, raw: bytes, *, client: str = "?") -> Answer | Parsed:
        """The first steps of :meth:`ingest`, which read nothing from the store (any thread may run them): the
        client's rate, then size, JSON, schema and signature. An :class:`Answer` refuses the report."""
        now = self.clock()
        if not self._limiter.allow(client, now):
            return Answer(status=429, body={"error": "too many reports from this client; retry with back-off"})
        try:
            report = parse_report(raw, max_bytes=self.config.max_report_bytes)
        except ReportError as e:
            return Answer(status=e.status, body={"error": str(e)})
        except HOSTILE_INPUT_ERRORS as e:  # a gap in the validator: still the sender's fault, still a 400
            return bad_input("report", client, e)
        envelope = report.to_json()
        if not valid_unicode(envelope):
            return Answer(status=400, body={"error": LONE_SURROGATE})
        return Parsed(report=report, digest=content_hash(envelope), received_at=now)

    def check(self, parsed: Parsed) -> Answer | PendingReport:
        """The steps of :meth:`ingest` that read the store: a known (peer, nonce) is answered as before, then the
        timestamp window, revocation and ticket, the peer's rate and the commit certificate. Returns what to store,
        or the :class:`Answer` that refuses it."""
        report, digest, now = parsed.report, parsed.digest, parsed.received_at
        known = self.store.find_report(report.peer_id, report.nonce)
        if known is not None:
            return self._known(known.content_hash, digest, known.response)
        skew = report.timestamp - now
        if skew > self.config.max_future_s or -skew > self.config.max_past_s:
            return Answer(status=422, body={
                "error": f"timestamp {report.timestamp:.3f} is {skew:+.1f}s from the coordinator's clock; "
                         f"accepted window is -{self.config.max_past_s:g}s..+{self.config.max_future_s:g}s "
                         f"(re-sign the report with the current time, and check the clock)"})
        refusal = self.authority.report_refusal(report.peer_id, report.run_id) or self._run_refusal(report.run_id)
        if refusal:
            return Answer(status=403, body={"error": refusal})
        if not self._per_peer.allow(report.peer_id, now):
            return Answer(status=429, body={"error": "too many reports from this peer; retry with back-off"})
        certificate, uncredited = self._certificate(report)
        return PendingReport(report=report, content_hash=digest, received_at=now, certificate=certificate,
                             uncredited=uncredited, keep_reports=self.config.keep_reports_per_peer,
                             prefer=self._prefer(report.run_id) if certificate is not None else None)

    def stored(self, stored: StoredReport, digest: str) -> Answer:
        """The answer to a report once the store holds it (durably)."""
        if not stored.created:  # lost a race with a concurrent copy of the same report
            return self._known(stored.content_hash, digest, stored.response)
        return Answer(status=200, body=stored.response)

    def _prefer(self, run_id: str) -> Prefer | None:
        """Whether a new certificate of a state the store already holds one of replaces it: when its valid signers
        hold more seniority in the newest checkpoint. Else the first one stays, so identities nobody credited who
        certify an honest state first cannot keep its credit, nor break the chain the checkpoints follow. Before any
        checkpoint (no seniority yet), the first certificate stays."""
        cp = self.checkpoints.latest if self.checkpoints is not None else None
        if cp is None:
            return None
        gate = self.authority.gate(run_id)  # here, not inside the store's transaction: it reads the store

        def prefer(new: Certificate, stored: str) -> bool:
            try:
                old = Certificate.from_bytes(stored.encode())
            except ValueError:
                return True
            return cp.weight(new.valid_signers(gate)) > cp.weight(old.valid_signers(gate))

        return prefer

    def _run_refusal(self, run_id: str) -> str:
        if self.store.has_run(run_id) or self.store.run_count() < self.config.max_runs:
            return ""
        return f"this coordinator records at most {self.config.max_runs} runs; report to run {self.config.run_id!r}"

    def _certificate(self, report: Report) -> tuple[Certificate | None, str]:
        """The verified certificate of a committed round report that matches it, or None and the reason why not."""
        b = report.body
        if report.kind != "round" or b["outcome"] != "committed":
            return None, ""
        if not b.get("certificate"):
            return None, "no commit certificate: the round is the peer's own claim"
        gate = self.authority.gate(report.run_id)
        try:
            certificate = Certificate.from_bytes(b["certificate"].encode())
            # quorum 1: the certificate's own majority rule (need(swarm, quorum)) makes it the swarm's state
            problem = certificate.problem(run_id=report.run_id, gate=gate, quorum=1)
        except HOSTILE_INPUT_ERRORS as e:  # hostile JSON: wrong types, deep nesting, huge integers
            return None, f"malformed commit certificate: {type(e).__name__}: {bounded(str(e), 200)}"
        if problem:
            return None, f"invalid commit certificate: {problem}"
        s = certificate.statement
        if s.round != b["round"] or s.new_hash != b["state_hash"]:
            return None, (f"the certificate is for round {s.round} {short_hash(s.new_hash)}, the report for round "
                          f"{b['round']} {short_hash(b['state_hash'] or '')}")
        if report.peer_id not in s.members:
            return None, "the reporting peer is not a member of the certified round"
        return certificate, ""

    # -- authority -------------------------------------------------------------------------------------------

    def request_ticket(self, raw: bytes, *, client: str = "?") -> Answer:
        if not self._limiter.allow(client, self.clock()):
            return Answer(status=429, body={"error": "too many requests from this client; retry with back-off"})
        return self.authority.request_ticket(raw, client=client)

    @staticmethod
    def _known(stored_hash: str, digest: str, response: dict[str, Any]) -> Answer:
        if stored_hash == digest:
            return Answer(status=200, body=response)
        return Answer(status=409, body={"error": "nonce already used by this peer for a different report "
                                                 "(replay refused); use a fresh nonce for new reports"})

    # -- listings --------------------------------------------------------------------------------------------

    def _page_json(self, page: Page) -> dict[str, Any]:
        return {"items": page.items, "next_cursor": page.next_cursor}

    def runs(self, **kw: Any) -> dict[str, Any]:
        return {**self._page_json(self.store.list_runs(**kw)), "default_run_id": self.config.run_id}

    def peers(self, **kw: Any) -> dict[str, Any]:
        page = self.store.list_peers(**kw)
        since = self.clock() - self.config.online_window_s
        # what the newest checkpoint vouches for: credited tokens on the chain it follows, and whether they weigh yet
        cp = self.checkpoints.latest if self.checkpoints is not None else None
        vouched = {peer: tokens for peer, tokens, _ in cp.seniors} if cp is not None else {}
        for p in page.items:
            p["online"] = p["left_at"] is None and p["last_seen"] >= since
            p["wasted_tokens"] = wasted_tokens(p)
            if p["run_id"] == self.config.run_id:
                p["vouched_tokens"] = vouched.get(p["peer_id"], 0)
                p["seniority"] = cp.seniority(p["peer_id"]) if cp is not None else 0
        return self._page_json(page)

    def accounting(self, run_id: str | None = None) -> dict[str, Any]:
        """The run's goodput, cost and what its eval loss bought (`swarmloco.coordinator.accounting`)."""
        return run_accounting(self.store, run_id or self.config.run_id, prices=self.config.prices, now=self.clock(),
                              online_window_s=self.config.online_window_s)

    def rounds(self, **kw: Any) -> dict[str, Any]:
        return self._page_json(self.store.list_rounds(**kw))

    def metrics(self, **kw: Any) -> dict[str, Any]:
        return self._page_json(self.store.list_metrics(**kw))

    def health(self) -> dict[str, Any]:
        counts = self.store.counts()
        return {"status": "ok", "run_id": self.config.run_id, "uptime_s": round(self.clock() - self.started_at, 3),
                "reports": counts["reports"]}

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)
