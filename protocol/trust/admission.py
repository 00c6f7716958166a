"""Who may take part in a run: tickets signed by the run's authority, revocations, and the admission policies.

A run has an *authority*: an Ed25519 identity (the coordinator's key, or a key file for runs without one). The
authority signs short-lived tickets, each naming one run, one peer id, a role and an expiry. A peer shows its ticket
with every request and in its DHT record, and the receiver checks it offline against the authority's peer id, which
every peer of the run is configured with: the coordinator is never asked while training.

Revocations are a list of peer ids signed by the same authority, numbered so that a newer list always replaces an
older one; a revoked peer's tickets are refused until they expire, and no new ones are issued to it.

A run without an authority is a private swarm (policy ``none``): anyone who can reach its peers takes part.
"""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swarmloco.protocol.base.text import short_id
from swarmloco.protocol.trust.checkpoints import Checkpoint, CheckpointError
from swarmloco.protocol.trust.identity import Identity, verify

__all__ = [
    "POLICIES",
    "ROLES",
    "AdmissionError",
    "AdmissionPolicy",
    "Credentials",
    "Gate",
    "Revocations",
    "Ticket",
    "load_allowlist",
]

POLICIES = ("open", "invite", "allowlist", "none")
ROLES = ("trainer", "observer")  # an observer reads records and downloads state; it never contributes or signs
MAX_TICKET_BYTES = 1024
MAX_TICKET_S = 7 * 86400.0
DEFAULT_TICKET_S = 3600.0
CLOCK_SKEW_S = 60.0  # tolerated difference between the authority's clock and ours
MAX_REVOKED = 100_000
_TICKET_DOMAIN = b"swarmloco-ticket-v1\n"
_REVOCATION_DOMAIN = b"swarmloco-revocations-v1\n"


class AdmissionError(ValueError):
    """A ticket, a revocation list or an admission request is refused; the message says why."""


def _canonical(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) < 1e12


@dataclass(frozen=True, kw_only=True)
class Ticket:
    """The authority's statement that `peer_id` may take part in `run_id` as `role` until `expires_at`."""

    run_id: str
    peer_id: str
    role: str
    issued_at: float
    expires_at: float
    authority: str
    signature: str = ""

    def body(self) -> bytes:
        fields = asdict(self)
        fields.pop("signature")
        return _TICKET_DOMAIN + _canonical(fields)

    @classmethod
    def issue(cls, authority: Identity, *, run_id: str, peer_id: str, role: str = "trainer",
              lifetime_s: float = DEFAULT_TICKET_S, now: float | None = None) -> Ticket:
        if role not in ROLES:
            raise AdmissionError(f"role: got {role!r}, allowed {', '.join(ROLES)}")
        if not 1 <= lifetime_s <= MAX_TICKET_S:
            raise AdmissionError(f"ticket lifetime: got {lifetime_s}s, allowed 1 .. {MAX_TICKET_S:.0f}s")
        now = time.time() if now is None else now
        unsigned = cls(run_id=run_id, peer_id=peer_id, role=role, issued_at=round(now, 3),
                       expires_at=round(now + lifetime_s, 3), authority=authority.peer_id)
        return cls(**{**asdict(unsigned), "signature": authority.sign(unsigned.body()).hex()})

    def to_bytes(self) -> bytes:
        return _canonical(asdict(self))

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> Ticket:
        """Parse (not verify) a ticket; raises AdmissionError for anything malformed."""
        if isinstance(raw, str):
            try:
                raw = raw.encode()
            except UnicodeEncodeError:  # a lone surrogate survives json.loads but not encoding
                raise AdmissionError("ticket is not valid text") from None
        if not raw:
            raise AdmissionError("no ticket")
        if len(raw) > MAX_TICKET_BYTES:
            raise AdmissionError(f"ticket is {len(raw)} bytes, at most {MAX_TICKET_BYTES} allowed")
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise AdmissionError("ticket is not JSON") from None
        names = set(cls.__dataclass_fields__)
        if not isinstance(value, dict) or set(value) != names:
            raise AdmissionError(f"ticket must have exactly the fields {sorted(names)}")
        strs = ("run_id", "peer_id", "role", "authority", "signature")
        if not all(isinstance(value[k], str) and len(value[k]) <= 256 for k in strs):
            raise AdmissionError("ticket fields run_id, peer_id, role, authority, signature must be short strings")
        if not all(_is_number(value[k]) for k in ("issued_at", "expires_at")):
            raise AdmissionError("ticket times must be finite numbers")
        return cls(**value)

    def problem(self, *, run_id: str, authority: str, now: float, peer_id: str | None = None,
                role: str | None = None, grace_s: float = 0.0) -> str:
        """Why this ticket does not admit `peer_id` to `run_id` now ("" when it does); `grace_s` accepts a ticket
        that expired that long ago (a signature made while it was valid)."""
        if self.authority != authority:
            return f"ticket is signed by {short_id(self.authority)}, not by this run's authority {short_id(authority)}"
        if self.run_id != run_id:
            return f"ticket is for run {self.run_id!r}, not {run_id!r}"
        if peer_id is not None and self.peer_id != peer_id:
            return f"ticket belongs to {short_id(self.peer_id)}, not to the sender {short_id(peer_id)}"
        if role is not None and self.role != role:
            return f"ticket grants role {self.role!r}, {role!r} needed"
        if self.role not in ROLES:
            return f"unknown role {self.role!r}"
        if not self.issued_at - CLOCK_SKEW_S <= now < self.expires_at + CLOCK_SKEW_S + grace_s:
            if now >= self.expires_at:
                return f"ticket expired {now - self.expires_at:.0f}s ago"
            return "ticket not valid yet"
        if self.expires_at - self.issued_at > MAX_TICKET_S:
            return "ticket lifetime exceeds the maximum"
        try:
            signature = bytes.fromhex(self.signature)
        except ValueError:
            return "ticket signature is not hex"
        if not verify(authority, self.body(), signature):
            return "ticket signature is invalid"
        return ""


@dataclass(frozen=True, kw_only=True)
class Revocations:
    """The authority's list of refused peer ids; a higher `serial` replaces a lower one."""

    run_id: str
    authority: str
    serial: int
    peer_ids: tuple[str, ...]
    issued_at: float
    signature: str = ""

    def body(self) -> bytes:
        fields = asdict(self)
        fields.pop("signature")
        fields["peer_ids"] = list(self.peer_ids)
        return _REVOCATION_DOMAIN + _canonical(fields)

    @classmethod
    def issue(cls, authority: Identity, *, run_id: str, serial: int, peer_ids: Iterable[str],
              now: float | None = None) -> Revocations:
        ids = tuple(sorted(set(peer_ids)))
        if len(ids) > MAX_REVOKED:
            raise AdmissionError(f"at most {MAX_REVOKED} revoked peers per run")
        unsigned = cls(run_id=run_id, authority=authority.peer_id, serial=serial, peer_ids=ids,
                       issued_at=round(time.time() if now is None else now, 3))
        return cls(**{**asdict(unsigned), "peer_ids": ids, "signature": authority.sign(unsigned.body()).hex()})

    def to_value(self) -> dict[str, Any]:
        return {**asdict(self), "peer_ids": list(self.peer_ids)}

    @classmethod
    def parse(cls, value: Any, *, run_id: str, authority: str) -> Revocations:
        """A verified list; raises AdmissionError for anything malformed or not signed by `authority`."""
        names = set(cls.__dataclass_fields__)
        if not isinstance(value, dict) or set(value) != names:
            raise AdmissionError(f"revocation list must have exactly the fields {sorted(names)}")
        ids = value["peer_ids"]
        if not (isinstance(ids, list) and len(ids) <= MAX_REVOKED and all(isinstance(p, str) for p in ids)):
            raise AdmissionError("revocation list peer_ids must be a list of strings")
        serial = value["serial"]
        if not (isinstance(serial, int) and not isinstance(serial, bool) and 0 <= serial < 2**53):
            raise AdmissionError("revocation list serial must be a non-negative integer")
        if not (_is_number(value["issued_at"]) and isinstance(value["signature"], str)):
            raise AdmissionError("revocation list issued_at/signature malformed")
        rev = cls(**{**value, "peer_ids": tuple(ids)})
        if rev.run_id != run_id or rev.authority != authority:
            raise AdmissionError("revocation list is for another run or authority")
        try:
            signature = bytes.fromhex(rev.signature)
        except ValueError:
            raise AdmissionError("revocation list signature is not hex") from None
        if not verify(authority, rev.body(), signature):
            raise AdmissionError("revocation list signature is invalid")
        return rev


@dataclass
class Gate:
    """A peer's offline check of other peers' tickets: the run, its authority (None: private swarm, nothing to
    check) and the newest revocation list seen. `clock` is injectable for tests."""

    run_id: str
    authority: str | None
    revoked: frozenset[str] = frozenset()
    serial: int = -1
    clock: Any = time.time
    checkpoint: Checkpoint | None = None  # the newest authority checkpoint seen (swarmloco.protocol.trust.checkpoints)

    @property
    def open(self) -> bool:
        return self.authority is None

    def check(self, ticket: bytes | str | Ticket | None, peer_id: str, *, role: str | None = None,
              grace_s: float = 0.0) -> str:
        """Why `peer_id`, showing `ticket`, is not admitted ("" when it is)."""
        if self.authority is None:
            return ""
        if peer_id in self.revoked:
            return "peer is revoked by the run's authority"
        try:
            parsed = ticket if isinstance(ticket, Ticket) else Ticket.from_bytes(ticket or b"")
            return parsed.problem(run_id=self.run_id, authority=self.authority, now=self.clock(), peer_id=peer_id,
                                  role=role, grace_s=grace_s)
        except AdmissionError as exc:
            return str(exc)
        except (ValueError, TypeError, UnicodeError) as exc:  # whatever else a stranger's bytes can provoke
            return f"malformed ticket: {type(exc).__name__}"

    def update_revocations(self, value: Any) -> bool:
        """Adopt a newer signed revocation list; returns whether it changed anything. Bad lists are ignored."""
        if self.authority is None:
            return False
        try:
            rev = Revocations.parse(value, run_id=self.run_id, authority=self.authority)
        except AdmissionError:
            return False
        if rev.serial <= self.serial:
            return False
        self.revoked, self.serial = frozenset(rev.peer_ids), rev.serial
        return True

    def update_checkpoint(self, value: Any) -> bool:
        """Adopt a newer signed checkpoint of the run's authority; returns whether it is new. Bad ones are ignored."""
        if self.authority is None:
            return False
        try:
            cp = Checkpoint.parse(value, run_id=self.run_id, authority=self.authority)
        except CheckpointError:
            return False
        if not cp.newer_than(self.checkpoint):
            return False
        self.checkpoint = cp
        return True


def load_allowlist(path: str | Path) -> frozenset[str]:
    """Peer ids, one per line; blank lines and '#' comments are ignored."""
    ids = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not 40 <= len(text) <= 64 or not text.isalnum():
            raise AdmissionError(f"{path}:{number}: {text[:70]!r} is not a peer id")
        ids.add(text)
    return frozenset(ids)


@dataclass(frozen=True, kw_only=True)
class AdmissionPolicy:
    """How an authority decides whom to give a ticket."""

    mode: str = "open"
    invite_codes: frozenset[str] = field(default_factory=frozenset)
    allowlist: frozenset[str] = field(default_factory=frozenset)
    ticket_s: float = DEFAULT_TICKET_S

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise AdmissionError(f"admission policy: got {self.mode!r}, allowed {', '.join(POLICIES)}")
        if self.mode == "invite" and not self.invite_codes:
            raise AdmissionError("admission policy 'invite' needs at least one invite code")
        if self.mode == "allowlist" and not self.allowlist:
            raise AdmissionError("admission policy 'allowlist' needs an allowlist with at least one peer id")
        if not 60 <= self.ticket_s <= MAX_TICKET_S:
            raise AdmissionError(f"ticket lifetime: got {self.ticket_s}s, allowed 60 .. {MAX_TICKET_S:.0f}s")

    def refusal(self, peer_id: str, invite: str = "") -> str:
        """Why `peer_id` gets no ticket ("" when it does). Invite codes are compared in constant time."""
        if self.mode == "none":
            return "this run issues no tickets (private swarm)"
        given = invite.encode()
        if self.mode == "invite" and not any(secrets.compare_digest(given, c.encode()) for c in self.invite_codes):
            return "invite code is missing or wrong"
        if self.mode == "allowlist" and peer_id not in self.allowlist:
            return "peer id is not on this run's allowlist"
        return ""


@dataclass
class Credentials:
    """What this peer shows others: its identity and its current ticket (empty in a private swarm). Renewal
    replaces `ticket` in one assignment, so readers see the old or the new one, never a mix."""

    identity: Identity
    ticket: bytes = b""

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id
