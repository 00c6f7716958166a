"""``swarmloco coordinator revoke|unrevoke --db DB PEER_ID``: change the authority's revocation list.

They write the same SQLite file the running coordinator uses (WAL lets both open it): the coordinator refuses the
peer's ticket requests and reports at once, serves the new signed list at ``/api/revocations`` and publishes it to
the DHT within ``REVOCATIONS_EVERY_S``. Revocation is per database, so it holds for every run the coordinator
records.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from swarmloco.protocol.trust.admission import MAX_REVOKED
from swarmloco.protocol.trust.identity import public_key_from_peer_id

__all__ = ["add_revocation_commands", "run_revocation"]

MAX_REASON_CHARS = 500


def add_revocation_commands(parser: argparse.ArgumentParser) -> None:
    """``revoke`` and ``unrevoke`` under ``swarmloco coordinator``; without either, the coordinator runs."""
    sub = parser.add_subparsers(dest="coordinator_action", metavar="{revoke,unrevoke}",
                                help="change the revocation list instead of running the coordinator")
    for name, text in (("revoke", "refuse a peer: no tickets, reports refused, its signatures no longer count"),
                       ("unrevoke", "lift a peer's revocation")):
        p = sub.add_parser(name, help=text, description=text)
        # SUPPRESS: `coordinator --db X revoke P` keeps the --db given before the action
        p.add_argument("--db", type=Path, default=argparse.SUPPRESS,
                       help="the coordinator's SQLite file (default: runs.sqlite)")
        p.add_argument("peer_id", help="the peer id (12D3KooW...)")
        if name == "revoke":
            p.add_argument("--reason", default="", help="why, kept in the database for the record")


def run_revocation(args: argparse.Namespace) -> int:
    """Run ``revoke``/``unrevoke``; exit code 0 on success (also when nothing changed), 2 on bad input."""
    from swarmloco.coordinator.server import REVOCATIONS_EVERY_S  # uvicorn and fastapi: not needed to build the parser
    from swarmloco.coordinator.store import SQLiteStore, StoreError

    action, peer_id = args.coordinator_action, args.peer_id.strip()
    prog = f"swarmloco coordinator {action}"
    try:
        public_key_from_peer_id(peer_id)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    reason = getattr(args, "reason", "")
    if len(reason) > MAX_REASON_CHARS:
        print(f"{prog}: --reason is {len(reason)} chars, at most {MAX_REASON_CHARS} allowed", file=sys.stderr)
        return 2
    db = Path(args.db)
    if not db.exists():
        print(f"{prog}: database {db} does not exist; pass the coordinator's --db", file=sys.stderr)
        return 2
    try:
        store = SQLiteStore(db)
    except StoreError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    try:
        if action == "revoke":
            changed, serial = store.revoke(peer_id, reason=reason, now=time.time(), max_revoked=MAX_REVOKED)
        else:
            changed, serial = store.unrevoke(peer_id, now=time.time())
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    finally:
        store.close()
    if not changed:
        print(f"{peer_id} was {'already' if action == 'revoke' else 'not'} revoked (revocation list serial {serial})")
    else:
        print(f"{action}d {peer_id}: revocation list serial {serial}; a running coordinator applies it at once and "
              f"publishes it to the DHT within {REVOCATIONS_EVERY_S:.0f}s")
    return 0
