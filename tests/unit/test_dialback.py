"""The coordinator's dial-back (`GET /api/dialback`, for `swarmloco doctor`): it connects only to the address the
request came from, to one port, with a timeout, at a bounded rate per address."""
from __future__ import annotations

import socket

from swarmloco.coordinator.dialback import DialBacker


def test_it_reports_whether_the_askers_own_port_answers() -> None:
    backer = DialBacker(timeout_s=2.0)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        answer = backer.dial("127.0.0.1", port)
        assert answer.status == 200 and answer.body["reachable"] is True
        assert answer.body["address"] == f"127.0.0.1:{port}"
    closed = backer.dial("127.0.0.1", port)  # the listener is gone
    assert closed.status == 200 and closed.body["reachable"] is False and closed.body["error"]


def test_bad_ports_unknown_sources_and_floods_are_refused() -> None:
    backer = DialBacker(rate_per_s=0.01, burst=2)
    assert backer.dial("127.0.0.1", 0).status == 400 and backer.dial("127.0.0.1", 65536).status == 400
    assert backer.dial("?", 80).status == 400
    statuses = [backer.dial("127.0.0.1", 9).status for _ in range(4)]
    assert statuses[:2] == [200, 200] and statuses[2:] == [429, 429]
    assert backer.dial("127.0.0.2", 9).status == 200  # the limit is per address
