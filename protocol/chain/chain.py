"""This peer's view of the certified chain: the state it holds, and its verdicts on the states others claim.

A record that names a state is only a claim. Before a peer re-syncs to a claimed state, it fetches the state's
commit certificate from a claimant and verifies it offline (signatures, tickets, majority), and checks that the
certificate still speaks for the swarm it sees now (`swarmloco.protocol.trust.certificates.supports`). The fork choice
between verified states is `swarmloco.protocol.chain.forks.outranks` (most certified work), the same on every peer, so
two chains that grew apart during a partition become one again once the peers see each other.

Verified certificates are cached per (round, hash), and a claimant that failed to back its claim is not asked again
for a while, so a peer that claims a thousand states costs one refused lookup per minute, never a download.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from swarmloco.protocol.base.records import PeerRecord
from swarmloco.protocol.base.text import short_hash, short_id
from swarmloco.protocol.chain.forks import Behind, StateClaim, active_past_genesis, better_claims, outranks
from swarmloco.protocol.chain.state_sync import StateSyncError, fetch_certificate
from swarmloco.protocol.network.transport import Transport
from swarmloco.protocol.trust.admission import Credentials, Gate
from swarmloco.protocol.trust.certificates import Certificate, Head, supports
from swarmloco.protocol.trust.checkpoints import supports_by_seniority

logger = logging.getLogger(__name__)
MAX_VERDICTS = 512
MAX_CLAIMS_CHECKED = 3  # per look: the best few claims (each costs at most one small request per claimant tried)
MAX_CLAIMANTS_ASKED = 2
MAX_CHECKS_IN_FLIGHT = 4  # background certificate checks at once, however many peers claim a newer state
DISTRUST_S = 60.0  # a claimant that served an invalid certificate is not asked again for this long
UNREACHABLE_S = 30.0  # nor one that did not answer in time (each ask of a hanging claimant holds a check slot)


class Chain:
    def __init__(self, transport: Transport, *, gate: Gate, credentials: Credentials, fingerprint: str, quorum: int,
                 genesis_hash: str, control_timeout: float) -> None:
        self.transport, self.gate, self.credentials = transport, gate, credentials
        self.fingerprint, self.quorum, self.control_timeout = fingerprint, quorum, control_timeout
        self.genesis_hash = genesis_hash
        self.head = Head(0, genesis_hash)
        self._verdicts: OrderedDict[tuple[int, str], Certificate] = OrderedDict()
        self._distrust: dict[str, float] = {}  # peer -> until when we do not ask it for certificates
        self._liars: dict[str, float] = {}  # peer -> until when it is not counted: it could not back its claim
        self._checks: dict[tuple[int, str], asyncio.Task[None]] = {}  # claims whose certificate is being fetched
        # claims whose claimant served the certificate of a newer state instead: that state, and who served it
        self._moved: OrderedDict[tuple[int, str], tuple[Certificate, str]] = OrderedDict()
        # states this peer downloaded and refused on its own checks: never fetched again
        self._refused: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._seen: dict[str, PeerRecord] = {}  # the records of the last look for a target

    def close(self) -> None:
        """Cancel the background certificate checks still running (on the loop)."""
        for task in list(self._checks.values()):
            task.cancel()
        self._checks.clear()

    def set_head(self, head: Head) -> None:
        self.head = head
        if head.certificate is not None:
            self._remember((head.round, head.state_hash), head.certificate)

    def refuse(self, round_number: int, state_hash: str, peers: Iterable[str]) -> None:
        """A certified state failed this peer's own checks (peer/adoption.py): it is never a target again, and the
        peers that claimed or signed it are treated like liars for `DISTRUST_S`: not asked, not counted."""
        self._refused[(round_number, state_hash)] = None
        while len(self._refused) > MAX_VERDICTS:
            self._refused.popitem(last=False)
        until = self.transport.clock.monotonic() + DISTRUST_S
        for peer in peers:
            if peer != self.transport.peer_id:
                self._distrust[peer] = self._liars[peer] = until

    def verify(self, certificate: Certificate) -> str:
        """Why `certificate` proves nothing ("" when it is valid)."""
        return certificate.problem(run_id=self.transport.run_id, gate=self.gate, quorum=self.quorum)

    def credible(self, records: Mapping[str, PeerRecord]) -> dict[str, PeerRecord]:
        """The records that count toward the swarm a group must be a majority of: not those of peers that just
        failed to back a claim, nor any claim ahead of our state whose certificate we have not verified. Else a few
        admitted peers claiming far-ahead rounds — refusing, or simply never answering, certificate requests —
        would raise the majority out of the honest peers' reach. A peer truly ahead is verified on the next look
        (and then we re-sync to it rather than form a group without it)."""
        h = self.head
        ours = (h.work, h.round, h.state_hash)
        return {p: r for p, r in self._not_liars(records).items()
                if (r.round, r.state_hash) in self._verdicts or not outranks((r.work, r.round, r.state_hash), ours)}

    def _not_liars(self, records: Mapping[str, PeerRecord]) -> dict[str, PeerRecord]:
        now = self.transport.clock.monotonic()
        return {p: r for p, r in records.items() if self._liars.get(p, 0.0) <= now}

    async def target(self, records: Mapping[str, PeerRecord], *, wait: float | None = None) -> Behind | None:
        """The best verified state that outranks ours, or None.

        The certificates of the best few claims not verified yet are fetched in the background, at most one check
        per claim and `MAX_CHECKS_IN_FLIGHT` in all; a claimant that failed to answer or to back its claim is not
        asked again for a while. `wait`: how long to wait for those checks before answering with what is verified
        (None: three control timeouts). Matchmaking passes 0, so a stranger's claim, answered or not, never delays
        leading, joining or the exchange: a claim verified in the background is acted on at the next look."""
        self._seen = dict(records)
        claims = self._claims(records)[:MAX_CLAIMS_CHECKED]
        checks = [task for claim in claims if (task := self._check(claim)) is not None]
        wait = 3 * self.control_timeout if wait is None else wait
        if checks and wait > 0:
            await asyncio.wait(checks, timeout=wait)
        for claim in claims:
            verdict, claim = self._verified(claim)
            if (claim.round, claim.state_hash) in self._refused:
                continue
            behind = self._accept(claim, verdict, records)
            if behind is not None:
                return behind
        return None

    def follows(self, certificate: Certificate, target: Behind) -> bool:
        """Whether a download of `target` may take instead the state `certificate` certifies, which a donor serves
        now: valid, ahead of the target and of our state by the fork choice, not refused nor before or beside the
        authority's checkpoint, and speaking for the swarm of our last look (the tests a claim passes)."""
        s, cp = certificate.statement, self.gate.checkpoint
        if self.verify(certificate) or (s.round, s.new_hash) in self._refused or \
                (cp is not None and cp.precedes(s.round, s.new_hash)):
            return False
        if not outranks((s.work, s.round, s.new_hash), (target.work, target.round, target.state_hash)) or \
                not self._ahead_of_head(s.work, s.round, s.new_hash):
            return False
        claim = StateClaim(round=s.round, state_hash=s.new_hash, work=s.work, donors=())
        if not self._speaks_for_us(claim, certificate, self._seen):
            return False
        self._remember((s.round, s.new_hash), certificate)
        return True

    def _check(self, claim: StateClaim) -> asyncio.Task[None] | None:
        """The background check of a claim not verified yet (started here if none runs and there is room)."""
        key = (claim.round, claim.state_hash)
        if key in self._verdicts or key in self._moved:
            return None
        if key not in self._checks and len(self._checks) < MAX_CHECKS_IN_FLIGHT:
            task = asyncio.get_running_loop().create_task(self._run_check(key, claim))
            self._checks[key] = task
            task.add_done_callback(lambda _, key=key: self._checks.pop(key, None))
        return self._checks.get(key)

    async def _run_check(self, key: tuple[int, str], claim: StateClaim) -> None:
        verdict, donor = await self._fetch_verdict(claim)
        if verdict is not None and (verdict.statement.round, verdict.statement.new_hash) != key:
            # The claimant moved on since its record was read: its newer certified state is as good.
            self._moved[key] = (verdict, donor)
            while len(self._moved) > MAX_VERDICTS:
                self._moved.popitem(last=False)

    def _verified(self, claim: StateClaim) -> tuple[Certificate | None, StateClaim]:
        """The verified certificate behind a claim (None if there is none yet), and the claim it proves: the
        claimant's newer state when it had moved on."""
        key = (claim.round, claim.state_hash)
        verdict = self._verdicts.get(key)
        if verdict is not None or key not in self._moved:
            return verdict, claim
        verdict, donor = self._moved[key]
        s = verdict.statement
        if not self._ahead_of_head(s.work, s.round, s.new_hash):
            return None, claim
        return verdict, StateClaim(round=s.round, state_hash=s.new_hash, work=s.work, donors=(donor,))

    # --- internals ------------------------------------------------------------------------------------------------
    def _ahead_of_head(self, work: int, round_number: int, state_hash: str) -> bool:
        """Whether a state is worth moving to from ours: it outranks ours (fork choice), or it is the checkpointed
        state and ours precedes the checkpoint (a heavier chain adopted before the checkpoint arrived)."""
        h, cp = self.head, self.gate.checkpoint
        if cp is not None and (round_number, state_hash) == (cp.round, cp.state_hash):
            return cp.precedes(h.round, h.state_hash)
        return outranks((work, round_number, state_hash), (h.work, h.round, h.state_hash))

    def _claims(self, records: Mapping[str, PeerRecord]) -> list[StateClaim]:
        """Claims worth checking, best first. With an authority checkpoint, none before it or beside it (whatever
        work they claim), and the checkpointed state itself first: a heavier fabricated chain cannot crowd it out."""
        h, cp = self.head, self.gate.checkpoint
        claims = better_claims(records, round_number=h.round, state_hash=h.state_hash, work=h.work,
                               genesis_hash=self.genesis_hash)
        claims = [c for c in claims if (c.round, c.state_hash) not in self._refused]
        if cp is None:
            return claims
        claims = [c for c in claims if not cp.precedes(c.round, c.state_hash)]
        if cp.precedes(h.round, h.state_hash) and not any((c.round, c.state_hash) == (cp.round, cp.state_hash)
                                                          for c in claims):
            holders = sorted(p for p, r in records.items() if (r.round, r.state_hash) == (cp.round, cp.state_hash))
            if holders:
                claims.append(StateClaim(round=cp.round, state_hash=cp.state_hash,
                                         work=records[holders[0]].work, donors=tuple(holders)))
        return sorted(claims, key=lambda c: (c.round, c.state_hash) != (cp.round, cp.state_hash))

    def _accept(self, claim: StateClaim, verdict: Certificate | None,
                records: Mapping[str, PeerRecord]) -> Behind | None:
        if not isinstance(verdict, Certificate) or verdict.statement.work != claim.work:
            return None
        if not self._speaks_for_us(claim, verdict, records):
            return None
        donors = [p for p in claim.donors if p != self.transport.peer_id]
        if not donors:
            return None
        return Behind(round=claim.round, state_hash=claim.state_hash, donors=donors, work=claim.work,
                      certificate=verdict)

    def _speaks_for_us(self, claim: StateClaim, verdict: Certificate, records: Mapping[str, PeerRecord]) -> bool:
        """Whether a verified certificate speaks for the swarm we see. The state the authority's newest checkpoint
        names does; any other is weighed by its signers' seniority in that checkpoint, and only where nobody we see
        is senior yet (or there is no checkpoint) by how many peers its group was a majority of. Unverified claims
        do count here: the fewer peers a certificate must speak for, the easier a colluding minority's own chain
        would be adopted."""
        cp, s = self.gate.checkpoint, verdict.statement
        if cp is not None and (s.round, s.new_hash) == (cp.round, cp.state_hash):
            return True
        seen = self._not_liars(records)
        others = {p for p, r in seen.items() if r.round >= 1 and p != self.transport.peer_id}
        signers = verdict.valid_signers(self.gate)  # a junk signature under a senior's id weighs nothing
        weighed = supports_by_seniority(cp, signers, others)
        if weighed is not None:
            if not weighed:
                logger.info("round %d %s…: its signers hold %d of the %d seniority we see; not adopting",
                            claim.round, short_hash(claim.state_hash), cp.weight(signers) if cp else 0,
                            cp.weight(others) if cp else 0)
            return weighed
        if not supports(s, active_past_genesis(seen)):
            logger.info("round %d %s…: its certificate speaks for %d peers, we see %d past genesis; not adopting",
                        claim.round, short_hash(claim.state_hash), s.swarm, active_past_genesis(seen))
            return False
        return True

    async def _fetch_verdict(self, claim: StateClaim) -> tuple[Certificate | None, str]:
        """A valid certificate for the claim, or for a newer state of the same claimant that still outranks ours,
        with the claimant that served it; (None, "") when nobody asked could back it. A claimant that serves an
        invalid certificate is distrusted for a minute; one that could not be reached, for 30 s. The state
        itself is never condemned: a liar may claim an honest state too."""
        now = self.transport.clock.monotonic()
        self._distrust = {p: t for p, t in self._distrust.items() if t > now}
        self._liars = {p: t for p, t in self._liars.items() if t > now}
        asked = [p for p in claim.donors if p not in self._distrust][:MAX_CLAIMANTS_ASKED]
        for peer in asked:
            try:
                cert = await fetch_certificate(self.transport, peer, fingerprint=self.fingerprint,
                                               ticket=self.credentials.ticket, timeout=self.control_timeout)
            except StateSyncError as exc:  # it answered, but with no certificate for what it claims: a lie
                self._distrust[peer] = self._liars[peer] = now + DISTRUST_S
                logger.warning("not adopting round %d %s… claimed by %s: %s", claim.round, short_hash(claim.state_hash),
                               short_id(peer), exc)
                continue
            except Exception as exc:  # unreachable or too slow: ask again soon
                self._distrust[peer] = now + UNREACHABLE_S
                logger.info("no certificate for round %d from %s: %r", claim.round, short_id(peer), exc)
                continue
            s = cert.statement
            problem = self.verify(cert)
            if not problem and not self._ahead_of_head(s.work, s.round, s.new_hash):
                problem = f"it certifies round {s.round}, which does not outrank ours"
            if not problem:
                self._remember((s.round, s.new_hash), cert)
                return cert, peer
            self._distrust[peer] = self._liars[peer] = now + DISTRUST_S
            logger.warning("not adopting round %d %s… claimed by %s: %s", claim.round, short_hash(claim.state_hash),
                           short_id(peer), problem)
        return None, ""

    def _remember(self, key: tuple[int, str], verdict: Certificate) -> None:
        self._verdicts[key] = verdict
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > MAX_VERDICTS:
            self._verdicts.popitem(last=False)
