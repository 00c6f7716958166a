"""This peer's admission: which authority the run trusts, and a ticket from it that stays valid while we run.

Where the ticket comes from, in this order:
- `--authority-key FILE`: we hold the run's authority key (a lab's own machines, the local compose swarm) and
  sign our own ticket with it;
- `--ticket FILE`: a ticket the authority issued to our peer id offline (`swarmloco ticket`);
- `--coordinator URL`: the coordinator is the authority; we prove our key and ask it for a ticket (with `--invite`
  when the run is invite-only; in an `open` run our first ticket costs the proof of work the coordinator asks for,
  a CPU-minute by default, which renewals do not).
A ticket is renewed in the background at half its life; a failed renewal is retried and reported, and training
goes on until the old ticket expires. `--private` (or a coordinator whose admission is `none`) runs without
tickets: anyone who can reach the peers takes part, which is said loudly at start.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from swarmloco.protocol.trust.admission import DEFAULT_TICKET_S, AdmissionError, Credentials, Gate, Ticket
from swarmloco.protocol.trust.identity import Identity, IdentityError, load_or_create_identity

logger = logging.getLogger(__name__)
PRIVATE_WARNING = ("private swarm: no run authority is configured, so anyone who can reach these peers takes part "
                   "(use --coordinator, --authority-key or --authority with --ticket for a permissioned run)")
RETRY_S = 30.0
AUTHORITY_TIMEOUT_S = 10.0


class AdmissionSetupError(RuntimeError):
    """This peer cannot be admitted as configured; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    """How this peer is admitted to the run (see peer/tickets.py)."""

    authority: str | None = None  # the run authority's peer id; None: the coordinator's, or --authority-key's
    authority_key: str | None = None  # sign our own ticket with this authority key file
    ticket: str | None = None  # a ticket file issued to this peer by the authority
    invite: str = ""  # invite code, for a coordinator that admits by invitation
    private: bool = False  # no authority, no tickets: a private swarm
    ticket_s: float = DEFAULT_TICKET_S  # lifetime of a ticket we sign ourselves (--authority-key)

    def __post_init__(self) -> None:
        if self.private and (self.authority or self.authority_key or self.ticket):
            raise ValueError("private: a private swarm has no authority; drop --authority, --authority-key, --ticket")
        if not 60 <= self.ticket_s <= 7 * 86400:
            raise ValueError(f"ticket_lifetime: got {self.ticket_s}, allowed 60 .. 604800 seconds")
        if len(self.invite) > 256:
            raise ValueError("invite: at most 256 characters")


class Admission:
    """The gate we check others with and the credentials we show them, kept fresh by a renewal thread."""

    def __init__(self, cfg: AdmissionConfig, identity: Identity, run_id: str, coordinator: str | None) -> None:
        self.cfg, self.identity, self.run_id, self.coordinator = cfg, identity, run_id, coordinator
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._authority_key: Identity | None = None
        self._work_bits: int | None = None  # the coordinator's admission puzzle, when we asked it
        self.expires_at = 0.0  # of the ticket we hold: none yet
        authority = self._authority()
        self.gate = Gate(run_id, authority)
        self.credentials = Credentials(identity)
        if authority is None:
            logger.warning(PRIVATE_WARNING)
            return
        ticket = self._obtain()
        self.credentials.ticket = ticket.to_bytes()
        self.expires_at = ticket.expires_at

    # --- set-up ---------------------------------------------------------------------------------------------------
    def _authority(self) -> str | None:
        cfg = self.cfg
        if cfg.private:
            return None
        if cfg.authority_key:
            try:
                self._authority_key = load_or_create_identity(cfg.authority_key)
            except IdentityError as exc:
                raise AdmissionSetupError(f"--authority-key: {exc}") from None
            key_id = self._authority_key.peer_id
            if cfg.authority and cfg.authority != key_id:
                raise AdmissionSetupError(f"--authority {cfg.authority} is not the peer id of --authority-key "
                                          f"({key_id})")
            return key_id
        if cfg.authority:
            return cfg.authority
        if self.coordinator:
            from swarmloco.peer.ticket_client import TicketError, fetch_authority

            try:
                info = fetch_authority(self.coordinator, timeout=AUTHORITY_TIMEOUT_S)
            except TicketError as exc:
                raise AdmissionSetupError(f"cannot learn the run's authority from {self.coordinator}: {exc}") from None
            if info.get("run_id") != self.run_id:
                raise AdmissionSetupError(f"the coordinator at {self.coordinator} runs {info.get('run_id')!r}, "
                                          f"not --run-id {self.run_id!r}")
            self._work_bits = int(info["work_bits"])
            return None if info.get("admission") == "none" else str(info["authority"])
        return None

    def _obtain(self) -> Ticket:
        """A fresh ticket for us, checked against the run's authority before it is shown to anyone."""
        cfg, me = self.cfg, self.identity.peer_id
        if self._authority_key is not None:
            ticket = Ticket.issue(self._authority_key, run_id=self.run_id, peer_id=me, lifetime_s=cfg.ticket_s)
        elif cfg.ticket:
            try:
                ticket = Ticket.from_bytes(Path(cfg.ticket).read_bytes()[:4096])
            except (OSError, AdmissionError) as exc:
                raise AdmissionSetupError(f"--ticket {cfg.ticket}: {exc}") from None
        elif self.coordinator:
            from swarmloco.peer.ticket_client import TicketError, request_ticket

            try:
                ticket = request_ticket(self.coordinator, self.identity, self.run_id, invite=cfg.invite,
                                        timeout=AUTHORITY_TIMEOUT_S, authority=self.gate.authority,
                                        work_bits=self._work_bits, renewal=self.expires_at > time.time(),
                                        stop=self._stop.is_set)
            except TicketError as exc:
                raise AdmissionSetupError(str(exc)) from None
        else:
            raise AdmissionSetupError("--authority is set but there is no way to get a ticket: pass --ticket FILE, "
                                      "--authority-key FILE or --coordinator URL")
        problem = self.gate.check(ticket, me)
        if problem:
            raise AdmissionSetupError(f"our ticket is not valid for this run: {problem}")
        return ticket

    # --- renewal --------------------------------------------------------------------------------------------------
    def start(self) -> Admission:
        if self.gate.authority is not None and (self._authority_key is not None or not self.cfg.ticket):
            self._thread = threading.Thread(target=self._renew_loop, name="ticket-renewal", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _renew_loop(self) -> None:
        while True:
            now = time.time()
            half_life = max(30.0, (self.expires_at - now) / 2)
            if self._stop.wait(half_life):
                return
            try:
                ticket = self._obtain()
            except AdmissionSetupError as exc:
                left = self.expires_at - time.time()
                logger.warning("renewing our ticket failed (%s); %.0fs left on the current one, retrying in %.0fs",
                               exc, left, RETRY_S)
                if self._stop.wait(RETRY_S):
                    return
                continue
            self.credentials.ticket, self.expires_at = ticket.to_bytes(), ticket.expires_at
            logger.info("ticket renewed until %s", time.strftime("%H:%M:%S", time.localtime(ticket.expires_at)))
