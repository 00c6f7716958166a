"""The coordinator's dial-back (`GET /api/dialback`, for `swarmloco doctor`): it connects only to the address the
request came from, to one port, with a timeout, at a bounded rate per address and a bounded number at once."""
from __future__ import annotations

import asyncio
import socket
import time

from swarmloco.coordinator.connections import address_key
from swarmloco.coordinator.dialback import DialBack, DialBacker


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
