"""The `swarmloco` console script: dispatches to the peer, local-swarm, coordinator, status and ticket commands.

Only the chosen command's flags are built, from modules that do not import torch or hivemind, so `--help` and a
mistyped flag answer at once; the command's runner imports what it needs when it starts. An unknown flag is
reported with the command's own usage, and the closest real flag.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: str  # "module:function", a light module: it only declares flags
    run: str  # "module:function", imported only to run the command

    def load(self, which: str) -> Callable[..., object]:
        module, _, name = getattr(self, which).partition(":")
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


COMMANDS: dict[str, Command] = {
    "peer": Command("run one training peer (solo or joining a swarm)", "swarmloco.peer.cli_args:add_arguments",
                    "swarmloco.peer.cli:run_peer"),
    "swarm": Command("start a local multi-peer swarm on loopback", "swarmloco.swarm:add_swarm_arguments",
                     "swarmloco.swarm:run_swarm"),
    "coordinator": Command("run the coordinator: HTTP API, dashboard and DHT bootstrap",
                           "swarmloco.coordinator.cli:add_coordinator_arguments",
                           "swarmloco.coordinator_cmd:run"),
    "status": Command("print a run summary from a coordinator", "swarmloco.coordinator.cli:add_status_arguments",
                      "swarmloco.coordinator.cli:run_status"),
    "ticket": Command("issue an admission ticket with a run's authority key",
                      "swarmloco.peer.ticket_cli:add_ticket_arguments", "swarmloco.peer.ticket_cli:run_ticket"),
    "doctor": Command("check this machine and a run before joining it: one line per check, and what to do",
                      "swarmloco.doctor:add_doctor_arguments", "swarmloco.doctor:run_doctor"),
    "export": Command("write the run's agreed model from a peer's checkpoint as a plain safetensors file",
                      "swarmloco.export:add_export_arguments", "swarmloco.export:run_export"),
    "sample": Command("print text the default task's model generates from a prompt",
                      "swarmloco.export:add_sample_arguments", "swarmloco.export:run_sample"),
    "chaos": Command("run real local peers under a fault scenario (churn, SIGSTOP, burners, coordinator restart)",
                     "swarmloco.chaos_scenarios:add_chaos_arguments", "swarmloco.chaos:run_chaos"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, except the empty ones (None, False, []) that would only add noise."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or "(default:" in text or default in (None, False, [], argparse.SUPPRESS):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


def _chosen(argv: Sequence[str]) -> str | None:
    """The command named in argv (its first word that is not an option), if it is one of ours."""
    words = [a for a in argv if not a.startswith("-")]
    return words[0] if words and words[0] in COMMANDS else None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with `argv`, only the command it names gets its flags (all of them without it)."""
    parser = argparse.ArgumentParser(prog="swarmloco", description="Peer-to-peer DiLoCo training over hivemind.",
                                     epilog="`swarmloco COMMAND --help` lists a command's flags with their defaults.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen(argv) if argv is not None else None
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help, formatter_class=HelpFormatter)
        if argv is None or name == chosen:
            command.load("add_arguments")(p)
        p.set_defaults(_command=name)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    raise KeyError(name)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse would blame the top-level parser, whose usage does not list the command's flags
        sub = _subparser(parser, args.command)
        flags = [s for a in sub._actions for s in a.option_strings]
        unknown = extra[0].split("=", 1)[0]
        close = difflib.get_close_matches(unknown, flags, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        sub.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(COMMANDS[args._command].load("run")(args))  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
