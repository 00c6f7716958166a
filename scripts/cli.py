"""The `swarmloco` console script: dispatches to the peer, local-swarm, coordinator, status and ticket commands."""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence


def _commands() -> dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
]:
    from coordinator.cli import add_coordinator_arguments, add_status_arguments, run_coordinator, run_status
    from peer.cli import add_peer_arguments, run_peer
    from peer.ticket_cli import add_ticket_arguments, run_ticket
    from scripts.swarm import add_swarm_arguments, run_swarm

    return {
        "peer": ("run one training peer (solo or joining a swarm)", add_peer_arguments, run_peer),
        "swarm": ("start a local multi-peer swarm on loopback", add_swarm_arguments, run_swarm),
        "coordinator": (
            "run the coordinator: HTTP API, dashboard and DHT bootstrap",
            add_coordinator_arguments,
            run_coordinator,
        ),
        "status": ("print a run summary from a coordinator", add_status_arguments, run_status),
        "ticket": ("issue an admission ticket with a run's authority key", add_ticket_arguments, run_ticket),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmloco", description="Peer-to-peer DiLoCo training over hivemind.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, runner) in _commands().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_runner=runner)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args._runner(args)


if __name__ == "__main__":
    sys.exit(main())
