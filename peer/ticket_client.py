"""Asking the coordinator, the run's authority, for an admission ticket (blocking calls; no thread of its own).

``fetch_authority`` learns the run id, the authority's peer id and the admission policy; ``request_ticket`` proves
we own our key with a signed request (protocol/trust/ticket_request.py) and checks the ticket it gets back before anyone
else sees it: for us, for this run, signed by that authority; ``fetch_revocations`` reads the signed revocation
list (verify it with ``Revocations.parse`` or ``Gate.update_revocations``). Every failure is a
:class:`TicketError` with a one-line message.
"""
from __future__ import annotations

import json
import time
from typing import Any

import requests
import urllib3

from swarmloco.protocol.base.text import bounded
from swarmloco.protocol.trust.admission import POLICIES, AdmissionError, Ticket
from swarmloco.protocol.trust.identity import Identity, public_key_from_peer_id
from swarmloco.protocol.trust.ticket_request import build_ticket_request

__all__ = ["TicketError", "fetch_authority", "fetch_revocations", "request_ticket"]

DEFAULT_TIMEOUT_S = 10.0
MAX_ANSWER_BYTES = 8 * 1024 * 1024  # the revocation list is the largest answer


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
    """``{"run_id", "authority", "admission"}`` of the coordinator at ``url``."""
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
    return info


def request_ticket(url: str, identity: Identity, run_id: str, *, invite: str = "", role: str = "trainer",
                   timeout: float = DEFAULT_TIMEOUT_S, authority: str | None = None) -> Ticket:
    """A ticket for ``identity`` in ``run_id``, checked against the authority (fetched unless ``authority`` is
    given: pass the one you trust to notice a coordinator whose key changed)."""
    if authority is None:
        authority = str(fetch_authority(url, timeout=timeout)["authority"])
    try:
        request = build_ticket_request(identity, run_id, role=role, invite=invite)
    except ValueError as e:
        raise TicketError(f"cannot build a ticket request: {e}") from None
    status, blob = _call("POST", url, "/api/tickets", "the ticket request", timeout=timeout, data=request.encode())
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
