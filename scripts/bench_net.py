"""Network plumbing for the benchmarks: timed plain-TCP transfers and shaped links between network namespaces.

`socket_seconds` moves N bytes from one or more sender processes to one receiver process over plain TCP and
returns the time from "all connected, go" until the receiver holds every byte. Sender and receiver can run inside
network namespaces (a command prefix such as `ip netns exec NS`).

`shaped_star` (root only) builds a star of our own namespaces: peer i lives in namespace `<tag>p<i>` with address
10.77.0.<i+1>/24 on a veth pair whose other end joins a bridge in namespace `<tag>hub`; both ends of every veth are
shaped with `tc qdisc add dev X root tbf rate R burst 32kbit latency 400ms`. Everything it creates is deleted in
`finally`. Run `python -m scripts.bench_net recv|send ...` only through these helpers.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.bench_common import kill_processes

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 4 << 20
SUBNET = "10.77.0"


class NetnsUnavailable(RuntimeError):
    """Namespaces or tc cannot be used here (not root, or the kernel refuses); the message says why."""


@dataclass(frozen=True)
class Netns:
    name: str
    address: str

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


def _receiver(host: str, streams: int, nbytes: int, keep: bool = False) -> None:
    """Listen, accept `streams` connections, send each a go byte, receive nbytes in total; print JSON. `keep`: land
    the bytes in one freshly allocated buffer of nbytes (each stream in its own slice, in order), as a joiner must
    keep a state, instead of reusing one small cache-hot buffer; the allocation is timed too."""
    import threading

    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, 0))
        srv.listen(streams)
        print(srv.getsockname()[1], flush=True)
        srv.settimeout(60)
        conns = [srv.accept()[0] for _ in range(streams)]
    received = [0] * streams
    width = -(-nbytes // streams)  # the largest share (accept order need not be the senders' order)
    blob: list[memoryview] = []

    def pull(i: int) -> None:  # each sender shuts down its side after its share: read to EOF
        if keep:
            buf = blob[0][i * width:(i + 1) * width]
        else:
            buf = memoryview(bytearray(CHUNK))
        conns[i].settimeout(120)
        while True:
            n = conns[i].recv_into(buf[received[i]:] if keep else buf)
            if n == 0:
                break
            received[i] += n

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    if keep:
        blob.append(memoryview(bytearray(width * streams)))  # zeroed pages mapped on first touch, as a fresh blob's
    for c in conns:
        c.sendall(b"g")
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    print(json.dumps({"seconds": elapsed, "bytes": sum(received), "expected": nbytes}), flush=True)


def _sender(host: str, port: int, nbytes: int) -> None:
    payload = memoryview(bytearray(os.urandom(1 << 20)) * max(1, -(-min(nbytes, CHUNK) // (1 << 20))))
    with socket.create_connection((host, port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if s.recv(1) != b"g":
            raise RuntimeError("receiver closed before go")
        sent = 0
        while sent < nbytes:
            n = min(len(payload), nbytes - sent)
            s.sendall(payload[:n])
            sent += n
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # wait for the receiver to close: every byte has arrived


def socket_seconds(nbytes: int, *, streams: int = 1, host: str = "127.0.0.1", receiver_prefix: Sequence[str] = (),
                   sender_prefixes: Sequence[Sequence[str]] = (), timeout: float = 300, keep: bool = False) -> float:
    """Seconds to move nbytes (split over `streams` senders) to one receiver over plain TCP. `keep`: the receiver
    lands them in one fresh buffer of nbytes instead of a small reused one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    me = [sys.executable, "-m", "scripts.bench_net"]
    procs: list[subprocess.Popen[Any]] = []
    try:
        recv = subprocess.Popen(
            [*receiver_prefix, *me, "recv", host, str(streams), str(nbytes), *(["--keep"] if keep else [])],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        procs.append(recv)
        port = _readline(recv, timeout)
        parts = [nbytes // streams + (1 if i < nbytes % streams else 0) for i in range(streams)]
        for i, part in enumerate(parts):
            prefix = sender_prefixes[i] if i < len(sender_prefixes) else ()
            procs.append(subprocess.Popen([*prefix, *me, "send", host, port, str(part)], env=env, cwd=ROOT))
        result = json.loads(_readline(recv, timeout))
        if result["bytes"] != nbytes:
            raise RuntimeError(f"socket transfer lost data: {result['bytes']} of {nbytes} bytes")
        for p in procs:
            p.wait(timeout)
        return float(result["seconds"])
    finally:
        kill_processes(procs)


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    import select

    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        raise RuntimeError(f"socket receiver gave no output within {timeout:.0f} s (exit {proc.poll()})")
    return line


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    if res.returncode:
        raise NetnsUnavailable(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")


@contextlib.contextmanager
def shaped_star(peers: int, *, rate: str = "100mbit", tag: str | None = None) -> Iterator[list[Netns]]:
    """Namespaces for `peers` peers joined by a bridge; every link shaped to `rate`. Deleted on exit."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root; skipped")
    if not 2 <= peers <= 200:
        raise ValueError(f"peers: got {peers}, allowed 2 .. 200")
    tag = tag or f"slb{os.getpid() % 100000}"
    hub = f"{tag}hub"
    created: list[str] = []
    try:
        _ip("ip", "netns", "add", hub)
        created.append(hub)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=hub)
        _ip("ip", "link", "set", "br0", "up", ns=hub)
        out = []
        for i in range(peers):
            ns, addr = f"{tag}p{i}", f"{SUBNET}.{i + 1}"
            _ip("ip", "netns", "add", ns)
            created.append(ns)
            _ip("ip", "link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}", ns=ns)
            _ip("ip", "link", "set", f"v{i}", "netns", hub, ns=ns)
            _ip("ip", "addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            for dev, where in (("eth0", ns), ("lo", ns)):
                _ip("ip", "link", "set", dev, "up", ns=where)
            _ip("ip", "link", "set", f"v{i}", "master", "br0", ns=hub)
            _ip("ip", "link", "set", f"v{i}", "up", ns=hub)
            for dev, where in (("eth0", ns), (f"v{i}", hub)):
                _ip(
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "32kbit",
                    "latency",
                    "400ms",
                    ns=where,
                )
            out.append(Netns(ns, addr))
        yield out
    finally:
        for ns in reversed(created):
            res = subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, text=True, timeout=30)
            if res.returncode:
                logger.warning("could not delete namespace %s: %s", ns, res.stderr.strip())


def shaped_link_check(nbytes: int, *, rate: str = "100mbit") -> dict[str, float | str]:
    """Throughput of one TCP transfer between two shaped namespaces (should be close to `rate`)."""
    with shaped_star(2, rate=rate) as (a, b):
        seconds = socket_seconds(
            nbytes, host=b.address, receiver_prefix=b.prefix, sender_prefixes=[a.prefix], timeout=120
        )
    return {"rate": rate, "bytes": nbytes, "seconds": seconds, "mbit_s": nbytes * 8 / seconds / 1e6}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="internal: one end of a timed TCP transfer (used by scripts.bench)")
    sub = p.add_subparsers(dest="role", required=True)
    r = sub.add_parser("recv", help="receive")
    r.add_argument("host", help="address to listen on")
    r.add_argument("streams", type=int, help="number of sender connections")
    r.add_argument("nbytes", type=int, help="total bytes to receive")
    r.add_argument("--keep", action="store_true", help="land the bytes in one fresh buffer of nbytes")
    s = sub.add_parser("send", help="send")
    s.add_argument("host", help="receiver address")
    s.add_argument("port", type=int, help="receiver port")
    s.add_argument("nbytes", type=int, help="bytes to send")
    args = p.parse_args(argv)
    if args.role == "recv":
        _receiver(args.host, args.streams, args.nbytes, args.keep)
    else:
        _sender(args.host, args.port, args.nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
