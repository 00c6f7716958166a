"""`swarmloco ticket`: the authority of a run without a coordinator issues a ticket file to one peer id.

    swarmloco ticket --authority-key authority.key --run-id myrun --peer-id 12D3KooW... --out peer.ticket

The peer then joins with `--authority <the key's peer id> --ticket peer.ticket`. `--show-authority` prints the
key's peer id (what every peer of the run passes as --authority). A ticket cannot be renewed by its holder: issue
tickets as long as you trust the machine, and a new one before it expires.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from swarmloco.protocol.trust.admission import MAX_TICKET_S, ROLES, AdmissionError, Ticket
from swarmloco.protocol.trust.identity import IdentityError, load_or_create_identity, public_key_from_peer_id

logger = logging.getLogger(__name__)


def add_ticket_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--authority-key", required=True, help="the run's authority key file (created if missing)")
    parser.add_argument("--run-id", help="the run the ticket admits to")
    parser.add_argument("--peer-id", help="the peer id the ticket is for (printed by the peer at start)")
    parser.add_argument("--role", default="trainer", choices=ROLES, help="trainer, or observer (never contributes)")
    parser.add_argument("--lifetime", type=float, default=7 * 86400.0,
                        help=f"seconds the ticket is valid (at most {MAX_TICKET_S:.0f})")
    parser.add_argument("--out", help="write the ticket here (mode 0600) instead of printing it")
    parser.add_argument("--show-authority", action="store_true", help="only print the authority's peer id")


def run_ticket(args: argparse.Namespace) -> int:
    try:
        authority = load_or_create_identity(args.authority_key)
    except IdentityError as exc:
        logger.error("%s", exc)
        return 2
    if args.show_authority:
        print(authority.peer_id)
        return 0
    if not args.run_id or not args.peer_id:
        logger.error("--run-id and --peer-id are needed to issue a ticket")
        return 2
    try:
        public_key_from_peer_id(args.peer_id)
        ticket = Ticket.issue(authority, run_id=args.run_id, peer_id=args.peer_id, role=args.role,
                              lifetime_s=args.lifetime)
    except (ValueError, AdmissionError) as exc:
        logger.error("%s", exc)
        return 2
    if not args.out:
        sys.stdout.write(ticket.to_bytes().decode() + "\n")
        return 0
    path = Path(args.out)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(ticket.to_bytes())
    print(f"ticket for {args.peer_id} in run {args.run_id!r} until {ticket.expires_at:.0f} (unix); join with "
          f"--authority {authority.peer_id} --ticket {path}")
    return 0
