"""One forged record in a DHT reply must not hide the valid records beside it.

A stock hivemind node validates nothing: a stranger stores a forged record there under any peer's subkey, and
hivemind's reader dropped that node's whole reply, every honest record in it too. These run two real DHT nodes on
127.0.0.1: a stock one that holds the run's records (a public bootstrap node, say) and a peer's validating one."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmloco.protocol.base.records import PeerRecord, peers_key
from swarmloco.protocol.network import dht_host  # noqa: F401  (installs the per-entry check)
from swarmloco.protocol.network.dht_entries import ALL_OR_NOTHING, valid_entries_only
from swarmloco.protocol.trust.identity import Identity
from swarmloco.protocol.trust.signed_records import RunValidator, key_id, seal

RUN = "run-entries"
HONEST = Identity(path=Path("<memory>"), private_key=Identity.generate())
ATTACKER = Identity(path=Path("<memory>"), private_key=Identity.generate())
VICTIM = Identity(path=Path("<memory>"), private_key=Identity.generate())
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _entries() -> list[tuple[str, dict[str, Any], float]]:
    """(subkey, envelope, expiry): an honest peer's record, and a forgery under another peer's subkey that outlives
    anything its owner could store (an hour: a stock node keeps it)."""
    now = get_dht_time()
    record = PeerRecord.announce(fingerprint="fp", config_json="{}", round=3, state_hash="a" * 64, work=30)
    forged = PeerRecord.announce(fingerprint="fp", config_json="{}", round=1001, state_hash="1" * 64, work=10**12)
    return [(HONEST.peer_id, seal(HONEST, RUN, record, "", now + 60), now + 60),
            (VICTIM.peer_id, seal(ATTACKER, RUN, forged, "", now + 3600), now + 3600)]


def test_every_dht_node_checks_a_dictionary_entry_by_entry() -> None:
    """The replaced method is still the one hivemind calls on a lookup's reply and on a dictionary store: a
    hivemind upgrade that renames or stops calling it fails here, not silently."""
    assert DHTProtocol._validate_dictionary is valid_entries_only
    for method in (DHTProtocol.call_find, DHTProtocol.rpc_store):
        assert "self._validate_dictionary(" in inspect.getsource(method)
    assert list(inspect.signature(ALL_OR_NOTHING).parameters) == ["self", "key_bytes", "dictionary"]


def test_an_invalid_entry_is_dropped_and_the_valid_ones_are_kept() -> None:
    protocol = SimpleNamespace(record_validator=RunValidator(RUN, None), serializer=MSGPackSerializer)
    dictionary = DictionaryDHTValue()
    for subkey, envelope, expires in _entries():
        dictionary.store(subkey, MSGPackSerializer.dumps(envelope), expires)
    key = key_id(peers_key(RUN))
    assert not ALL_OR_NOTHING(protocol, key, dictionary)  # hivemind's check: the whole reply is invalid
    assert valid_entries_only(protocol, key, dictionary)  # type: ignore[arg-type]
    assert sorted(subkey for subkey, _ in dictionary.items()) == [HONEST.peer_id]
    forged_only = DictionaryDHTValue()
    subkey, envelope, expires = _entries()[1]
    forged_only.store(subkey, MSGPackSerializer.dumps(envelope), expires)
    assert not valid_entries_only(protocol, key, forged_only)  # type: ignore[arg-type]  # nothing valid: no reply


async def _read_through_a_stock_node() -> dict[str, Any] | None:
    """The honest record and the forgery sit on a stock node only; a validating peer reads the run's records."""
    stock = await DHTNode.create(host_maddrs=LOOPBACK)
    reader = None
    try:
        for subkey, envelope, expires in _entries():
            assert stock.protocol.storage.store_subkey(DHTID.generate(peers_key(RUN)), subkey,
                                                       MSGPackSerializer.dumps(envelope), expires)
        reader = await DHTNode.create(host_maddrs=LOOPBACK, initial_peers=await stock.get_visible_maddrs(),
                                      record_validator=CompositeValidator([RunValidator(RUN, None)]))
        found = await reader.get(peers_key(RUN), latest=True)
        return None if found is None else {k: v.value for k, v in found.value.items()}
    finally:
        for node in (reader, stock):
            if node is not None:
                await node.shutdown()


@pytest.mark.parametrize("check", [valid_entries_only, ALL_OR_NOTHING], ids=["per-entry", "hivemind-all-or-nothing"])
def test_a_forged_record_on_a_stock_node_hides_no_honest_record(check: Callable[..., bool],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DHTProtocol, "_validate_dictionary", check)
    seen = asyncio.run(asyncio.wait_for(_read_through_a_stock_node(), 60))
    if check is ALL_OR_NOTHING:  # the attack as it was: the honest peer's record is gone with the forgery
        assert seen is None
    else:
        assert seen is not None and set(seen) == {HONEST.peer_id}
