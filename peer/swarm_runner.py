"""The peer's swarm loop: train from θ_r until the round budget is spent, keep training while a group forms,
exchange pseudo-gradients, apply the same outer step as every other member, and re-sync whenever behind."""
from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peer import checkpoint
from peer.progress import Progress, round_float
from peer.replica import Replica
from peer.signals import StopFlag
from peer.swarm_report import SwarmReports
from peer.swarm_state import blob_hash, flatten, local_model, parse_blob, rebase, state_blob, unflatten
from protocol.faults import FaultInjector, corrupt
from protocol.group import Behind, Group, GroupAverager, RoundAborted, choose_target
from protocol.node import NetworkConfig, SwarmNode
from protocol.records import PROTOCOL_VERSION, PeerRecord, compatibility_problem
from protocol.state_sync import ServedState, StateServer, StateSyncError, download_state

logger = logging.getLogger(__name__)


class IncompatibleSwarm(RuntimeError):
    pass


@dataclass
class SwarmPeer:
    replica: Replica
    cfg: dict[str, Any]
    stop: StopFlag
    node: SwarmNode = field(init=False)
    history: list[dict[str, Any]] = field(default_factory=list)
    staleness: int = 0
    resyncs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    compute_s: float = 0.0
    _measured_hello: bool = False

    def __post_init__(self) -> None:
        self.run, self.rounds, net = self.cfg["run"], self.cfg["round"], self.cfg["network"]
        if net.identity is None:
            identity = Path(self.run.workdir) / "identity.key"
            identity.parent.mkdir(parents=True, exist_ok=True)
            net = NetworkConfig(**{**net.__dict__, "identity": str(identity)})
        if net.identity:
            self._ensure_identity(net.identity)
        self.node = SwarmNode(net)
        self.net = net
        self.model = local_model(self.replica, self.cfg["runtime"].seed)
        self.progress = Progress(log_format=self.run.log_format, total_steps=self.run.max_steps or None, initial_step=self.replica.step)
        self.faults = FaultInjector.from_env()
        self.faults.on_fire = lambda phase, action, rnd: self.progress.event("fault", phase=phase, action=action, round=rnd)

    @staticmethod
    def _ensure_identity(path: str) -> None:
        try:
            from protocol.identity import load_or_create_identity
        except ImportError:  # hivemind then creates an RSA identity itself
            return
        load_or_create_identity(path)

    # --- state publication ----------------------------------------------------------------------------------------
    def publish_state(self, *, ready: bool = False) -> None:
        r = self.replica
        h = r.state_hash()
        self.server.publish(ServedState(round=r.round, state_hash=h, blob=state_blob(r)))
        self.node.loop.call_soon_threadsafe(self.averager.set_state, r.round, h)
        self.node.set_record(PeerRecord(version=PROTOCOL_VERSION, fingerprint=self.model.fingerprint, config_json=self.model.config_json,
                                        round=r.round, state_hash=h, ready=ready, leading=0, eta=time.time() + 60, updated=time.time()))

    def sync_to(self, target: Behind) -> bool:
        """Download, verify and adopt the agreed state; local progress is kept as a stale contribution if young enough."""
        r = self.replica
        total = 2 * 4 * self.model.numel
        started = time.perf_counter()
        try:
            blob, bad = self.node.call(download_state(self.node, donors=target.donors, round_number=target.round, state_hash=target.state_hash,
                                                      total_bytes=total, fingerprint=self.model.fingerprint,
                                                      verify=lambda b: blob_hash(b, r)), timeout=600)
        except (StateSyncError, concurrent.futures.TimeoutError) as exc:
            logger.warning("re-sync to round %d failed: %s", target.round, exc)
            return False
        params, momentum = parse_blob(bytes(blob), r)
        staleness = self.staleness + max(1, target.round - r.round)
        keep = r.round_steps > 0 and staleness <= self.rounds.max_staleness
        rebase(r, params, momentum, target.round, keep_progress=keep)
        self.staleness = staleness if keep else 0
        self.resyncs += 1
        self.progress.event("resync", round=target.round, state_hash=target.state_hash[:16], seconds=round_float(time.perf_counter() - started),
                            kept_progress=keep, failures=bad)
        self.publish_state()
        return True

    # --- the main loop --------------------------------------------------------------------------------------------
    def budget_spent(self, round_started: float) -> bool:
        r, rounds = self.replica, self.rounds
        if rounds.round_tokens:
            return r.round_tokens >= rounds.round_tokens
        if rounds.round_seconds:
            return time.monotonic() - round_started >= rounds.round_seconds and r.round_steps > 0
        return r.round_steps >= self.cfg["train"].inner_steps

    def train_step(self) -> None:
        if self.faults.faults:
            self.faults.hit("inner_step", self.replica.round)
        started = time.perf_counter()
        result = self.replica.inner_step()
        if self.run.slowdown > 1:
            time.sleep(result.seconds * (self.run.slowdown - 1))
        self.compute_s += time.perf_counter() - started
        self.progress.step(step=self.replica.step, round=self.replica.round, loss=result.loss, tokens=result.tokens, lr=result.lr)
        self.reports.step(self.replica, result.loss, self.progress.tokens_per_second())

    def eta(self, round_started: float) -> float:
        r, rounds = self.replica, self.rounds
        if r.round_steps == 0:
            return time.time() + 60
        per_step = (time.monotonic() - round_started) / r.round_steps
        if rounds.round_tokens:
            remaining = max(0, rounds.round_tokens - r.round_tokens) / max(1, r.round_tokens / r.round_steps)
        elif rounds.round_seconds:
            return time.time() + max(0.0, rounds.round_seconds - (time.monotonic() - round_started))
        else:
            remaining = max(0, self.cfg["train"].inner_steps - r.round_steps)
        return time.time() + remaining * per_step

    def done(self) -> bool:
        r = self.replica
        return bool(self.stop) or bool(self.run.max_steps and r.step >= self.run.max_steps) or bool(self.run.max_rounds and r.round >= self.run.max_rounds)

    def run_round(self) -> None:
        r = self.replica
        round_started, last_eta = time.monotonic(), 0.0
        while not self.budget_spent(round_started) and not self.done():
            self.train_step()
            if time.monotonic() - last_eta > 1.0:
                self.node.update_record(eta=self.eta(round_started))
                last_eta = time.monotonic()
        if self.done():
            return
        train_s = time.monotonic() - round_started
        ready_at = time.monotonic()
        self.node.update_record(ready=True, eta=time.time())
        future = self.node.submit(self.averager.form_group(round_number=r.round, state_hash=r.state_hash(), my_eta=time.time()))
        while not future.done():  # keep the accelerator busy while the group forms
            if self.stop or (self.run.max_steps and r.step >= self.run.max_steps):
                future.cancel()
                break
            if self.run.train_while_waiting:
                self.train_step()
            else:
                concurrent.futures.wait([future], timeout=0.2)
        wait_s = time.monotonic() - ready_at
        record: dict[str, Any] = {"round": r.round, "train_s": round_float(train_s), "wait_s": round_float(wait_s)}
        try:
            outcome = future.result(timeout=0)
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
            self.node.update_record(ready=False)
            return
        except RoundAborted as exc:
            self.node.update_record(ready=False)
            self._log_round({**record, "outcome": "aborted", "reason": str(exc)})
            return
        if isinstance(outcome, Behind):
            self.node.update_record(ready=False)
            self._log_round({**record, "outcome": "behind", "target_round": outcome.round})
            if not self.sync_to(outcome) and self.run.max_rounds and outcome.round >= self.run.max_rounds:
                # The swarm is done and its peers are leaving: nothing left to join, so do not wait forever.
                self.stop.request(f"the swarm finished round {outcome.round} and its final state could not be fetched")
            return
        self.exchange(outcome, record)

    def exchange(self, group: Group, record: dict[str, Any]) -> None:
        r = self.replica
        started = time.monotonic()
        delta = flatten(r.pseudo_gradient(), r.names)
        tokens, staleness = r.round_tokens, self.staleness
        base_round = r.round
        try:
            if group.is_leader:
                averaged, encoded = self.node.call(self.averager.reduce_as_leader(group, delta, tokens, staleness), timeout=self.rounds.exchange_timeout_s * 3)
                self.faults.hit("leader_before_commit", group.round)
                self.apply(averaged.delta)
                new_hash = r.state_hash()
                self.bytes_sent += self.node.call(self.averager.commit_as_leader(group, averaged, encoded, new_hash), timeout=self.rounds.exchange_timeout_s * 3)
            else:
                averaged = self.node.call(self.averager.exchange_as_member(group, delta, tokens, staleness), timeout=self.rounds.exchange_timeout_s * 4)
                self.apply(averaged.delta)
                new_hash = r.state_hash()
                self.bytes_sent += averaged.bytes_sent
        except (RoundAborted, concurrent.futures.TimeoutError) as exc:
            if group.is_leader:
                self.node.submit(self.averager.abort_as_leader(group, str(exc)))
            self._log_round({**record, "outcome": "aborted", "reason": str(exc) or type(exc).__name__, "members": group.members,
                             "leader": group.leader})
            return
        self.bytes_received += averaged.bytes_received
        self.staleness = 0
        mismatch = averaged.new_state_hash is not None and averaged.new_state_hash != new_hash
        entry = {**record, "outcome": "committed", "round": base_round + 1, "leader": group.leader, "members": averaged.members,
                 "weights": averaged.weights, "excluded": averaged.excluded, "state_hash": new_hash,
                 "average_s": round_float(time.monotonic() - started), "role": "leader" if group.is_leader else "member",
                 "direct": averaged.direct}
        if mismatch:
            entry["outcome"] = "hash_mismatch"
            entry["leader_hash"] = averaged.new_state_hash
        self.publish_state()
        if r.round % self.run.eval_every == 0:
            entry["eval_loss"] = round_float(r.evaluate_global())
        self._log_round(entry)
        if mismatch:
            donors = [group.leader, *[m for m in averaged.members if m not in (group.leader, self.node.peer_id)]]
            self.sync_to(Behind(round=base_round + 1, state_hash=str(averaged.new_state_hash), donors=donors))
        if self.run.checkpoint_every and r.round % self.run.checkpoint_every == 0:
            checkpoint.save(r, f"{self.run.workdir}/checkpoint", extra={"initial_eval_loss": self.initial_eval})

    def apply(self, averaged: torch.Tensor) -> None:
        r = self.replica
        r.apply_outer(unflatten(averaged, r.global_params, r.names))

    def _log_round(self, entry: dict[str, Any]) -> None:
        entry = {k: v for k, v in entry.items() if v is not None}
        self.history.append(entry)
        self.reports.round({**entry, "step": self.replica.step, "tokens_total": self.replica.tokens})
        if entry.get("outcome") == "committed" and not self._measured_hello:
            self._measured_hello = True
            self.reports.hello(self.replica, tokens_per_s=self.progress.tokens_per_second())
        shown = {k: (v[:16] if k == "state_hash" else v) for k, v in entry.items() if k not in ("members", "weights", "excluded")}
        shown["member_count"] = len(entry.get("members", []))
        if "state_hash" in entry:
            shown["state_hash_full"] = entry["state_hash"]
        if "weights" in entry:
            shown["weights"] = entry["weights"]
        if entry.get("excluded"):
            shown["excluded"] = entry["excluded"]
        self.progress.event("round", **shown)

    def check_compatibility(self) -> None:
        records = self.node.call(self.node.fetch_records(), timeout=30)
        records.pop(self.node.peer_id, None)
        problem = compatibility_problem(records, fingerprint=self.model.fingerprint, config=self.model.config)
        if problem:
            raise IncompatibleSwarm(problem)

    def wait_for_peers(self, *, timeout: float = 300.0) -> None:
        """Hold training until `--wait-for-peers` compatible peers are visible, so a fresh swarm starts together."""
        wanted = self.run.wait_for_peers
        deadline = time.monotonic() + timeout
        while wanted > 1 and not self.stop and time.monotonic() < deadline:
            records = self.node.call(self.node.fetch_records(), timeout=30)
            records.pop(self.node.peer_id, None)
            seen = 1 + sum(r.version == PROTOCOL_VERSION and r.fingerprint == self.model.fingerprint for r in records.values())
            if seen >= wanted:
                return
            self.stop.event.wait(0.5)
        if wanted > 1 and not self.stop:
            logger.warning("only some of the %d peers showed up within %.0fs; starting anyway", wanted, timeout)

    def initial_sync(self) -> None:
        r = self.replica
        for _ in range(3):
            records = self.node.call(self.node.fetch_records(), timeout=30)
            records.pop(self.node.peer_id, None)
            compatible = {p: x for p, x in records.items() if x.version == PROTOCOL_VERSION and x.fingerprint == self.model.fingerprint}
            target = choose_target(compatible, self.node.peer_id, r.round, r.state_hash())
            if target is None or self.sync_to(target):
                return

    def run_forever(self) -> dict[str, Any]:
        r = self.replica
        self.reports = SwarmReports(self.run.coordinator, self.net.identity, self.net.run_id)
        self.node.start()
        try:
            self.averager = GroupAverager(self.node, self.rounds, self.model)
            self.server = StateServer(self.node, self.model.fingerprint)
            self.averager.faults = self.faults
            if self.faults.match("serve_state", r.round) == "corrupt":
                self.server.tamper = corrupt
            self.node.call(self.averager.register(), timeout=30)
            self.node.call(self.server.register(), timeout=30)
            meta = checkpoint.load(r, f"{self.run.workdir}/checkpoint") if self.run.resume else {}
            self.publish_state()
            self.progress.event("joined", peer_id=self.node.peer_id, maddrs=self.node.visible_maddrs(), round=r.round)
            self.check_compatibility()
            self.reports.hello(r)
            # θ_0 is the same on every fresh peer (same seed), so this is the run's initial loss, measured before
            # any state is pulled from the swarm; a resumed peer keeps the value from its checkpoint.
            self.initial_eval = meta.get("initial_eval_loss") or r.evaluate_global()
            self.wait_for_peers()
            self.initial_sync()
            start_tokens, started = r.tokens, time.perf_counter()
            try:
                while not self.done():
                    self.run_round()
            finally:
                self.progress.close()
                checkpoint.save(r, f"{self.run.workdir}/checkpoint", extra={"initial_eval_loss": self.initial_eval})
            wall = time.perf_counter() - started
            if self.run.linger_s and not self.stop:
                self.progress.event("linger", seconds=self.run.linger_s, round=r.round)
                self.stop.event.wait(self.run.linger_s)  # keep serving our state to peers that are catching up
            final_eval = r.evaluate_global()
            return {
                "mode": "swarm", "task": r.task.name, "peer_id": self.node.peer_id, "initial_eval_loss": round_float(self.initial_eval),
                "final_eval_loss": round_float(final_eval), "steps": r.step, "rounds": r.round, "tokens": r.tokens,
                "tokens_per_s": round_float((r.tokens - start_tokens) / wall) if wall > 0 else 0.0, "wall_s": round_float(wall),
                "compute_s": round_float(self.compute_s), "state_hash": r.state_hash(), "resyncs": self.resyncs,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "stopped_early": bool(self.stop),
                "history": self.history,
            }
        finally:
            self.reports.close()
            self.node.shutdown()


def run_swarm_peer(replica: Replica, cfg: dict[str, Any], *, stop: StopFlag) -> dict[str, Any]:
    return SwarmPeer(replica, cfg, stop).run_forever()
