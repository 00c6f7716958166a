"""peer/bootstrap.py: waiting for the coordinator's ready file, and the compose replica's shard from reverse DNS."""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from _fake_dns import FakeDNS

from swarmloco.peer.bootstrap import (
    BootstrapError,
    bootstrap_maddrs,
    nameserver,
    parse_ptr_reply,
    ptr_query,
    replica_number,
    replica_shard,
    resolve,
    wait_for_dht_peer,
)
from swarmloco.peer.config import BootstrapConfig, ConfigError, PeerConfig, RunConfig
from swarmloco.protocol.network.config import NetworkConfig

PEER_ID = "12D3KooWGjEaPBd3sRZdsyrNpvWDRFHdR3QX4cRAdWyTspxw87Yb"
pytestmark = pytest.mark.timeout(60)


def ready(path: Path, peer_id: str | None = PEER_ID) -> None:
    """What `swarmloco coordinator --ready-file` writes (coordinator/server.py: info()), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"url": "http://127.0.0.1:8000", "run_id": "compose", "dht_peer_id": peer_id,
                               "dht_maddrs": [f"/ip4/172.18.0.2/tcp/31337/p2p/{peer_id}"] if peer_id else []}))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ ready file
def test_ready_file_written_late_is_picked_up(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.json"
    path.write_text("{not json yet")  # a torn or foreign file is not an answer
    timer = threading.Timer(0.4, ready, (path, None))  # first without a DHT node, as with --no-dht
    timer2 = threading.Timer(0.9, ready, (path,))
    timer.start()
    timer2.start()
    started = time.monotonic()
    info = wait_for_dht_peer(path, 20, poll_s=0.05)
    assert info["dht_peer_id"] == PEER_ID
    assert 0.8 < time.monotonic() - started < 5


def test_ready_file_that_never_appears_fails_within_the_wait(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.json"
    started = time.monotonic()
    with pytest.raises(BootstrapError) as info:
        wait_for_dht_peer(path, 0.5, poll_s=0.05)
    assert 0.5 <= time.monotonic() - started < 3
    assert str(info.value) == f"no dht_peer_id in {path} after 0.5 s: is the coordinator up, with its DHT node?"
    assert isinstance(info.value, ConfigError)  # the CLI prints it as one line and exits 2


def test_maddrs_by_host_name_ip_or_from_the_file(tmp_path: Path) -> None:
    info = {"dht_peer_id": PEER_ID, "dht_maddrs": [f"/ip4/172.18.0.2/tcp/31337/p2p/{PEER_ID}", "junk"]}
    assert bootstrap_maddrs(info, BootstrapConfig(host="coordinator", port=4001)) == (
        f"/dns4/coordinator/tcp/4001/p2p/{PEER_ID}",)
    assert bootstrap_maddrs(info, BootstrapConfig(host="10.0.0.5")) == (f"/ip4/10.0.0.5/tcp/31337/p2p/{PEER_ID}",)
    assert bootstrap_maddrs(info, BootstrapConfig(host="::1")) == (f"/ip6/::1/tcp/31337/p2p/{PEER_ID}",)
    assert bootstrap_maddrs(info, BootstrapConfig()) == (f"/ip4/172.18.0.2/tcp/31337/p2p/{PEER_ID}",)
    with pytest.raises(BootstrapError, match="names no dht_maddrs"):
        bootstrap_maddrs({"dht_peer_id": PEER_ID, "dht_maddrs": []}, BootstrapConfig(file="c.json"))


# ------------------------------------------------------------------------------------------------ reverse DNS
@pytest.mark.parametrize(("name", "number"), [
    ("swarmloco-peer-3.swarmloco_default", 3), ("swarmloco_peer_12", 12), ("swarmloco-peer-gpu-1.", 1),
    ("peer-4.net-7", 4), ("abc123.net-7", None), ("", None), ("swarmloco-peer", None)])
def test_replica_number_comes_from_the_host_label(name: str, number: int | None) -> None:
    assert replica_number(name) == number


def test_ptr_query_asks_for_the_reversed_address() -> None:
    query = ptr_query("172.18.0.5", 0x1234)
    assert query[:2] == b"\x12\x34"
    assert b"\x015\x010\x0218\x03172\x07in-addr\x04arpa\x00" in query
    assert query.endswith(struct.pack(">2H", 12, 1))


def test_fake_dns_answer_gives_the_replica_shard() -> None:
    with FakeDNS("swarmloco-peer-3.swarmloco_default") as dns:
        assert replica_shard(8, server=dns.address, ip="172.18.0.5") == 2
        assert b"\x015\x010\x0218\x03172\x07in-addr" in dns.questions[0]


def test_more_replicas_than_shards_wrap_around(caplog: pytest.LogCaptureFixture) -> None:
    with FakeDNS("swarmloco-peer-11.swarmloco_default") as dns, caplog.at_level(logging.WARNING):
        assert replica_shard(4, server=dns.address, ip="172.18.0.9") == 2
    assert "shares shard 2 with replica 3" in caplog.text


def test_no_answer_picks_a_random_shard_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with FakeDNS(None) as dns, caplog.at_level(logging.WARNING):
        shards = {replica_shard(4, server=dns.address, ip="172.18.0.9") for _ in range(40)}
    assert shards <= {0, 1, 2, 3} and len(shards) > 1
    assert "random shard" in caplog.text and "no answer" in caplog.text


def test_unreachable_dns_server_is_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()
    with caplog.at_level(logging.WARNING):
        assert 0 <= replica_shard(3, server=closed, ip="172.18.0.9") < 3
    assert "random shard" in caplog.text


def test_bad_replies_are_no_answer() -> None:
    query = ptr_query("10.0.0.1", 7)
    rdata = b"\x06peer-2\x00"
    good = struct.pack(">6H", 7, 0x8180, 1, 1, 0, 0) + query[12:] + struct.pack(">HHHIH", 0xC00C, 12, 1, 60, 8) + rdata
    assert parse_ptr_reply(good, 7) == "peer-2"
    assert parse_ptr_reply(good, 8) is None  # not the reply to our query
    assert parse_ptr_reply(good[:-5], 7) is None  # truncated
    assert parse_ptr_reply(good[:3] + b"\x83" + good[4:], 7) is None  # NXDOMAIN
    loop = struct.pack(">6H", 7, 0x8180, 0, 1, 0, 0) + b"\xc0\x0c"  # a name that points at itself
    assert parse_ptr_reply(loop, 7) is None


def test_nameserver_from_resolv_conf(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# Docker\nsearch example\nnameserver 127.0.0.11\nnameserver 8.8.8.8\noptions ndots:0\n")
    assert nameserver(conf) == ("127.0.0.11", 53)
    conf.write_text("search example\n")
    assert nameserver(conf) is None
    assert nameserver(tmp_path / "missing") is None


# ------------------------------------------------------------------------------------------------ resolve
def test_resolve_fills_in_the_bootstrap_peer_and_the_shard(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.json"
    ready(path)
    cfg = PeerConfig(run=RunConfig(shard_index=None, num_shards=8),
                     bootstrap=BootstrapConfig(file=str(path), host="coordinator", wait_s=5))
    with FakeDNS("swarmloco-peer-6.swarmloco_default") as dns:
        out = resolve(cfg, dns_server=dns.address, ip="172.18.0.7")
    assert out.network.initial_peers == (f"/dns4/coordinator/tcp/31337/p2p/{PEER_ID}",)
    assert (out.run.shard_index, out.run.num_shards) == (5, 8)
    assert out.train == cfg.train and out.bootstrap == cfg.bootstrap


def test_resolve_skips_the_ready_file_when_it_is_not_needed(tmp_path: Path) -> None:
    missing = BootstrapConfig(file=str(tmp_path / "never.json"), wait_s=0)
    given = PeerConfig(network=NetworkConfig(initial_peers=(f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER_ID}",)),
                       bootstrap=missing)
    assert resolve(given) == given  # joining another swarm
    solo = PeerConfig(run=RunConfig(solo=True), bootstrap=missing)
    assert resolve(solo) == solo  # no network at all
    with pytest.raises(BootstrapError):
        resolve(replace(given, network=NetworkConfig()))  # the same config, now needing the file
