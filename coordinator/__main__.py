"""``python -m swarmloco.coordinator``: run the coordinator as a process (argv documented in
:mod:`swarmloco.coordinator.cli`)."""

from __future__ import annotations

import argparse
import sys

from swarmloco.coordinator.cli import add_coordinator_arguments, run_coordinator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarmloco.coordinator", description="swarmloco coordinator")
    add_coordinator_arguments(parser)
    return run_coordinator(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
