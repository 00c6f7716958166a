"""A DHT reply that holds one invalid entry still gives the valid ones.

hivemind validates a dictionary value (the run's peer records: one subkey per peer) all or nothing: when a node's
reply to a lookup, or a store request, holds one entry that fails the record validator, the whole reply is dropped.
A DHT node that validates nothing (a stock hivemind node: a public bootstrap node, a stranger's) keeps whatever it is
sent, so one forged record stored there made every record it holds invisible to every reader that asked it, the
honest ones included; where that node was the one holding the key (a small run, a run whose bootstrap node stores
data), honest peers stopped seeing each other. `keep_valid_entries` makes the check per entry: the invalid ones are
dropped and the rest of the reply counts, merged with what other nodes answered (per entry, newest valid expiry).

It replaces `DHTProtocol._validate_dictionary`, a private method of the pinned hivemind release, for every DHT node
of the process once `swarmloco.protocol.network.dht_host` is imported (a forked `hivemind.DHT` child inherits it);
tests/unit/test_dht_entries.py fails if a hivemind upgrade changes what it replaces.
"""
from __future__ import annotations

import logging

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord

__all__ = ["ALL_OR_NOTHING", "keep_valid_entries", "valid_entries_only"]
logger = logging.getLogger(__name__)
ALL_OR_NOTHING = DHTProtocol._validate_dictionary  # hivemind's own check, before `keep_valid_entries` replaces it


def valid_entries_only(protocol: DHTProtocol, key_bytes: bytes, dictionary: DictionaryDHTValue) -> bool:
    """Drop from `dictionary` every entry `protocol`'s validator refuses; False only when it refused them all (the
    reply then counts as nothing, and a store of it as refused, as before)."""
    validator = protocol.record_validator
    if validator is None:
        return True
    with dictionary.freeze():  # expired entries are still iterated, and judged, as hivemind's own check does
        entries = list(dictionary.items())
    refused = [subkey for subkey, (value, expiration) in entries
               if not validator.validate(DHTRecord(key_bytes, protocol.serializer.dumps(subkey), value, expiration))]
    for subkey in refused:
        del dictionary[subkey]
    if refused:
        logger.debug("dropped %d invalid entr%s of a DHT dictionary", len(refused), "y" if len(refused) == 1 else "ies")
    return len(refused) < len(entries) or not entries


def keep_valid_entries() -> None:
    """Install `valid_entries_only` as every DHT node's dictionary check (idempotent)."""
    DHTProtocol._validate_dictionary = valid_entries_only  # type: ignore[method-assign]
