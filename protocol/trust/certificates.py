"""Commit certificates: the proof that θ_{r+1} is the swarm's state and not one peer's claim.

A round's members each re-derive θ_{r+1} from the average they received and sign one `Statement`: the run, the
new round number, the previous and the new state hash, who contributed with which weight, what verified work each
was credited, how many active peers the group was formed among (`swarm`), and the chain's cumulative credited
tokens (`work`). A `Certificate` is that statement with signatures of at least `need(swarm, quorum)` distinct
admitted members: a majority of the active swarm, so two disjoint groups cannot both certify the same round.

Everything here is checked offline by whoever receives a certificate: signatures against the keys inlined in the
peer ids, tickets against the run's authority (`swarmloco.protocol.trust.admission.Gate`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.trust.admission import Gate
from swarmloco.protocol.trust.identity import Identity, verify

__all__ = ["Certificate", "Head", "Statement", "need", "supports"]

MAX_CERT_BYTES = 512 * 1024
MAX_MEMBERS = 10_000
MAX_WORK = 2**62
SIGNER_GRACE_S = 7 * 86400.0
_DOMAIN = b"swarmloco-commit-v1\n"
_HASH = re.compile(r"[0-9a-f]{64}")


def signed_by(peer: str, body: bytes, signature: str) -> bool:
    """Whether `signature` (hex) is `peer`'s signature of `body`."""
    try:
        return verify(peer, body, bytes.fromhex(signature))
    except ValueError:
        return False


def refusal_to_sign(statement: Statement, prev: Head, *, round_number: int, swarm: int,
                    group_members: Sequence[str], me: str, my_tokens: int) -> str:
    """Why a member refuses to sign a well-formed statement its leader sent ("" when it signs). It must extend the
    state we hold, with the work that state certified plus this round's weights, among the peers of our group, for
    the swarm size announced when the group closed, and weigh us no more than the tokens we claimed. (The weights
    themselves are re-derived from the contributors' signed claims before this: `swarmloco.protocol.round.exchange`.)"""
    s = statement
    if s.prev_hash != prev.state_hash or round_number != prev.round:
        return "it starts from another state than ours"
    if s.work != prev.work + sum(s.credited):
        return f"work {s.work} is not ours ({prev.work}) plus this round's credit"
    if s.swarm != swarm:
        return f"swarm {s.swarm} differs from the {swarm} announced at close"
    if not set(s.members) <= set(group_members):
        return "it names contributors outside our group"
    weights = dict(zip(s.members, s.weights, strict=True))
    if me in weights and weights[me] > max(my_tokens, 1):
        return f"our weight {weights[me]} exceeds the {my_tokens} tokens we sent"
    return ""


def need(swarm: int, quorum: int) -> int:
    """Signatures a round of a `swarm`-peer swarm needs: the quorum, and more than half of the swarm."""
    return max(quorum, swarm // 2 + 1)


def supports(statement: Statement, active: int) -> bool:
    """Whether a certificate made among `statement.swarm` peers speaks for a swarm in which we now see `active`
    peers past genesis: a group that was a majority of at least half of them. A few colluders signing among
    themselves claim a small swarm, and fail this against the honest peers we see."""
    return 2 * statement.swarm >= active


@dataclass(frozen=True, kw_only=True)
class Statement:
    run_id: str
    round: int  # the new round r+1
    prev_hash: str  # θ_r
    new_hash: str  # θ_{r+1}
    members: tuple[str, ...]  # contributors, sorted
    weights: tuple[int, ...]  # their merge weights, same order
    swarm: int  # active peers the group was formed among
    work: int  # cumulative credited tokens of the chain, θ_{r+1} included
    # Per member, the weight its verified work earned (0: its Δ did not lower the loss on the round's probe batch;
    # swarmloco.protocol.round.credit). None: the round could not score contributions (no probe, no audit), and
    # the weights stand as the credit.
    credit: tuple[int, ...] | None = None

    @property
    def credited(self) -> tuple[int, ...]:
        return self.weights if self.credit is None else self.credit

    def body(self) -> bytes:
        return _DOMAIN + json.dumps(self.as_json(), sort_keys=True, separators=(",", ":")).encode()

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "members": list(self.members), "weights": list(self.weights),
                "credit": None if self.credit is None else list(self.credit)}

    def problem(self) -> str:
        """Why this statement is malformed ("" when well formed)."""
        if not (isinstance(self.round, int) and 1 <= self.round < 2**40):
            return "round outside 1 .. 2^40"
        if not (isinstance(self.prev_hash, str) and _HASH.fullmatch(self.prev_hash)
                and isinstance(self.new_hash, str) and _HASH.fullmatch(self.new_hash)):
            return "state hashes must be 64 hex digits"
        if not (0 < len(self.members) <= MAX_MEMBERS and list(self.members) == sorted(set(self.members))):
            return "members must be a non-empty sorted list without repeats"
        if not all(isinstance(m, str) and 0 < len(m) <= 128 for m in self.members):
            return "members must be peer ids"
        if len(self.weights) != len(self.members) or not all(
            isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 2**48 for w in self.weights
        ):
            return "weights must be one non-negative integer per member"
        if self.credit is not None and (len(self.credit) != len(self.weights) or not all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= w
            for c, w in zip(self.credit, self.weights, strict=True)
        )):
            return "credit must be one integer per member, between 0 and its weight"
        if not (isinstance(self.swarm, int) and len(self.members) <= self.swarm <= MAX_MEMBERS):
            return "swarm must count at least the members"
        if not (isinstance(self.work, int) and sum(self.credited) <= self.work < MAX_WORK):
            return "work must include this round's credit"
        return ""


@dataclass(frozen=True)
class Certificate:
    statement: Statement
    signatures: dict[str, str] = field(default_factory=dict)  # signer -> hex signature of statement.body()
    tickets: dict[str, str] = field(default_factory=dict)  # signer -> its ticket (empty in a private swarm)

    @staticmethod
    def sign(identity: Identity, statement: Statement) -> str:
        return identity.sign(statement.body()).hex()

    def to_bytes(self) -> bytes:
        value = {"statement": self.statement.as_json(), "signatures": self.signatures, "tickets": self.tickets}
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Certificate:
        """Parse (not verify); raises ValueError for anything malformed."""
        if not raw or len(raw) > MAX_CERT_BYTES:
            raise ValueError(f"certificate must be 1 .. {MAX_CERT_BYTES} bytes, got {len(raw)}")
        try:
            value: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ValueError("certificate is not JSON") from None
        if not isinstance(value, dict) or set(value) != {"statement", "signatures", "tickets"}:
            raise ValueError("certificate must have exactly statement, signatures and tickets")
        st, sigs, tickets = value["statement"], value["signatures"], value["tickets"]
        if not isinstance(st, dict) or set(st) != set(Statement.__dataclass_fields__):
            raise ValueError("certificate statement has the wrong fields")
        if not (isinstance(st["members"], list) and all(isinstance(m, str) for m in st["members"])
                and isinstance(st["weights"], list) and all(type(w) is int for w in st["weights"])):
            raise ValueError("certificate members must be a list of peer ids and weights a list of integers")
        credit = st["credit"]
        if credit is not None and not (isinstance(credit, list) and all(type(c) is int for c in credit)):
            raise ValueError("certificate credit must be null or a list of integers")
        if not all(type(st[k]) is int for k in ("round", "swarm", "work")) or not all(
                isinstance(st[k], str) for k in ("run_id", "prev_hash", "new_hash")):
            raise ValueError("certificate statement fields have the wrong types")
        for mapping in (sigs, tickets):
            if not isinstance(mapping, dict) or len(mapping) > MAX_MEMBERS or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
            ):
                raise ValueError("certificate signatures and tickets must map peer ids to strings")
        statement = Statement(**{**st, "members": tuple(st["members"]), "weights": tuple(st["weights"]),
                                 "credit": None if credit is None else tuple(credit)})
        return cls(statement, dict(sigs), dict(tickets))

    def problem(self, *, run_id: str, gate: Gate, quorum: int) -> str:
        """Why this certificate does not prove its statement ("" when it does). Never raises: a certificate is a
        stranger's bytes."""
        try:
            return self._problem(run_id=run_id, gate=gate, quorum=quorum)
        except (ValueError, TypeError, UnicodeError, RecursionError) as exc:
            return f"malformed certificate: {type(exc).__name__}"

    def _problem(self, *, run_id: str, gate: Gate, quorum: int) -> str:
        s = self.statement
        if s.run_id != run_id:
            return f"certificate is for run {s.run_id!r}"
        malformed = s.problem()
        if malformed:
            return f"malformed statement: {malformed}"
        refused: list[str] = []
        valid = len(self.valid_signers(gate, refused=refused))
        wanted = need(s.swarm, quorum)
        if valid < wanted:
            why = f" ({'; '.join(refused[:3])})" if refused else ""
            return f"{valid} valid signature(s), {wanted} needed for a swarm of {s.swarm}{why}"
        return ""

    def valid_signers(self, gate: Gate, *, refused: list[str] | None = None) -> set[str]:
        """The members whose signatures count: admitted (per `gate`) and valid over the statement. Signatures that
        do not count are skipped, not fatal: two peers whose revocation lists differ by one signer then still agree
        on a certificate that has enough of the others. `refused` collects why each one was skipped."""
        s = self.statement
        members, body, valid = set(s.members), s.body(), set()
        for signer, signature in self.signatures.items():
            why = ""
            if signer not in members:
                why = f"{short_id(signer)} is not a member"
            # A signature made while its ticket was valid stays valid for a while: a peer resuming from a
            # checkpoint still proves its state. Revocation applies at once.
            elif not_admitted := gate.check(self.tickets.get(signer), signer, role="trainer",
                                            grace_s=SIGNER_GRACE_S):
                why = f"{short_id(signer)} is not admitted: {not_admitted}"
            elif not signed_by(signer, body, signature):
                why = f"signature of {short_id(signer)} is invalid"
            if why and refused is not None:
                refused.append(why)
            elif not why:
                valid.add(signer)
        return valid


@dataclass(frozen=True)
class Head:
    """The certified state a peer holds: θ_0 (no certificate: every peer computes it) or a certified θ_r."""

    round: int
    state_hash: str
    work: int = 0
    certificate: Certificate | None = None

    @property
    def seed(self) -> str:
        """What the leader order of the round from this state is drawn from. θ_0: its hash. Later: the hash
        together with the members' signatures of the certificate. The leader of the previous round chose the
        average, so it could try averages offline until the bare hash ranked it first; the signatures it cannot
        produce itself, and it can only leave some out."""
        cert = self.certificate
        if cert is None:
            return self.state_hash
        valid = sorted(cert.signatures[signer] for signer in self.signers)
        return hashlib.sha256("\n".join([self.state_hash, *valid]).encode()).hexdigest()

    @functools.cached_property
    def signers(self) -> frozenset[str]:
        """The members whose signatures of the certificate are valid (nobody, for θ_0): the peers that contributed
        to the round that made this state and stayed with it to the end. Checked once per head: `seed` and the
        matchmaker both read it whenever a peer takes a new state."""
        cert = self.certificate
        if cert is None:
            return frozenset()
        body, members = cert.statement.body(), set(cert.statement.members)
        return frozenset(signer for signer, sig in cert.signatures.items()
                         if signer in members and signed_by(signer, body, sig))

    @classmethod
    def of(cls, certificate: Certificate) -> Head:
        s = certificate.statement
        return cls(s.round, s.new_hash, s.work, certificate)
