"""Optional progress reports to a coordinator. Never on the training path: every call is non-blocking and a down
coordinator only means reports wait in the reporter's buffer."""
from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import torch

from swarmloco.peer.replica import Replica
from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.text import short_hash

logger = logging.getLogger(__name__)


def _certificate_text(value: Any) -> str | None:
    """A committed round's certificate as the report carries it: Certificate.to_bytes() decoded."""
    if isinstance(value, bytes):
        return value.decode("ascii", errors="replace")
    return value if isinstance(value, str) and value else None


def device_kind(device: torch.device) -> str:
    """The device kind the coordinator prices by (`--price cuda=2.1,cpu=0.05`)."""
    return device.type if device.type in ("cpu", "cuda", "mps", "xpu") else "other"


class RoundReports:
    """What a peer tells the coordinator: its hardware, training metrics, and each round's outcome with what it cost
    (seconds, bytes, role) and what became of the peer's local work: `pending_tokens` (trained, not merged yet) and
    `dropped_tokens` (thrown away this session), under a `session` id fresh in every process, so the coordinator
    can count the work a killed process took with it."""

    def __init__(
        self, url: str | None, identity_path: str | None, run_id: str, *, metrics_interval_s: float = 5.0
    ) -> None:
        self.reporter: Any = None
        self.metrics_interval_s = metrics_interval_s
        self._last_metrics = 0.0
        self.session = secrets.token_hex(8)
        self.dropped_tokens = 0  # local work thrown away in this process (see `resynced`)
        self.resyncs = 0  # newer states this process adopted
        if not url or not identity_path:
            return
        from swarmloco.peer.report_sender import ReportSender
        from swarmloco.protocol.trust.identity import load_or_create_identity

        self.reporter = ReportSender(url, load_or_create_identity(identity_path), run_id).start()

    def hello(self, replica: Replica, *, tokens_per_s: float = 0.0) -> None:
        """Hardware and version; sent at start (throughput unknown yet) and again once throughput is measured."""
        if self.reporter is None:
            return
        from importlib.metadata import PackageNotFoundError, version

        try:
            ours = version("swarmloco")
        except PackageNotFoundError:
            ours = "dev"
        if replica.device.type == "cuda":
            device = torch.cuda.get_device_name(replica.device)
            memory = torch.cuda.get_device_properties(replica.device).total_memory
        else:
            import os

            device = f"cpu ({torch.get_num_threads()} threads)"
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.reporter.hello(version=ours, device=device, memory_bytes=int(memory), tokens_per_s=float(tokens_per_s),
                            extra={"device_kind": device_kind(replica.device), "session": self.session,
                                   "pending_tokens": int(replica.round_tokens)})

    def resynced(self, dropped_tokens: int) -> None:
        """The peer adopted a newer state; `dropped_tokens`: its local work thrown away with it (progress too stale
        to keep as a contribution)."""
        self.resyncs += 1
        self.dropped_tokens += max(0, int(dropped_tokens))

    def _work(self, pending: int) -> dict[str, Any]:
        return {"session": self.session, "pending_tokens": max(0, int(pending)), "dropped_tokens": self.dropped_tokens,
                "resyncs": self.resyncs}

    def step(self, replica: Replica, loss: float, tokens_per_s: float) -> None:
        if self.reporter is None or time.monotonic() - self._last_metrics < self.metrics_interval_s:
            return
        self._last_metrics = time.monotonic()
        self.reporter.report_metrics(
            step=replica.step, train_loss=loss, tokens_per_s=tokens_per_s, tokens_total=replica.tokens,
            extra=self._work(replica.round_tokens),
        )

    def round(self, entry: dict[str, Any], *, pending_tokens: int = 0) -> None:
        """Report one round; `pending_tokens`: the peer's local work not merged once the round is over."""
        if self.reporter is None:
            return
        members = list(entry.get("members") or [])
        if not members:
            # A round given up before any group formed has nothing a coordinator could record (its reports need
            # members); the peer's own log already says why.
            logger.debug("round %s ended without a group (%s); not reported", entry.get("round"), entry.get("reason"))
            return
        weights = list(entry.get("weights") or [])
        if len(weights) != len(members):
            weights = [0] * len(members)
        reason = entry.get("reason") or (
            f"state hash differs from leader's {short_hash(entry['leader_hash'])}" if "leader_hash" in entry else None
        )
        self.reporter.report_round(
            round=int(entry.get("round", 0)),
            members=members,
            tokens=[int(w) for w in weights],
            state_hash=entry.get("state_hash"),
            train_s=float(entry.get("train_s", 0.0)),
            wait_s=float(entry.get("wait_s", 0.0)),
            average_s=float(entry.get("average_s", 0.0)),
            outcome=str(entry.get("outcome", Outcome.DISCARDED)),
            failure_reason=reason,
            eval_loss=entry.get("eval_loss"),
            certificate=_certificate_text(entry.get("certificate")),
            extra=self._round_extra(entry, pending_tokens),
        )
        if entry.get("eval_loss") is not None:
            self.reporter.report_metrics(
                step=int(entry.get("step", 0)),
                train_loss=None,
                tokens_per_s=0.0,
                tokens_total=int(entry.get("tokens_total", 0)),
                eval_loss=entry["eval_loss"],
            )

    def _round_extra(self, entry: dict[str, Any], pending: int) -> dict[str, Any]:
        extra = self._work(pending)
        if entry.get("role") in ("leader", "member"):
            extra["role"] = entry["role"]
        for key in ("bytes_sent", "bytes_received"):
            if isinstance(entry.get(key), int) and entry[key] >= 0:
                extra[key] = min(entry[key], 2**48)
        return extra

    def close(self) -> None:
        if self.reporter is not None:
            undelivered = self.reporter.close(timeout=5.0)
            if undelivered:
                logger.info("%d reports could not be delivered to the coordinator", undelivered)
