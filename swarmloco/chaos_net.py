"""Network namespaces for chaos scenarios that cut links between peers (`partition-2-2`).

Each peer runs in a namespace of its own with one veth link to a hub namespace. The hub holds two bridges, one per
side of the split, joined by a veth pair: cutting that pair (link down) splits the swarm in two, and bringing it
back up heals it, while every peer keeps its own links, addresses and connections. The run's bootstrap DHT node
runs in the hub, on the first side's bridge. All traffic stays inside namespaces this module creates, on a /24 of
10.78.0.0/16 picked from the run's pid; everything created is deleted on `close`. Needs root (CI runs as root).

`python -m swarmloco.chaos_net bootstrap --host ADDR --out FILE` is the hub's bootstrap node: it writes its
multiaddrs to FILE as JSON and serves until it is terminated.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


class NetnsError(RuntimeError):
    """A namespace, link or address could not be set up (not root, or the kernel refused); the message says why."""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    try:
        res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {exc}") from None
    if res.returncode:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")


@dataclass
class SplitNet:
    """Peer i in namespace `names[i]` at `address(i)`, on side `sides[i]` (0 or 1) of the split."""

    sides: tuple[int, ...]
    tag: str = field(default_factory=lambda: f"slc{os.getpid() % 100_000}")
    subnet: str = field(default_factory=lambda: f"10.78.{os.getpid() % 250 + 1}")
    created: list[str] = field(default_factory=list)
    cut: bool = False

    @property
    def hub(self) -> str:
        return f"{self.tag}h"

    @property
    def bootstrap_host(self) -> str:
        return f"{self.subnet}.254"

    def name(self, i: int) -> str:
        return f"{self.tag}p{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        """What runs a command in peer i's namespace (it execs the command: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.name(i)]

    def create(self) -> None:
        if os.geteuid() != 0:
            raise NetnsError("this scenario splits the network with namespaces, which needs root")
        if not 2 <= len(self.sides) <= 200 or set(self.sides) != {0, 1}:
            raise NetnsError(f"a split needs 2 .. 200 peers on two sides, got sides {self.sides}")
        try:
            self._create()
        except NetnsError:
            self.close()
            raise

    def _create(self) -> None:
        hub = self.hub
        _ip("netns", "add", hub)
        self.created.append(hub)
        for dev in ("br0", "br1"):
            _ip("link", "add", dev, "type", "bridge", ns=hub)
            _ip("link", "set", dev, "up", ns=hub)
        _ip("link", "add", "xa", "type", "veth", "peer", "name", "xb", ns=hub)
        for end, bridge in (("xa", "br0"), ("xb", "br1")):
            _ip("link", "set", end, "master", bridge, ns=hub)
            _ip("link", "set", end, "up", ns=hub)
        _ip("addr", "add", f"{self.bootstrap_host}/24", "dev", "br0", ns=hub)
        _ip("link", "set", "lo", "up", ns=hub)
        for i, side in enumerate(self.sides):
            ns = self.name(i)
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}", ns=ns)
            _ip("link", "set", f"v{i}", "netns", hub, ns=ns)
            _ip("addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "set", f"v{i}", "master", f"br{side}", ns=hub)
            _ip("link", "set", f"v{i}", "up", ns=hub)

    def split(self, cut: bool) -> None:
        """Cut (or restore) every link between the two sides at once."""
        for end in ("xa", "xb"):
            _ip("link", "set", end, "down" if cut else "up", ns=self.hub)
        self.cut = cut

    def start_bootstrap(self, workdir: Path, env: dict[str, str], *,
                        timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], list[str]]:
        """Start the run's bootstrap DHT node in the hub, on the first side; returns it and its multiaddrs. It runs in
        a session of its own, so that stopping it takes its p2pd daemon along."""
        out = workdir / "bootstrap.json"
        out.unlink(missing_ok=True)
        argv = ["ip", "netns", "exec", self.hub, sys.executable, "-m", "swarmloco.chaos_net", "bootstrap",
                "--host", self.bootstrap_host, "--out", str(out)]
        with open(workdir / "bootstrap.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not out.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise NetnsError(f"the bootstrap node did not start; see {workdir / 'bootstrap.log'}")
            time.sleep(0.2)
        return proc, [str(m) for m in json.loads(out.read_text())]

    def close(self) -> None:
        """Delete every namespace this net created (their links go with them)."""
        for ns in reversed(self.created):
            res = subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, text=True, timeout=30)
            if res.returncode:
                logger.warning("could not delete namespace %s: %s", ns, res.stderr.strip())
        self.created.clear()


def _bootstrap(host: str, out: Path) -> int:
    from swarmloco.protocol.network.dht_host import LocalDHT

    dht = LocalDHT.on_own_thread(name="chaos-bootstrap", host_maddrs=[f"/ip4/{host}/tcp/0"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
    tmp.replace(out)
    try:
        stop.wait()
    finally:
        dht.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="internal: the bootstrap DHT node of a chaos run's split network")
    sub = parser.add_subparsers(dest="role", required=True)
    boot = sub.add_parser("bootstrap", help="serve a bootstrap DHT node until terminated")
    boot.add_argument("--host", required=True, help="the address to listen on")
    boot.add_argument("--out", required=True, type=Path, help="write the node's multiaddrs here (JSON)")
    args = parser.parse_args(argv)
    return _bootstrap(args.host, args.out)


if __name__ == "__main__":
    sys.exit(main())
