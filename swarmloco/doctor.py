"""`swarmloco doctor [--join URL] [peer flags]`: whether this machine can take part in a run, one line per check.

It takes the peer's own flags, so it checks the configuration the peer would run with: Python; torch and the
device (CUDA, bf16); hivemind and its p2pd daemon; the run's manifest and versions (with --join); the listen ports;
every bootstrap address (a TCP connect, with its latency); whether the coordinator can dial back to this machine
(NAT, firewall); this clock against the coordinator's; and the round trip and bandwidth, each way, to the
coordinator. Each failed check says what to do. Exit 0 when the peer can take part, 1 otherwise; --json prints the
same as one object for scripts.
"""
from __future__ import annotations

import argparse
import email.utils
import json
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from swarmloco.peer.cli_args import add_arguments

CLOCK_SKEW_S = 30.0  # reports and tickets are refused beyond 60 s of skew; warn well before
MIN_LINK_BITS = 1e6  # per second, each way
_HOST_PORT = re.compile(r"\A/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    advice: str = ""

    def line(self) -> str:
        text = f"{'✓' if self.ok else '✗'} {self.name:12} {self.detail}"
        return text + (f"\n  → {self.advice}" if self.advice else "")


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", dest="json_out", action="store_true", help="print the checks as one JSON object")
    parser.add_argument("--check-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="how long each network check may take")
    add_arguments(parser)


def _python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("python", ok, sys.version.split()[0], "" if ok else "install Python 3.11 or newer")


def _torch(device: str) -> Check:
    try:
        import torch
    except ImportError as exc:
        return Check("torch", False, f"cannot import torch: {exc}", "pip install swarmloco again (it pins torch)")
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        bf16 = torch.cuda.is_bf16_supported()
        return Check("torch", True, f"{torch.__version__}, CUDA {name}, bf16 {'yes' if bf16 else 'no (fp16)'}")
    if device.startswith("cuda"):
        return Check("torch", False, f"{torch.__version__}: --device {device} but no CUDA device is visible",
                     "install the CUDA build of torch and a driver, or pass --device cpu")
    return Check("torch", True, f"{torch.__version__}, no CUDA device: training runs on the CPU "
                                f"({torch.get_num_threads()} threads)")


def _p2pd() -> Check:
    started = time.monotonic()
    try:
        from swarmloco.protocol.network.dht_host import LocalDHT

        dht = LocalDHT.on_own_thread(name="doctor-dht", host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dht.shutdown()
    except Exception as exc:  # any failure to start the daemon is the finding
        return Check("p2pd", False, f"hivemind's daemon did not start: {type(exc).__name__}: {str(exc)[:200]}",
                     "reinstall hivemind (pip install --force-reinstall hivemind==1.1.12); its p2pd binary must be "
                     "executable")
    return Check("p2pd", True, f"hivemind's libp2p daemon starts ({time.monotonic() - started:.1f}s)")


def _tcp_target(maddr: str) -> tuple[str, int] | None:
    match = _HOST_PORT.match(maddr)
    return (match.group(2), int(match.group(3))) if match else None


def _bootstrap(peers: tuple[str, ...], timeout: float) -> list[Check]:
    if not peers:
        return [Check("bootstrap", False, "no address of a peer in the swarm",
                      "pass --join URL (the run's coordinator) or --initial-peer MADDR")]
    checks = []
    for maddr in peers:
        target = _tcp_target(maddr)
        if target is None:
            checks.append(Check("bootstrap", False, f"{maddr}: not a TCP multiaddr", "copy the whole multiaddr"))
            continue
        started = time.monotonic()
        try:
            with socket.create_connection(target, timeout=timeout):
                pass
        except OSError as exc:
            checks.append(Check("bootstrap", False, f"{maddr}: {exc.strerror or type(exc).__name__}",
                                "is that peer running, and its port open to this machine (firewall, NAT)?"))
            continue
        checks.append(Check("bootstrap", True, f"{maddr} answers ({1000 * (time.monotonic() - started):.0f} ms)"))
    if len(checks) > 1 and any(c.ok for c in checks):  # one reachable address is enough: the rest are notes
        checks = [c if c.ok else Check(c.name, True, c.detail + " (another address answers)") for c in checks]
    return checks


def _reachable(coordinator: str, cfg: Any, timeout: float) -> Check:
    import requests

    # use_relay (on by default) only lets this peer dial through relays; auto-relay makes it reachable through one
    relayed = cfg.network.client_mode or (cfg.network.use_relay and cfg.network.use_auto_relay)
    listen = [m for m in cfg.network.host_maddrs if (t := _tcp_target(m)) is not None and t[1] != 0]
    port = _tcp_target(listen[0])[1] if listen else 0  # type: ignore[index]
    try:
        server = socket.create_server(("", port))
    except OSError as exc:
        return Check("reachable", False, f"cannot listen on port {port} to be dialled: {exc.strerror or exc}",
                     "free that port first (see the ports line)")
    with server:
        port = server.getsockname()[1]
        try:
            resp = requests.get(f"{coordinator.rstrip('/')}/api/dialback", params={"port": port}, timeout=timeout + 5)
            answer = resp.json() if resp.status_code == 200 else {"error": f"HTTP {resp.status_code}"}
        except (requests.RequestException, ValueError) as exc:
            return Check("reachable", False, f"could not ask the coordinator: {type(exc).__name__}",
                         "check --join / --coordinator")
    if answer.get("reachable"):
        return Check("reachable", True, f"the coordinator reached this machine at {answer.get('address')}")
    why = answer.get("error", "no answer")
    if relayed:
        return Check("reachable", True, f"not reachable from outside ({why}), but this peer uses auto-relay or "
                                        "--client-mode, so others need not dial it")
    return Check("reachable", False, f"the coordinator could not connect to this machine on port {port} ({why}): "
                                     "behind NAT or a firewall",
                 f"run with --client-mode (this peer then opens every connection itself: it takes part in rounds "
                 f"but never leads one), or --use-auto-relay to be reached through a relay, or forward TCP port "
                 f"{port} here and "
                 f"pass --host-maddr /ip4/0.0.0.0/tcp/{port} --announce-maddr /ip4/PUBLIC_IP/tcp/{port}")


def _clock(coordinator: str, timeout: float) -> Check:
    import requests

    try:
        resp = requests.get(f"{coordinator.rstrip('/')}/healthz", timeout=timeout)
        theirs = email.utils.parsedate_to_datetime(resp.headers["date"]).timestamp()
    except (requests.RequestException, KeyError, TypeError, ValueError) as exc:
        return Check("clock", False, f"could not read the coordinator's time: {type(exc).__name__}",
                     "check --join / --coordinator")
    skew = time.time() - theirs
    if abs(skew) > CLOCK_SKEW_S:
        return Check("clock", False, f"{skew:+.0f}s against the coordinator",
                     "set this machine's clock (NTP): reports and tickets are refused beyond 60 s of skew")
    return Check("clock", True, f"{skew:+.0f}s against the coordinator (1 s resolution)")


class _NotMeasured(Exception):
    """The coordinator declined a link test (rate-limited, or a version without one): not this machine's fault."""


def _timed(session: Any, base: str, direction: str, size: int, timeout: float) -> float:
    """Seconds to move `size` bytes to (up) or from (down) the coordinator."""
    started = time.monotonic()
    if direction == "down":
        resp = session.get(f"{base}/api/linktest", params={"bytes": size}, timeout=timeout, stream=True)
        got = sum(len(chunk) for chunk in resp.iter_content(1 << 16)) if resp.status_code == 200 else 0
    else:
        resp = session.post(f"{base}/api/linktest", data=bytes(size), timeout=timeout)
        got = resp.json().get("bytes", 0) if resp.status_code == 200 else 0
    if resp.status_code in (404, 405, 429):
        raise _NotMeasured(f"HTTP {resp.status_code}")
    if got != size:
        raise OSError(f"moved {got} of {size} bytes (HTTP {resp.status_code})")
    return time.monotonic() - started


def _rate(session: Any, base: str, direction: str, rtt: float, timeout: float) -> float:
    """Bits per second one way: a 512 KiB probe, then a test sized to take about a second and a half at the
    probe's rate (at most 16 MiB)."""
    size = 512 << 10
    seconds = _timed(session, base, direction, size, timeout)
    if seconds < 1.0:
        size = int(min(16 << 20, max(size, size / max(seconds - rtt, 1e-3) * 1.5)))
        seconds = _timed(session, base, direction, size, timeout)
    return 8 * size / max(seconds - rtt, 1e-3)


def _link(coordinator: str, timeout: float) -> Check:
    """Round trip and bandwidth to the coordinator, the one machine of the run a doctor can always test against."""
    import requests

    base = coordinator.rstrip("/")
    try:
        with requests.Session() as session:
            rtts = []
            for _ in range(4):  # the first opens the connection: not counted
                started = time.monotonic()
                session.get(f"{base}/healthz", timeout=timeout).raise_for_status()
                rtts.append(time.monotonic() - started)
            rtt = sorted(rtts[1:])[1]
            down, up = (_rate(session, base, d, rtt, max(timeout, 30.0)) for d in ("down", "up"))
    except _NotMeasured as exc:
        return Check("link", True, f"bandwidth not measured: the coordinator declined ({exc})")
    except (requests.RequestException, OSError, ValueError) as exc:
        return Check("link", False, f"the link test to the coordinator failed: {type(exc).__name__}: {exc}",
                     "check --join / --coordinator, and that nothing between cuts long transfers")
    text = (f"{1000 * rtt:.0f} ms round trip, {down / 1e6:,.0f} Mbit/s down, {up / 1e6:,.0f} Mbit/s up "
            "(to the coordinator)")
    if min(down, up) < MIN_LINK_BITS:
        return Check("link", False, text, "a round moves the model's pseudo-gradient each way: below 1 Mbit/s this "
                                          "peer misses rounds; use a faster link")
    return Check("link", True, text)


def checks(args: argparse.Namespace) -> list[Check]:
    from swarmloco.peer import preflight
    from swarmloco.peer.cli import joined_config
    from swarmloco.peer.config import ConfigError

    found = [_python()]
    try:
        cfg = joined_config(args)
    except ConfigError as exc:
        return [*found, Check("config", False, str(exc), "fix the flag or the manifest it names")]
    run = cfg.network.run_id
    found.append(Check("config", True, f"run {run!r}" + (f" from {cfg.run.join}" if cfg.run.join else "")))
    found.append(_torch(cfg.runtime.device))
    found.append(_p2pd())
    try:
        preflight.check_network(cfg)
        found.append(Check("ports", True, "listen addresses free: " + ", ".join(cfg.network.host_maddrs)))
    except ConfigError as exc:
        found.append(Check("ports", False, str(exc)))  # the message says what to do
    timeout = args.check_timeout
    if not cfg.run.solo:
        found += _bootstrap(cfg.network.initial_peers, timeout)
    coordinator = cfg.run.coordinator
    if coordinator:
        steps: list[Callable[[], Check]] = [lambda: _reachable(coordinator, cfg, timeout),
                                            lambda: _clock(coordinator, timeout), lambda: _link(coordinator, timeout)]
        found += [step() for step in steps]
    return found


def run_doctor(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    found = checks(args)
    ok = all(c.ok for c in found)
    if args.json_out:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in found]}, indent=2))
    else:
        for c in found:
            print(c.line())
        print("this machine can take part" if ok else "this machine cannot take part yet: see the ✗ lines")
    return 0 if ok else 1
