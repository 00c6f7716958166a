"""The coordinator as the run's authority: it issues admission tickets, keeps the revocation list, and decides
which peers' reports and which signers' certificates count.

Order of checks for one ticket request (each either passes or answers and changes nothing):
size, JSON and schema (413/400) -> signature by the key in ``peer_id`` (401) -> timestamp window (422) ->
run id (403) -> revoked (403) -> admission policy (403) -> a known ``(peer_id, nonce)``: the same request gets its
ticket again, a different one is a replay (409) -> a peer that got a ticket moments ago gets that one back (no new
row) -> in ``open`` mode a peer holding no valid ticket must attach a proof of work of ``work_bits`` bits
(protocol/trust/puzzle.py; 428 without a valid one, before any rate-limit token is spent) and then spends a token
of its address and of the global bucket (429): the work makes every new identity cost CPU time, the buckets bound
how fast even a well-equipped client mints them -> a new ticket (200). Renewals by a ticket holder need neither.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarmloco.coordinator.limits import RateLimiter
from swarmloco.coordinator.store import Store
from swarmloco.coordinator.store_authority import IssuedTicket
from swarmloco.protocol.base.text import bounded
from swarmloco.protocol.trust.admission import AdmissionPolicy, Gate, Revocations, Ticket
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.puzzle import MAX_BITS
from swarmloco.protocol.trust.puzzle import check as check_work
from swarmloco.protocol.trust.ticket_request import MAX_AGE_S, MAX_AHEAD_S, TicketRequestError, parse_ticket_request

__all__ = ["DEFAULT_WORK_BITS", "HOSTILE_INPUT_ERRORS", "LONE_SURROGATE", "Answer", "Authority", "AuthorityConfig",
           "bad_input", "valid_unicode"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Answer:
    """An HTTP status and JSON body for one call."""

    status: int
    body: dict[str, Any]


def _refuse(status: int, message: str) -> Answer:
    return Answer(status=status, body={"error": message})


# What a parser of untrusted bytes may raise beyond its own error type when its checks miss a case (an integer
# too large for a float, deep nesting, an unexpected type): the input is still bad, so the answer is still a 400.
HOSTILE_INPUT_ERRORS: tuple[type[Exception], ...] = (ArithmeticError, ValueError, TypeError, KeyError,
                                                      RecursionError)


LONE_SURROGATE = "strings must be valid Unicode: a lone surrogate escape (\\ud800-\\udfff) is refused"


def valid_unicode(value: Any) -> bool:
    """Whether every string in ``value`` encodes as UTF-8. JSON may carry a lone surrogate escape, which SQLite
    and ``str.encode`` refuse deep inside the code that handles the request."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def bad_input(what: str, client: str, error: Exception) -> Answer:
    """A 400 for input a parser choked on, with one log line (no traceback: the sender is at fault)."""
    logger.warning("refused a %s from %s that the parser did not expect: %s: %s", what, client[:64],
                   type(error).__name__, bounded(str(error), 200))
    return _refuse(400, f"malformed {what} ({type(error).__name__}: {bounded(str(error), 200)})")


# About one CPU-minute of the reference solver (protocol/trust/puzzle.py, one process): measured at 2.45-2.7
# million hashes per CPU-second on a 2-core AMD EPYC cloud VM, so 2**27 hashes take 50-55 s on average. Optimised C
# hashes several times faster per core, a GPU thousands of times faster: the work raises the price of an identity,
# the rate limits still bound how many anyone gets.
DEFAULT_WORK_BITS = 27


@dataclass(frozen=True, kw_only=True)
class AuthorityConfig:
    """Whom the authority gives tickets, and how fast."""

    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    # open mode: leading zero bits of the proof of work a new identity must attach to its request (0: none)
    work_bits: int = DEFAULT_WORK_BITS
    new_per_address_per_h: float = 60.0  # open mode: new tickets one client address may obtain per hour
    new_per_address_burst: float = 10.0  # was 30 while identities were free; a few peers behind one NAT still fit
    new_global_per_h: float = 1200.0  # open mode: new tickets for everyone together per hour
    new_global_burst: float = 100.0
    # A peer asking again this soon (at most an eighth of the lifetime) gets its current ticket back, and nothing
    # is written: renewals are cheap, a peer looping on requests is not.
    reuse_s: float = 60.0
    report_grace_s: float = 300.0  # reports still land this long after a ticket expired (a renewal in flight)
    keep_expired_s: float = 7 * 86400.0  # the ledger forgets tickets that expired longer ago than this

    def __post_init__(self) -> None:
        if type(self.work_bits) is not int or not 0 <= self.work_bits <= MAX_BITS:
            raise ValueError(f"work_bits must be an int in [0, {MAX_BITS}], got {self.work_bits!r}")
        for name in ("new_per_address_per_h", "new_global_per_h"):
            if not 0 < getattr(self, name) <= 1e6:
                raise ValueError(f"{name} must be in (0, 1e6], got {getattr(self, name)}")
        for name in ("new_per_address_burst", "new_global_burst"):
            if not 1 <= getattr(self, name) <= 1e6:
                raise ValueError(f"{name} must be in [1, 1e6], got {getattr(self, name)}")
        if not 0 <= self.reuse_s <= 3600:
            raise ValueError(f"reuse_s must be in [0, 3600], got {self.reuse_s}")
        if not 0 <= self.report_grace_s <= 86400:
            raise ValueError(f"report_grace_s must be in [0, 86400], got {self.report_grace_s}")
        if not 0 <= self.keep_expired_s <= 366 * 86400:
            raise ValueError(f"keep_expired_s must be in [0, 366 days], got {self.keep_expired_s}")


class Authority:
    """Issues tickets signed by ``identity`` for ``run_id`` and answers who is admitted; owns no sockets."""

    def __init__(self, store: Store, identity: Identity, run_id: str, config: AuthorityConfig, *,
                 clock: Callable[[], float] = time.time, max_future_s: float = MAX_AHEAD_S) -> None:
        self.store, self.identity, self.run_id, self.config, self.clock = store, identity, run_id, config, clock
        self.max_future_s = max_future_s
        self._per_address = RateLimiter(config.new_per_address_per_h / 3600, config.new_per_address_burst)
        self._global = RateLimiter(config.new_global_per_h / 3600, config.new_global_burst, max_keys=1)
        self._issue_lock = threading.Lock()  # check-then-write of one peer's tickets must not interleave
        self._cache_lock = threading.Lock()
        self._revoked: tuple[int, frozenset[str]] = (-1, frozenset())
        self._signed: tuple[int, dict[str, Any]] | None = None

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def mode(self) -> str:
        return self.config.policy.mode

    @property
    def work_bits(self) -> int:
        """Bits of proof of work a new identity must bring: only ``open`` runs ask for any."""
        return self.config.work_bits if self.mode == "open" else 0

    def info(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "authority": self.peer_id, "admission": self.mode, "work_bits": self.work_bits}

    # -- tickets ---------------------------------------------------------------------------------------------

    def request_ticket(self, raw: bytes, *, client: str) -> Answer:
        """Answer one signed ticket request; never raises for bad input."""
        now = self.clock()
        try:
            request = parse_ticket_request(raw)
        except TicketRequestError as e:
            return _refuse(e.status, str(e))
        except HOSTILE_INPUT_ERRORS as e:
            return bad_input("ticket request", client, e)
        if not valid_unicode(request.to_json()):
            return _refuse(400, LONE_SURROGATE)
        late = request.clock_problem(now, max_age_s=MAX_AGE_S, max_ahead_s=self.max_future_s)
        if late:
            return _refuse(422, late)
        if request.run_id != self.run_id:
            return _refuse(403, f"this coordinator issues tickets for run {self.run_id!r}, not {request.run_id!r}")
        if self.store.is_revoked(request.peer_id):
            return _refuse(403, "peer is revoked by the run's authority")
        refusal = self.config.policy.refusal(request.peer_id, request.invite)
        if refusal:
            return _refuse(403, refusal)
        with self._issue_lock:
            known = self.store.find_ticket_request(request.peer_id, request.nonce)
            if known is not None:
                if known.request_hash != request.digest():
                    return _refuse(409, "nonce already used by this peer for a different ticket request (replay "
                                        "refused); sign a new request with a fresh nonce")
                return self._granted(known)
            current = self.store.latest_ticket(self.run_id, request.peer_id)
            holds = current is not None and current.expires_at > now
            if holds and current is not None and current.role == request.role \
                    and now - current.issued_at < min(self.config.reuse_s, self.config.policy.ticket_s / 8):
                return self._granted(current)
            if self.mode == "open" and not holds:
                bits = self.work_bits
                if not check_work(self.run_id, request.peer_id, request.timestamp, request.work, bits):
                    what = "no proof of work" if not request.work else "a proof of work that does not check"
                    return Answer(status=428, body={"work_bits": bits, "error": (
                        f"a new identity in this open run must prove {bits} bits of work in its ticket request (a "
                        f"'work' whose sha256 with the run id, peer id and timestamp starts with {bits} zero bits); "
                        f"this request carries {what}")})
                if not self._per_address.allow(client, now):
                    wait = self._per_address.wait_s(client, now)
                    return _refuse(429, f"too many new tickets for this address; retry in {wait:.0f}s")
                if not self._global.allow("*", now):
                    wait = self._global.wait_s("*", now)
                    return _refuse(429, f"too many new tickets issued lately; retry in {wait:.0f}s")
            ticket = Ticket.issue(self.identity, run_id=self.run_id, peer_id=request.peer_id, role=request.role,
                                  lifetime_s=self.config.policy.ticket_s, now=now)
            issued = IssuedTicket(run_id=self.run_id, peer_id=request.peer_id, role=request.role,
                                  issued_at=ticket.issued_at, expires_at=ticket.expires_at, nonce=request.nonce,
                                  request_hash=request.digest(), client=client[:64], ticket=ticket.to_bytes().decode())
            self.store.add_ticket(issued, prune_expired_before=now - self.config.keep_expired_s)
        logger.info("issued a %s ticket to %s (%s), valid until %.0f", request.role, request.peer_id, client,
                    ticket.expires_at)
        return self._granted(issued)

    def _granted(self, issued: IssuedTicket) -> Answer:
        return Answer(status=200, body={"ticket": issued.ticket, "issued_at": issued.issued_at,
                                        "expires_at": issued.expires_at, "authority": self.peer_id,
                                        "run_id": issued.run_id})

    # -- revocations -----------------------------------------------------------------------------------------

    def revoked(self) -> tuple[int, frozenset[str]]:
        """The list's serial and the revoked peer ids; re-read only when another process changed them."""
        serial = self.store.revocation_serial()
        with self._cache_lock:
            if self._revoked[0] == serial:
                return self._revoked
        fresh = self.store.revoked()
        with self._cache_lock:
            self._revoked = fresh
        return fresh

    def revocations(self) -> dict[str, Any]:
        """The current revocation list signed by the authority, as published (``Revocations.to_value()``)."""
        serial, ids = self.revoked()
        now = self.clock()
        with self._cache_lock:
            # Re-signed every minute: DHT nodes keep a list only for a few minutes past its signing time, so an old
            # list cannot be replayed over a newer one with a longer life.
            if self._signed is not None and self._signed[0] == serial and now - self._signed[1]["issued_at"] < 60:
                return self._signed[1]
        value = Revocations.issue(self.identity, run_id=self.run_id, serial=serial, peer_ids=ids,
                                  now=now).to_value()
        with self._cache_lock:
            self._signed = (serial, value)
        return value

    # -- who counts ------------------------------------------------------------------------------------------

    def report_refusal(self, peer_id: str, run_id: str) -> str:
        """Why reports of ``peer_id`` for ``run_id`` are refused ("" when they are accepted)."""
        if peer_id in self.revoked()[1]:
            return "peer is revoked by the run's authority; its reports are refused"
        if self.mode == "none":
            return ""
        expiry = self.store.ticket_expiry(run_id, peer_id)
        if expiry is None or self.clock() >= expiry + self.config.report_grace_s:
            what = "no ticket" if expiry is None else "no valid ticket"
            return (f"{what} for run {run_id!r} from this coordinator: request one with POST /api/tickets "
                    f"(and renew it before it expires)")
        return ""

    def gate(self, run_id: str) -> Gate:
        """How a commit certificate's signers are checked: tickets from this authority, minus revoked peers."""
        if self.mode == "none":
            return Gate(run_id, None)
        serial, ids = self.revoked()
        return Gate(run_id, self.peer_id, revoked=ids, serial=serial, clock=self.clock)
