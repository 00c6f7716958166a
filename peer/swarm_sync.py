"""Swarm training: the sync strategy that ends a round by averaging with other peers.

Per round: train from θ_r until the budget is spent — or earlier, when a group for our round is already forming
or the swarm has moved past θ_r (a slow peer then contributes what it has instead of missing the round) — mark
ourselves ready and keep training while a group forms, then let the averager run the round and apply its result.
A round counts only with its commit certificate: without one the peer rolls its outer step back and keeps its local
progress for the next round. A peer that is behind — another peer shows a certified state that outranks its own —
downloads that state, verified by hash and checked finite, keeping its recent progress as a discounted stale
contribution where the others can merge it (`swarm_state.progress_kept`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from swarmloco.peer.adoption import AdoptionCheck, Verdict
from swarmloco.peer.config import PeerConfig
from swarmloco.peer.credit_probe import credit_probe
from swarmloco.peer.progress import finite_or_none, round_float
from swarmloco.peer.replica import Replica
from swarmloco.peer.round_reports import RoundReports
from swarmloco.peer.round_watch import RoundWatch
from swarmloco.peer.signals import StopFlag
from swarmloco.peer.swarm_state import (
    distrust,
    fetch_state,
    flatten,
    genesis_hash,
    linger_for_peers,
    local_model,
    parse_blob,
    progress_kept,
    rebase,
    resumed_head,
    state_blob,
    unflatten,
)
from swarmloco.peer.tickets import Admission
from swarmloco.peer.training import TrainingLoop, harness_hooks
from swarmloco.protocol.base.hashing import known_leaves
from swarmloco.protocol.base.hooks import Hooks
from swarmloco.protocol.base.outcome import Outcome
from swarmloco.protocol.base.records import PeerRecord
from swarmloco.protocol.base.text import short_hash
from swarmloco.protocol.chain.forks import Behind
from swarmloco.protocol.chain.state_sync import ServedState, StateServer
from swarmloco.protocol.network.node import SwarmNode
from swarmloco.protocol.round.averager import Averager, Contribution, RoundResult
from swarmloco.protocol.round.groups import Group, RoundAborted
from swarmloco.protocol.round.rules import compatibility_problem, compatible, group_forming
from swarmloco.protocol.trust.certificates import Certificate, Head
from swarmloco.protocol.trust.identity import load_or_create_identity

logger = logging.getLogger(__name__)
RECORDS_TIMEOUT_S = 30.0
STALE_TRIES = 3  # rounds in a row that may discard our kept progress before we drop it


class IncompatibleSwarm(RuntimeError):
    """The swarm's records show peers this one cannot average with (another protocol version or model)."""


class SwarmSync:
    mode = "swarm"

    def __init__(self, cfg: PeerConfig, hooks: Hooks) -> None:
        self.cfg, self.hooks = cfg, hooks
        identity = cfg.identity_path
        Path(identity).parent.mkdir(parents=True, exist_ok=True)
        self.admission = Admission(cfg.admission, load_or_create_identity(identity), cfg.network.run_id,
                                   cfg.run.coordinator)
        self.net = replace(cfg.network, identity=identity)
        self.node = SwarmNode(self.net, credentials=self.admission.credentials, gate=self.admission.gate)
        self.reports = RoundReports(cfg.run.coordinator, identity, self.net.run_id)
        self.staleness = self.bytes_sent = self.bytes_received = 0
        self.stale_tries = 0  # rounds discarded in a row while we offered progress kept across a resync
        self.state_hash = ""
        self.head: Head | None = None
        self.refused: tuple[int, str] | None = None  # the last state we downloaded and refused to adopt
        self._measured_hello = False

    # --- start-up -------------------------------------------------------------------------------------------------
    def start(self, loop: TrainingLoop) -> None:
        r = loop.replica
        self.loop, self.replica = loop, r
        self.model = local_model(r, self.cfg.runtime.seed)
        self.adoption = AdoptionCheck(r, self.cfg.adopt)
        self.genesis = genesis_hash(r)
        loop.on_step = lambda loss: self.reports.step(r, loss, loop.progress.tokens_per_second())
        self.admission.start()
        self.node.start()
        creds, gate = self.admission.credentials, self.admission.gate
        self.averager = Averager(self.node, self.cfg.round, self.model, credentials=creds, gate=gate,
                                 genesis_hash=self.genesis, hooks=self.hooks, probe=credit_probe(r))
        self.averager.start()  # first: the state server shares its data plane
        self.server = StateServer(self.node, self.model.fingerprint, gate=gate, credentials=creds,
                                  data_plane=self.averager.data_plane,
                                  control_timeout_s=self.cfg.round.control_timeout_s, hooks=self.hooks)
        self.node.call(self.server.register(), timeout=RECORDS_TIMEOUT_S)
        self.publish_state(resumed_head(r, loop.resumed, genesis=self.genesis, verify=self.averager.chain.verify))
        loop.progress.event("joined", peer_id=self.node.peer_id, maddrs=self.node.visible_maddrs(), round=r.round)
        problem = compatibility_problem(self.others(), fingerprint=self.model.fingerprint, config=self.model.config)
        if problem:
            raise IncompatibleSwarm(problem)
        self.reports.hello(r)
        self.wait_for_peers()
        self.initial_sync()

    def others(self) -> dict[str, PeerRecord]:
        """The other peers' records; none when the read timed out (a loaded machine): every caller looks again."""
        try:
            return self.node.call(self.node.fetch_records(timeout=RECORDS_TIMEOUT_S / 3), timeout=RECORDS_TIMEOUT_S)
        except TimeoutError:
            return {}

    def wait_for_peers(self, *, timeout: float = 300.0) -> None:
        """Hold training until `--wait-for-peers` compatible peers are visible, so a fresh swarm starts together."""
        wanted, stop = self.cfg.run.wait_for_peers, self.loop.stop
        deadline = time.monotonic() + timeout
        while wanted > 1 and not stop and time.monotonic() < deadline:
            if 1 + len(compatible(self.others(), self.model.fingerprint)) >= wanted:
                return
            stop.event.wait(0.5)
        if wanted > 1 and not stop:
            logger.warning("only some of the %d peers showed up within %.0fs; starting anyway", wanted, timeout)

    def initial_sync(self) -> None:
        for _ in range(3):
            target = self.target(compatible(self.others(), self.model.fingerprint))
            if target is None or self.sync_to(target):
                return

    def target(self, records: dict[str, PeerRecord]) -> Behind | None:
        """The best verified certified state that outranks ours (certificates are fetched and checked here)."""
        try:
            return self.node.call(self.averager.chain.target(records), timeout=RECORDS_TIMEOUT_S + 5)
        except concurrent.futures.TimeoutError:  # the chain bounds its own lookups; this only guards the thread hop
            return None

    # --- state ----------------------------------------------------------------------------------------------------
    def publish_state(self, head: Head) -> None:
        """Serve and announce the certified state this peer now holds (not ready: its new round starts now)."""
        r = self.replica
        self.head, self.state_hash = head, head.state_hash
        cert = head.certificate.to_bytes() if head.certificate is not None else b""
        self.server.publish(ServedState(round=r.round, state_hash=head.state_hash, blob=state_blob(r),
                                        certificate=cert, leaves=known_leaves(head.state_hash) or ()))
        self.averager.set_state(head)
        self.loop.checkpoint_extra.update(certificate=cert.decode() or None, work=head.work)
        record = PeerRecord.announce(fingerprint=self.model.fingerprint, config_json=self.model.config_json,
                                     round=r.round, state_hash=head.state_hash, work=head.work, eta=time.time() + 60)
        self.node.update_record(**record.to_value())

    def sync_to(self, target: Behind) -> bool:
        """Download, verify and adopt the agreed state; local progress is kept as a stale contribution if young
        enough."""
        r = self.replica
        started = time.perf_counter()
        fetched = fetch_state(self.node, self.averager.chain, target, r, fingerprint=self.model.fingerprint,
                              control_timeout_s=self.cfg.round.control_timeout_s,
                              ticket=self.admission.credentials.ticket)
        if fetched is None:
            return False
        blob, bad, target = fetched  # (a newer state than the target when the donors moved on to it)
        params, momentum = parse_blob(blob, r)
        # The hash matched a certified statement; whether the state is worth training from is ours to judge.
        cert = target.certificate
        next_round = cert is not None and target.round == r.round + 1 and cert.statement.prev_hash == self.state_hash
        verdict = self.adoption.verdict(params, momentum, next_round=next_round)
        if verdict.problem:
            self._refuse(target, verdict)
            return False
        staleness = self.staleness + max(1, target.round - r.round)
        keep, ours = progress_kept(target, round_number=r.round, state_hash=self.state_hash, me=self.node.peer_id,
                                   steps=r.round_steps, staleness=staleness, max_staleness=self.cfg.round.max_staleness)
        self.reports.resynced(0 if keep or ours else r.round_tokens)  # neither merged nor kept: wasted
        rebase(r, params, momentum, target.round, keep_progress=keep)
        self.staleness, self.stale_tries = (staleness if keep else 0), 0
        self.loop.progress.event(
            "resync",
            round=target.round,
            state_hash=short_hash(target.state_hash),
            kept_progress=keep,
            failures=bad,
            seconds=round_float(time.perf_counter() - started),
            loss=finite_or_none(verdict.new_loss),
            own_loss=finite_or_none(verdict.own_loss),
        )
        self.publish_state(Head.of(target.certificate))  # rebase loaded exactly the bytes verified against it
        return True

    def _refuse(self, target: Behind, verdict: Verdict) -> None:
        """Never adopt this state, and distrust whoever claimed or signed it."""
        self.refused = (target.round, target.state_hash)
        peers = distrust(self.node, self.averager.chain, target, verdict.problem, timeout=RECORDS_TIMEOUT_S)
        self.loop.progress.event("refused", round=target.round, state_hash=short_hash(target.state_hash),
                                 why=verdict.problem, loss=finite_or_none(verdict.new_loss),
                                 own_loss=finite_or_none(verdict.own_loss), distrusted=peers)

    # --- one round ------------------------------------------------------------------------------------------------
    async def _forming(self) -> bool:
        """Whether to end local training now: a group for our round is forming, or the swarm moved past θ_r."""
        records = compatible(await self.node.fetch_records(timeout=RECORDS_TIMEOUT_S / 3), self.model.fingerprint)
        behind = await self.averager.chain.target(records, wait=0)  # verified claims: at a later look
        return group_forming(records, self.replica.round, self.state_hash) or behind is not None

    def round(self, loop: TrainingLoop) -> None:
        r = loop.replica
        started = time.monotonic()
        watch = RoundWatch(self.node, eta=lambda: loop.eta(started), step_s=loop.step_seconds,
                           forming=self._forming if self.cfg.budget.close_early else None).start()
        try:
            train_s, _ = loop.train_round(stop_early=lambda _: watch.seen())
        finally:
            watch.stop()
        if loop.done():
            return
        while True:
            # A look that formed no group is followed by another at once, ready since the same moment (the matchmaker
            # keeps our readiness time: Matchmaker._ready), not by another training budget.
            ready_at = time.monotonic()
            found = self.averager.find_group(r.round, self.state_hash)
            while not found.done():  # keep the accelerator busy while the group forms
                if loop.steps_exhausted():
                    found.cancel()
                    break
                if self.cfg.run.train_while_waiting:
                    loop.train_step()
                else:
                    concurrent.futures.wait([found], timeout=0.2)
            entry: dict[str, Any] = {"round": r.round, "train_s": round_float(train_s),
                                     "wait_s": round_float(time.monotonic() - ready_at)}
            try:
                outcome = found.result(timeout=0)
                break
            except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
                self.node.update_record(ready=False)
                return
            except RoundAborted as exc:
                self.log_round({**entry, "outcome": Outcome.DISCARDED, "reason": str(exc)})
                if loop.done() or loop.steps_exhausted():
                    self.node.update_record(ready=False)
                    return
                train_s = 0.0
        if isinstance(outcome, Behind):
            self.node.update_record(ready=False)
            self.log_round({**entry, "outcome": Outcome.BEHIND, "target_round": outcome.round})
            max_rounds = self.cfg.run.max_rounds
            adopted = self.sync_to(outcome)
            refused = self.refused == (outcome.round, outcome.state_hash)  # judged, not merely out of reach
            if not adopted and max_rounds and outcome.round >= max_rounds and not refused:
                # The swarm is done and its peers are leaving: nothing left to join, so do not wait forever. (Not
                # for a state we refused: a claim of a far round must not be a way to stop honest peers.)
                loop.stop.request(f"the swarm finished round {outcome.round} and its final state could not be fetched")
            return
        self.average(outcome, entry)

    def _apply(self, average: torch.Tensor) -> str:
        """The outer step with the round's average, on the training thread; returns the new state hash."""
        r = self.replica
        r.apply_outer(unflatten(average, r.global_params, r.names))
        return r.state_hash()

    def average(self, group: Group, entry: dict[str, Any]) -> None:
        r = self.replica
        base_round = r.round
        contribution = Contribution(
            delta=flatten(r.pseudo_gradient(), r.names), tokens=r.round_tokens, staleness=self.staleness
        )
        before: list[Any] = []
        marks = [time.monotonic()]  # run_round's start, then the average's arrival and the outer step's end

        def apply(average: torch.Tensor) -> str:
            marks.append(time.monotonic())
            before.append(r.snapshot())  # undone unless the round is certified
            new_hash = self._apply(average)
            marks.append(time.monotonic())
            return new_hash

        result: RoundResult = self.averager.run_round(group, contribution, apply=apply,
                                                      rollback=lambda: r.restore(before[-1]))
        entry.update(outcome=result.outcome, leader=result.leader, members=result.members, role=result.role,
                     view=group.view, passes=result.passes,  # 2: reduced again without a reducer that failed it
                     cheaters=result.cheaters or None)  # peers proven to have cheated, banned from now on
        if result.outcome == Outcome.DISCARDED:
            self.node.update_record(ready=False)
            self.log_round({**entry, "reason": result.reason})
            self.stale_tries = self.stale_tries + 1 if self.staleness else 0
            if self.stale_tries >= STALE_TRIES:
                # Progress kept across a resync that no group merges: its base may be a state the others never
                # held (we resynced across a fork further back than we could tell). Train afresh from θ_r.
                self.reports.resynced(r.round_tokens)  # wasted
                r.reset_local()
                self.staleness = self.stale_tries = 0
            return
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        cert = result.certificate
        assert cert is not None, "a committed or mismatched round always carries its certificate"
        entry.update(
            round=base_round + 1,
            weights=result.weights, credit=cert.statement.credit and list(cert.statement.credit),  # verified work
            excluded=result.excluded,
            state_hash=cert.statement.new_hash,
            average_s=round_float(result.seconds),
            certify_s=round_float(result.certify_s),  # of average_s: votes and the certificate
            exchange_s=round_float(marks[1] - marks[0]) if len(marks) == 3 else None,  # until the average is here
            pipes=result.pipes, direct=result.direct,  # shard connections to the others; of those, on TCP
            bytes_sent=result.bytes_sent, bytes_received=result.bytes_received, audit_s=round_float(result.audit_s),
        )
        if result.outcome == Outcome.MISMATCH:
            # We rolled back; the certified state is the one the others reached.
            entry["our_hash"] = result.state_hash
            self.log_round(entry)
            donors = [m for m in cert.statement.members if m != self.node.peer_id]
            self.sync_to(Behind(round=base_round + 1, state_hash=cert.statement.new_hash, donors=donors,
                                work=cert.statement.work, certificate=cert))
            return
        self.staleness = 0
        self.publish_state(Head.of(cert))
        self.log_round(self.loop.after_round(entry), recorded=True, certificate=cert)

    def log_round(self, entry: dict[str, Any], *, recorded: bool = False,
                  certificate: Certificate | None = None) -> None:
        entry = {k: (str(v) if k == "outcome" else v) for k, v in entry.items() if v is not None}
        if not recorded:
            self.loop.history.append(entry)
        report = {**entry, "step": self.replica.step, "tokens_total": self.replica.tokens}
        if certificate is not None:
            report["certificate"] = certificate.to_bytes().decode()  # what the coordinator credits the round by
        self.reports.round(report, pending_tokens=self.replica.round_tokens)
        if entry.get("outcome") == Outcome.COMMITTED and not self._measured_hello:
            self._measured_hello = True
            self.reports.hello(self.replica, tokens_per_s=self.loop.progress.tokens_per_second())
        shown = {
            k: (short_hash(v) if k == "state_hash" else v)
            for k, v in entry.items()
            if k not in ("members", "weights", "excluded")
        }
        shown["member_count"] = len(entry.get("members", []))
        if "state_hash" in entry:
            shown["state_hash_full"] = entry["state_hash"]
        for key in ("weights", "excluded", "members"):
            if entry.get(key):
                shown[key] = entry[key]
        self.loop.progress.event("round", **shown)

    # --- the end --------------------------------------------------------------------------------------------------
    def finish(self, loop: TrainingLoop) -> None:
        if (linger := self.cfg.run.linger_s) and not loop.stop:
            loop.progress.event("linger", seconds=linger, round=loop.replica.round)
            linger_for_peers(linger, round_=loop.replica.round, wanted=self.cfg.run.wait_for_peers,
                             stop=loop.stop.event, read=lambda: compatible(self.others(), self.model.fingerprint))

    def summary(self, loop: TrainingLoop) -> dict[str, Any]:
        return {"peer_id": self.node.peer_id, "resyncs": self.reports.resyncs, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received}

    def close(self) -> None:
        self.admission.stop()
        self.reports.close()
        if self.node.p2p is not None and getattr(self, "averager", None) is not None:
            try:
                self.averager.close()
            except Exception as exc:  # best effort on the way out
                logger.debug("closing the data plane: %r", exc)
        self.node.shutdown()


def run_swarm_peer(replica: Replica, cfg: PeerConfig, *, stop: StopFlag) -> dict[str, Any]:
    hooks = harness_hooks()
    return TrainingLoop(replica, cfg, stop, hooks=hooks).run(SwarmSync(cfg, hooks))
