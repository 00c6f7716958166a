"""What the coordinator does for `swarmloco doctor`. The dial-back (`GET /api/dialback`) connects only to the address
the request came from, to one port, with a timeout, at a bounded rate per address and a bounded number at once; the
link test (`/api/linktest`) moves a bounded number of bytes each way, under the same kind of bounds."""
from __future__ import annotations

import asyncio
import socket
import time
import zlib
from pathlib import Path

import requests
from _coordinator_helpers import start_server

from swarmloco.coordinator.connections import address_key
from swarmloco.coordinator.dialback import DialBack, DialBacker
from swarmloco.coordinator.linktest import MAX_BYTES, LinkTester


def _dial(backer: DialBacker, client: str, port: int) -> DialBack:
    return asyncio.run(backer.dial(client, port))


def test_it_reports_whether_the_askers_own_port_answers() -> None:
    backer = DialBacker(timeout_s=2.0)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        answer = _dial(backer, "127.0.0.1", port)
        assert answer.status == 200 and answer.body["reachable"] is True
        assert answer.body["address"] == f"127.0.0.1:{port}"
    closed = _dial(backer, "127.0.0.1", port)  # the listener is gone
    assert closed.status == 200 and closed.body["reachable"] is False and closed.body["error"]
    assert backer._in_flight == 0


def test_bad_ports_unknown_sources_floods_and_crowds_are_refused() -> None:
    """Only 127.0.0.1 is ever dialled here: the other addresses are refused before any connection is tried."""
    backer = DialBacker(rate_per_s=0.01, burst=2)
    assert _dial(backer, "127.0.0.1", 0).status == 400 and _dial(backer, "127.0.0.1", 65536).status == 400
    assert _dial(backer, "?", 80).status == 400
    statuses = [_dial(backer, "127.0.0.1", 9).status for _ in range(4)]
    assert statuses[:2] == [200, 200] and statuses[2:] == [429, 429]
    assert backer._limiter.allow("127.0.0.2", time.monotonic())  # the limit is per address ...
    for _ in range(2):  # ... and an IPv6 /64 is one address: spend its burst, then ask from another of its hosts
        assert backer._limiter.allow(address_key("2001:db8::1"), time.monotonic())
    assert _dial(backer, "2001:db8::2", 9).status == 429
    backer = DialBacker()
    backer._in_flight = backer.max_in_flight  # as many dials in progress as allowed: the next waits its turn
    assert _dial(backer, "127.0.0.1", 9).status == 429


def test_the_link_test_moves_what_it_says_within_its_bounds(tmp_path: Path) -> None:
    """`GET /api/linktest` sends BYTES of incompressible data, `POST` reads and times a body; both refuse sizes out of
    range and floods from one address, and a doctor's four tests fit one burst."""
    server = start_server(tmp_path / "db.sqlite")
    try:
        url = f"{server.url}/api/linktest"
        down = requests.get(url, params={"bytes": 3 << 20}, timeout=10)
        assert down.status_code == 200 and len(down.content) == 3 << 20
        assert len(zlib.compress(down.content[: 1 << 20])) > 0.99 * (1 << 20)  # nothing for a proxy to squeeze
        up = requests.post(url, data=bytes(5 << 20), timeout=10)
        assert up.status_code == 200 and up.json()["bytes"] == 5 << 20 and up.json()["seconds"] >= 0
        assert requests.get(url, params={"bytes": 0}, timeout=10).status_code == 400
        assert requests.get(url, params={"bytes": MAX_BYTES + 1}, timeout=10).status_code == 400
        assert requests.post(url, data=bytes(MAX_BYTES + 1), timeout=30).status_code == 413
        statuses = [requests.get(url, params={"bytes": 10}, timeout=10).status_code for _ in range(6)]
        assert 429 in statuses  # the burst (6 tests, 5 spent above) is gone: one address cannot stream forever
    finally:
        server.stop()


def test_link_test_slots_are_bounded_and_freed_however_a_test_ends() -> None:
    tester = LinkTester(rate_per_s=100, burst=100, max_in_flight=2, slot_ttl_s=0.2)
    (a, _, _), (b, _, _) = tester.admit("127.0.0.1", 10), tester.admit("127.0.0.2", 10)
    assert tester.admit("127.0.0.3", 10) == (-1, 429, "too many link tests in progress; retry in a few seconds")
    tester.done(a)
    slot, _, why = tester.admit("127.0.0.3", 10)
    assert why == "" and slot > b
    time.sleep(0.25)  # a slot whose response never ended (the client vanished before it began) expires
    assert tester.admit("127.0.0.4", 10)[2] == "" and tester.admit("127.0.0.5", 10)[2] == ""
