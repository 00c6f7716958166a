"""Command-line hooks for ``swarmloco coordinator`` and ``swarmloco status`` (wired into swarmloco/cli.py).

Subprocess use (local swarm launcher, tests)::

    python -m swarmloco.coordinator --db runs.sqlite --port 0 --ready-file ready.json [--no-dht] [--run-id RUN]

The ready file appears (atomically) once the server accepts connections; see :mod:`swarmloco.coordinator.server` for its
JSON fields (``url``, ``port``, ``dht_maddrs``, ``join_command``, ...). SIGINT/SIGTERM stop it cleanly.

Who may join: ``--admission invite|open|allowlist|none`` (with ``--invite-code``/``--invite-file``, ``--work-bits``
or ``--allowlist``) and ``--ticket-lifetime``. The default is ``invite``: without a code given, the coordinator
generates one, keeps it in ``<db>.invite`` (so a restart keeps accepting it) and prints it in the join command.
An ``open`` run must be asked for, and asks every new identity for a proof of work (``--work-bits``).
``swarmloco coordinator revoke --db DB PEER_ID [--reason TEXT]`` and ``unrevoke`` change the revocation list,
also while the server runs (same database file).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import secrets
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

# Only light modules here: `swarmloco --help` and argument errors must not wait for uvicorn, fastapi or hivemind,
# which run_coordinator and run_status import when they are needed.
from swarmloco.coordinator.files import write_atomically
from swarmloco.coordinator.revocation_cli import add_revocation_commands, run_revocation
from swarmloco.protocol.base.text import bounded, short_hash
from swarmloco.protocol.network.ports import port_taken
from swarmloco.protocol.trust.admission import POLICIES, AdmissionPolicy, load_allowlist
from swarmloco.protocol.trust.ticket_request import MAX_INVITE_CHARS  # a longer code could never be presented

__all__ = ["add_coordinator_arguments", "add_status_arguments", "admission_policy", "run_coordinator", "run_status"]

logger = logging.getLogger(__name__)

MAX_INVITE_FILE_BYTES = 1024 * 1024
INVITE_SUFFIX = ".invite"  # the generated invite code lives next to the database, like its <db>.key


def add_coordinator_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``swarmloco coordinator``."""
    parser.add_argument("--db", type=Path, default=Path("runs.sqlite"),
                        help="SQLite file that stores runs, peers, rounds and metrics (created if missing)")
    parser.add_argument("--host", default="127.0.0.1", help="address the HTTP API and dashboard listen on")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one (see --ready-file)")
    parser.add_argument("--run-id", default="default",
                        help="run shown by default on the dashboard and printed in the join command")
    parser.add_argument("--no-dht", action="store_true", help="do not start the hivemind DHT bootstrap node")
    parser.add_argument("--dht-host", default="127.0.0.1", help="address the DHT bootstrap node listens on")
    parser.add_argument("--dht-port", type=int, default=0, help="TCP port of the DHT bootstrap node; 0 = any free")
    parser.add_argument("--identity", type=Path, default=None,
                        help="Ed25519 identity file of the DHT node (default: <db>.key; keeps its multiaddr stable)")
    parser.add_argument("--ready-file", type=Path, default=None,
                        help="write the bound URL and DHT multiaddrs as JSON to this file once listening")
    parser.add_argument("--max-past-s", type=float, default=900.0,
                        help="reject new reports whose timestamp is more than this many seconds old")
    parser.add_argument("--max-future-s", type=float, default=60.0,
                        help="reject reports whose timestamp is more than this many seconds ahead")
    parser.add_argument("--online-window-s", type=float, default=60.0,
                        help="a peer seen within this many seconds counts as online")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity")
    parser.add_argument("--admission", default="invite", choices=POLICIES,
                        help="who gets a ticket: invite (the default: with an invite code; one is generated and "
                             "printed when none is given), open (anyone who brings a proof of work, rate-limited), "
                             "allowlist (listed peer ids), none (no tickets: a private swarm where anyone who can "
                             "reach the peers takes part)")
    parser.add_argument("--work-bits", type=int, default=None, metavar="BITS",
                        help="--admission open: a new identity must find a hash with this many leading zero bits, "
                             "2^BITS hashes of work (default 27: about a CPU-minute; 0 = none; at most 40)")
    parser.add_argument("--invite-code", action="append", default=[], metavar="CODE",
                        help="an invite code accepted by --admission invite (repeatable)")
    parser.add_argument("--invite-file", type=Path, default=None, metavar="FILE",
                        help="invite codes for --admission invite, one per line")
    parser.add_argument("--allowlist", type=Path, default=None, metavar="FILE",
                        help="peer ids for --admission allowlist, one per line ('#' starts a comment)")
    parser.add_argument("--run-config", type=Path, default=None, metavar="FILE",
                        help="TOML (the peer's --config sections) of the settings every peer of the run shares: "
                             "the model, the inner and outer optimiser, the round rules, the seed; served in the run "
                             "manifest, which `swarmloco peer --join URL` reads")
    parser.add_argument("--price", default="", metavar="KIND=PER_HOUR,...",
                        help="what a device-hour costs, by device kind (cpu, cuda, mps, xpu, other), e.g. "
                             "cuda=2.1,cpu=0.05: the dashboard and /api/accounting then show the run's cost and the "
                             "cost per point of eval loss")
    parser.add_argument("--checkpoint-every", type=float, default=120.0, metavar="SECONDS",
                        help="sign a checkpoint of the heaviest certified chain this often (5 .. 86400; 0 = never): "
                             "peers weigh signers, groups and leaders by the seniority it names")
    parser.add_argument("--founders", type=Path, default=None, metavar="FILE",
                        help="peer ids the first checkpoint's chain must be signed by (at least a third of those "
                             "active, and one), one per line: in an open run, strangers who report a chain of their "
                             "own before the first checkpoint cannot have it vouched for")
    parser.add_argument("--ticket-lifetime", type=float, default=3600.0, metavar="SECONDS",
                        help="how long a ticket is valid; peers renew at half of it")
    # None keeps ConnectionLimits' default (coordinator/connections.py), which imports uvicorn: not here
    parser.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                        help="close a connection with no request in progress after this long (default 5)")
    parser.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                        help="a request must arrive and be answered within this long of its first byte (default 30)")
    parser.add_argument("--max-connections", type=int, default=None, metavar="N",
                        help="open connections in total; at the cap the longest idle one is closed (default 2048)")
    parser.add_argument("--max-connections-per-address", type=int, default=None, metavar="N",
                        help="open connections per client IPv4 address or IPv6 /64 (default 64; behind a reverse "
                             "proxy, set it to --max-connections)")
    add_revocation_commands(parser)


_CONNECTION_FLAGS = {"idle_timeout": "idle_timeout_s", "request_timeout": "request_timeout_s",
                     "max_connections": "max_connections", "max_connections_per_address": "max_per_address"}


def _invite_codes(args: argparse.Namespace) -> frozenset[str]:
    codes = [c.strip() for c in args.invite_code]
    if args.invite_file is not None:
        with open(args.invite_file, "rb") as f:
            blob = f.read(MAX_INVITE_FILE_BYTES + 1)
        if len(blob) > MAX_INVITE_FILE_BYTES:
            raise ValueError(f"--invite-file {args.invite_file} is larger than {MAX_INVITE_FILE_BYTES} bytes")
        codes += [line.strip() for line in blob.decode("utf-8", errors="strict").splitlines()]
    codes = [c for c in codes if c]
    long = [c for c in codes if len(c) > MAX_INVITE_CHARS]
    if long:
        raise ValueError(f"invite codes must be at most {MAX_INVITE_CHARS} chars; one has {len(long[0])}")
    return frozenset(codes)


def generated_invite(path: Path) -> str:
    """The invite code kept in ``path``; a random one, written there readable by its owner only, the first time."""
    try:
        with open(path, "rb") as f:
            code = f.read(MAX_INVITE_CHARS + 3).decode("utf-8", errors="strict").strip()
    except FileNotFoundError:
        code = ""
    if len(code) > MAX_INVITE_CHARS or "\n" in code:
        raise ValueError(f"{path} must hold one invite code of at most {MAX_INVITE_CHARS} chars")
    if code:
        return code
    code = "-"
    while code.startswith("-"):  # a code that starts like a flag would be read as one: `--invite -x...` fails
        code = secrets.token_urlsafe(18)
    write_atomically(path, code + "\n", private=True)
    return code


def invite_to_generate(args: argparse.Namespace) -> bool:
    """Whether these flags ask for an invite run without naming a code: the coordinator then makes one."""
    return args.admission == "invite" and not args.invite_code and args.invite_file is None


def admission_policy(args: argparse.Namespace, *, generated: str = "") -> AdmissionPolicy:
    """The policy the admission flags describe, with ``generated`` as the invite code when they name none; raises
    ValueError (AdmissionError) for a bad combination."""
    codes = _invite_codes(args) | ({generated} if generated and invite_to_generate(args) else set())
    if (args.invite_code or args.invite_file is not None) and args.admission != "invite":
        raise ValueError(f"--invite-code/--invite-file need --admission invite (got --admission {args.admission})")
    if args.allowlist is not None and args.admission != "allowlist":
        raise ValueError(f"--allowlist needs --admission allowlist (got --admission {args.admission})")
    if args.admission == "invite" and args.invite_file is not None and not codes:
        raise ValueError(f"--invite-file {args.invite_file} holds no invite code")
    allowlist = load_allowlist(args.allowlist) if args.allowlist is not None else frozenset()
    if args.work_bits is not None and args.admission != "open":
        raise ValueError(f"--work-bits needs --admission open (got --admission {args.admission})")
    return AdmissionPolicy(mode=args.admission, invite_codes=codes, allowlist=allowlist,
                           ticket_s=args.ticket_lifetime)


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's shared settings: as `swarmloco coordinator` checked them against the peer's (`args.run_settings`),
    or read from --run-config as they are (the manifest's shape is still checked)."""
    checked = getattr(args, "run_settings", None)
    if checked is not None or args.run_config is None:
        return dict(checked or {})
    try:
        with open(args.run_config, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--run-config {args.run_config} is not valid TOML: {exc}") from None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _maddr_host(maddr: str) -> str:
    parts = maddr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") else ""


def public_join(info: dict[str, Any], *, host: str, dht_host: str, invite: str = "") -> tuple[str, str | None]:
    """The join command to print, and a note when it only works on this machine.

    The command names the coordinator's URL, where the peer reads the run manifest (which lists the DHT node's
    addresses). A DHT node on a wildcard address lists every interface's address, loopback first; a volunteer
    elsewhere needs one of the others, and the coordinator's URL on that same address when the HTTP API listens on
    every interface."""
    maddrs = list(info.get("dht_maddrs") or [])
    public = [m for m in maddrs if not _loopback(_maddr_host(m))]
    url = info["url"]
    if host in ("0.0.0.0", "::", "") and public:
        address = _maddr_host(public[0])
        url = f"http://{address if ':' not in address else f'[{address}]'}:{info['port']}"
    command = shlex.join(["swarmloco", "peer", "--join", url, *(["--invite", invite] if invite else [])])
    local = [flag for flag, only_here in (("--host", _loopback(host) or url == info["url"] and not public),
                                          ("--dht-host", bool(maddrs) and not public)) if only_here]
    note = None
    if local:
        note = (f"only a loopback address is known ({' and '.join(local)}), so this command works on this machine "
                "only: to let other machines join, start with --host 0.0.0.0 --dht-host 0.0.0.0 (or this machine's "
                "address)")
    return command, note


def _ports_problem(args: argparse.Namespace) -> str | None:
    """One line naming a port this coordinator cannot own, or None. p2pd would share a taken DHT port silently."""
    wanted = [("--port", args.host, args.port)] + ([] if args.no_dht else [("--dht-port", args.dht_host,
                                                                             args.dht_port)])
    for flag, host, port in wanted:
        why = port_taken(host, port)
        if why:
            return (f"{flag} {port} on {host} cannot be used ({why}): another coordinator or peer is probably "
                    f"listening there; stop it, or pick another {flag} (0 = any free port)")
    return None


def run_coordinator(args: argparse.Namespace) -> int:
    """Start the coordinator in the foreground (or run a revocation command); returns the process exit code."""
    logging.basicConfig(level=getattr(logging, args.log_level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "coordinator_action", None):
        return run_revocation(args)
    from swarmloco.coordinator.accounting import parse_prices
    from swarmloco.coordinator.authority import AuthorityConfig
    from swarmloco.coordinator.checkpoints import CheckpointConfig
    from swarmloco.coordinator.connections import ConnectionLimits
    from swarmloco.coordinator.server import CoordinatorConfig, CoordinatorServer
    from swarmloco.coordinator.service import ServiceConfig
    from swarmloco.coordinator.store import StoreError

    problem = _ports_problem(args)
    if problem:
        print(f"swarmloco coordinator: {problem}", file=sys.stderr)
        return 2
    try:
        if not Path(args.db).parent.is_dir():  # before the invite code is written there
            raise ValueError(f"directory of --db {args.db} does not exist; create it first")
        generated = generated_invite(Path(str(args.db) + INVITE_SUFFIX)) if invite_to_generate(args) else ""
        policy = admission_policy(args, generated=generated)
        work = {} if args.work_bits is None else {"work_bits": args.work_bits}
        founders = load_allowlist(args.founders) if args.founders is not None else frozenset()
        if args.founders is not None and not founders:
            raise ValueError(f"--founders {args.founders} holds no peer id")
        checkpoints = CheckpointConfig(every_s=args.checkpoint_every, founders=founders)
        if founders and (policy.mode == "none" or not checkpoints.every_s):
            raise ValueError("--founders needs checkpoints: an admission policy other than none, and "
                             "--checkpoint-every above 0")
        service = ServiceConfig(run_id=args.run_id, max_past_s=args.max_past_s, max_future_s=args.max_future_s,
                                online_window_s=args.online_window_s, authority=AuthorityConfig(policy=policy, **work),
                                checkpoints=checkpoints, run_settings=run_settings(args),
                                run_task=getattr(args, "run_task", ""),
                                run_fingerprint=getattr(args, "run_fingerprint", ""),
                                prices=parse_prices(args.price) if args.price.strip() else {})
        config = CoordinatorConfig(db=args.db, host=args.host, port=args.port, dht=not args.no_dht,
                                   dht_host=args.dht_host, dht_port=args.dht_port, identity_path=args.identity,
                                   ready_file=args.ready_file, local_invite=generated, service=service,
                                   connections=ConnectionLimits(**{
                                       field: getattr(args, flag) for flag, field in _CONNECTION_FLAGS.items()
                                       if getattr(args, flag, None) is not None}))
        server = CoordinatorServer(config)
    except (ValueError, StoreError, OSError) as e:
        print(f"swarmloco coordinator: {e}", file=sys.stderr)
        return 2
    if policy.mode == "none":
        logger.warning("admission none: this coordinator issues no tickets; private swarm: anyone who can reach the "
                       "peers takes part")
    if config.dht:
        server.start_dht()
    info = server.info()
    print(f"coordinator  {info['url']}   (dashboard: {info['url']}/   API docs: {info['url']}/docs)")
    print(f"database     {info['db']}")
    bits = service.authority.work_bits
    work = f", a {bits}-bit proof of work per new identity" if policy.mode == "open" and bits else ""
    print(f"authority    {info['authority']}   (admission: {info['admission']}{work})")
    if generated:
        print(f"invite code  {generated}   (generated, kept in {args.db}{INVITE_SUFFIX}: whoever has it may join)")
    elif policy.mode == "invite":
        print("invite code  one of those given with --invite-code/--invite-file (peers pass it with --invite)")
    if policy.mode != "none" and checkpoints.every_s:
        named = f"; the first needs {len(founders)} founder(s)' signatures" if founders else (
            "; no --founders: the first vouches for the heaviest chain" if policy.mode == "open" else "")
        print(f"checkpoints  every {checkpoints.every_s:g} s{named}")
    for maddr in info["dht_maddrs"]:
        print(f"DHT node     {maddr}")
    command, note = public_join(info, host=args.host, dht_host=args.dht_host, invite=generated)
    print(f"join with:   {command}", flush=True)
    if note:
        print(f"note:        {note}", flush=True)
    server.run()
    return 0


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``swarmloco status``."""
    parser.add_argument("--coordinator", required=True, help="coordinator URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--run-id", default=None, help="run to summarise (default: the coordinator's run)")
    parser.add_argument("--rounds", type=int, default=10, help="how many recent rounds to list")
    parser.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout in seconds")


def _get(base: str, path: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
    import requests

    resp = requests.get(base.rstrip("/") + path, params=params, timeout=timeout)
    resp.raise_for_status()
    return resp.json()


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) for r in rows]
    return "\n".join(lines)


def _fmt(x: Any, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def run_status(args: argparse.Namespace) -> int:
    """Print peers, recent rounds and losses of a run; exit code 1 if the coordinator is unreachable."""
    import requests

    try:
        run_id = args.run_id or _get(args.coordinator, "/api/runs", {"limit": 1}, args.timeout)["default_run_id"]
        peers = _get(args.coordinator, "/api/peers", {"run_id": run_id, "limit": 1000}, args.timeout)["items"]
        rounds = _get(args.coordinator, "/api/rounds",
                      {"run_id": run_id, "limit": max(1, min(args.rounds, 1000)), "order": "desc"},
                      args.timeout)["items"]
        accounts = _get(args.coordinator, "/api/accounting", {"run_id": run_id}, args.timeout)
    except (requests.RequestException, ValueError, KeyError) as e:
        print(f"swarmloco status: cannot read {args.coordinator}: {e}", file=sys.stderr)
        return 1
    print(f"run {run_id}: {sum(p['online'] for p in peers)} of {len(peers)} peers online\n")
    print(_table(["peer", "online", "device", "credited tokens", "vouched", "tok/s", "rounds", "train loss"], [
        [p["peer_id"][-12:], "yes" if p["online"] else "no", p["device"] or "-", _fmt(p["credited_tokens"], ","),
         _fmt(p.get("vouched_tokens"), ","), _fmt(p["last_tokens_per_s"], ".0f"), str(p["rounds_committed"]),
         _fmt(p["last_train_loss"], ".4f")]
        for p in peers]))
    print()
    _print_accounts(peers, accounts)
    print()
    print(_table(["round", "outcome", "members", "tokens", "eval loss", "hash", "failure"], [
        [str(r["round"]), r["outcome"], str(len(r["members"])), _fmt(r["tokens_total"], ","),
         _fmt(r["eval_loss"], ".4f"), short_hash(r["state_hash"] or "-"),
         bounded("; ".join(r["failure_reasons"]), 60) or "-"]
        for r in rounds]))
    return 0


def _print_accounts(peers: list[dict[str, Any]], run: dict[str, Any]) -> None:
    """The contributors table and the run's goodput and cost (see swarmloco.coordinator.accounting)."""
    print(_table(["contributor", "kind", "device h", "verified tokens", "wasted", "sent MiB", "recv MiB",
                  "joined/led/missed", "resyncs", "lost s"], [
        [p["peer_id"][-12:], p["device_kind"], _fmt(p["device_s"] / 3600, ".2f"), _fmt(p["credited_tokens"], ","),
         _fmt(p["wasted_tokens"], ","), _fmt(p["bytes_sent"] / 2**20, ".1f"), _fmt(p["bytes_received"] / 2**20, ".1f"),
         f"{p['rounds_joined']}/{p['rounds_led']}/{p['rounds_missed']}", str(p["resyncs"]), _fmt(p["lost_s"], ".0f")]
        for p in sorted(peers, key=lambda p: -p["credited_tokens"])]))
    hours = sum(run["device_hours"].values())
    cost = "-" if run["cost"] is None else f"{run['cost']:.2f}"
    per_point = run["cost_per_eval_loss_point"]
    print(f"\ngoodput {_fmt(run['goodput_tokens_per_s'], ',.0f')} verified tokens/s; "
          f"{run['verified_tokens']:,} verified, {run['wasted_tokens']:,} wasted; {hours:.2f} billed device-hours, "
          f"cost {cost}" + ("" if per_point is None else f", {per_point:.2f} per point of eval loss")
          + (f" (no --price for {', '.join(run['unpriced'])})" if run["unpriced"] else ""))
