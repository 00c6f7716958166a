"""Asking the coordinator, the run's authority, for an admission ticket (blocking calls; no thread of its own).

``fetch_authority`` learns the run id, the authority's peer id, the admission policy and the proof of work a new
identity must bring (``work_bits``); ``request_ticket`` proves we own our key with a signed request
(protocol/trust/ticket_request.py), solving the run's admission puzzle first when we hold no ticket in an ``open``
run (protocol/trust/puzzle.py), and checks the ticket it gets back before anyone else sees it: for us, for this run,
signed by that authority; ``fetch_revocations`` reads the signed revocation list (verify it with
``Revocations.parse`` or ``Gate.update_revocations``). Every failure is a :class:`TicketError` with a one-line
message.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import requests
import urllib3

from swarmloco.protocol.base.text import bounded
from swarmloco.protocol.trust.admission import POLICIES, AdmissionError, Ticket
from swarmloco.protocol.trust.identity import Identity, public_key_from_peer_id
from swarmloco.protocol.trust.puzzle import MAX_BITS, PuzzleTimeout, hash_rate, solve, valid_bits
from swarmloco.protocol.trust.ticket_request import MAX_AGE_S, TicketRequest, build_ticket_request

__all__ = ["TicketError", "fetch_authority", "fetch_revocations", "request_ticket"]

logger = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 10.0
MAX_ANSWER_BYTES = 8 * 1024 * 1024  # the revocation list is the largest answer
MAX_WORK_S = 1800.0  # give up on the admission puzzle after this long (30x the default's expected minute)
# The authority accepts a request up to MAX_AGE_S old and the proof is bound to its timestamp: after this long
# without a proof, start over with a fresh timestamp (the chance per hash is the same, so nothing is lost on average).
RESTAMP_S = MAX_AGE_S - 60.0
QUIET_BITS = 16  # a puzzle this small takes milliseconds: solved without measuring the machine or logging


class TicketError(RuntimeError):
    """The coordinator cannot be asked, refused, or answered something unusable."""


def _error_text(status: int, blob: bytes) -> str:
    try:
        body = json.loads(blob)
    except ValueError:
        body = None
    text = body.get("error") if isinstance(body, dict) else None
    text = str(text) if text else blob.decode("utf-8", errors="replace") or f"HTTP {status}"
    return bounded(" ".join(text.split()))


def _call(method: str, url: str, path: str, what: str, *, timeout: float, data: bytes | None = None
          ) -> tuple[int, bytes]:
    """The status and the body (at most MAX_ANSWER_BYTES, read as it streams in) of one request."""
    target = url.rstrip("/") + path
    try:
        with requests.request(method, target, data=data, timeout=timeout, stream=True,
                              headers={"Content-Type": "application/json"} if data is not None else None) as resp:
            blob = resp.raw.read(MAX_ANSWER_BYTES + 1, decode_content=True)
            status = resp.status_code
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
        raise TicketError(f"coordinator unreachable at {target}: {type(e).__name__}: {bounded(str(e), 200)}") from None
    if len(blob) > MAX_ANSWER_BYTES:
        raise TicketError(f"coordinator answered {what} with more than {MAX_ANSWER_BYTES} bytes")
    return status, blob


def _json_object(blob: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(blob)
    except ValueError:
        raise TicketError(f"coordinator answered {what} with something that is not JSON") from None
    if not isinstance(value, dict):
        raise TicketError(f"coordinator answered {what} with JSON that is not an object")
    return value


def fetch_authority(url: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """``{"run_id", "authority", "admission", "work_bits"}`` of the coordinator at ``url`` (``work_bits`` is 0
    when an older coordinator does not name it)."""
    status, blob = _call("GET", url, "/api/authority", "the authority request", timeout=timeout)
    if status != 200:
        raise TicketError(f"coordinator refused to name its authority: {status} {_error_text(status, blob)}")
    info = _json_object(blob, "the authority request")
    if not isinstance(info.get("run_id"), str) or info.get("admission") not in POLICIES:
        raise TicketError("coordinator's authority answer lacks run_id or a known admission policy")
    try:
        public_key_from_peer_id(info.get("authority"))  # type: ignore[arg-type]
    except ValueError as e:
        raise TicketError(f"coordinator's authority is not a usable peer id: {e}") from None
    info.setdefault("work_bits", 0)
    if not valid_bits(info["work_bits"]):
        raise TicketError(f"coordinator asks for a proof of work of {bounded(repr(info['work_bits']), 40)} bits; "
                          f"an int in 0..{MAX_BITS} was expected")
    return info


def _proved_request(identity: Identity, run_id: str, bits: int, *, role: str, invite: str, max_work_s: float,
                    stop: Callable[[], bool] | None) -> TicketRequest:
    """A request carrying a proof of ``bits`` bits of work, found in at most ``max_work_s`` seconds."""
    if bits > QUIET_BITS:
        rate = hash_rate(0.1)
        expected_s = 2.0 ** bits / rate
        if expected_s > max_work_s:
            raise TicketError(f"the run asks a new identity for a {bits}-bit proof of work, about {expected_s:.0f}s "
                              f"on this machine ({rate:,.0f} hashes/s): more than the {max_work_s:.0f}s we give it")
        logger.info("solving the run's admission puzzle: 2^%d hashes, about %.0fs on this machine (%s hashes/s); a "
                    "new identity in an open run pays this once, renewals do not", bits, expected_s, f"{rate:,.0f}")
    start = time.monotonic()
    while True:
        left = max_work_s - (time.monotonic() - start)
        timestamp = time.time()
        try:
            work = solve(run_id, identity.peer_id, timestamp, bits, max_s=min(RESTAMP_S, left), stop=stop)
            break
        except PuzzleTimeout as e:
            if (stop is not None and stop()) or time.monotonic() - start >= max_work_s:
                raise TicketError(f"gave up on the {bits}-bit admission puzzle after "
                                  f"{time.monotonic() - start:.0f}s: {e}") from None
            logger.info("admission puzzle: no proof yet after %.0fs; going on with a fresh timestamp",
                        time.monotonic() - start)
    if bits > QUIET_BITS:
        logger.info("solved the admission puzzle in %.1fs", time.monotonic() - start)
    return build_ticket_request(identity, run_id, role=role, invite=invite, timestamp=timestamp, work=work)


def _asked_bits(blob: bytes) -> int | None:
    """The proof of work a 428 answer asks for, when it names a usable one."""
    try:
        bits = json.loads(blob).get("work_bits")
    except (ValueError, AttributeError, RecursionError):
        return None
    return bits if valid_bits(bits) and bits > 0 else None


def request_ticket(url: str, identity: Identity, run_id: str, *, invite: str = "", role: str = "trainer",
                   timeout: float = DEFAULT_TIMEOUT_S, authority: str | None = None, work_bits: int | None = None,
                   renewal: bool = False, max_work_s: float = MAX_WORK_S,
                   stop: Callable[[], bool] | None = None) -> Ticket:
    """A ticket for ``identity`` in ``run_id``, checked against the authority (fetched unless ``authority`` is
    given: pass the one you trust to notice a coordinator whose key changed).

    A new identity (``renewal`` false: we hold no valid ticket) brings the proof of work the authority asks for:
    ``work_bits``, read from the authority when not given. A renewal brings none; if the authority asks for one
    anyway (428: it lost our ticket), it is solved and the request sent again. Solving gives up after
    ``max_work_s`` seconds in all, or when ``stop()`` turns true.
    """
    give_up = time.monotonic() + max_work_s
    if authority is None or (work_bits is None and not renewal):
        info = fetch_authority(url, timeout=timeout)
        authority = str(info["authority"]) if authority is None else authority
        work_bits = int(info["work_bits"]) if work_bits is None else work_bits
    bits = 0 if renewal else work_bits or 0
    while True:
        try:
            request = (build_ticket_request(identity, run_id, role=role, invite=invite) if not bits else
                       _proved_request(identity, run_id, bits, role=role, invite=invite,
                                       max_work_s=max(0.0, give_up - time.monotonic()), stop=stop))
        except ValueError as e:
            raise TicketError(f"cannot build a ticket request: {e}") from None
        status, blob = _call("POST", url, "/api/tickets", "the ticket request", timeout=timeout,
                             data=request.encode())
        asked = _asked_bits(blob) if status == 428 else None
        if asked is None or asked <= bits:
            break
        bits = asked  # asked grows with every try and is at most MAX_BITS: this ends
    if status != 200:
        raise TicketError(f"coordinator refused a ticket: {status} {_error_text(status, blob)}")
    body = _json_object(blob, "the ticket request")
    try:
        ticket = Ticket.from_bytes(str(body.get("ticket") or ""))
    except AdmissionError as e:
        raise TicketError(f"coordinator sent a malformed ticket: {e}") from None
    problem = ticket.problem(run_id=run_id, authority=authority, now=time.time(), peer_id=identity.peer_id,
                             role=role)
    if problem:
        raise TicketError(f"coordinator sent a ticket that does not admit us: {problem}")
    return ticket


def fetch_revocations(url: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The signed revocation list as the coordinator serves it (``Revocations.to_value()``), not yet verified."""
    status, blob = _call("GET", url, "/api/revocations", "the revocation list request", timeout=timeout)
    if status != 200:
        raise TicketError(f"coordinator refused its revocation list: {status} {_error_text(status, blob)}")
    return _json_object(blob, "the revocation list request")
