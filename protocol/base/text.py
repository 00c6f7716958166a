"""How peer ids, state hashes and other peers' words appear in our logs and messages: short, and bounded.

A libp2p peer id of an Ed25519 key starts with the same multihash prefix for every peer ("12D3KooW"), so its tail is
what tells two peers apart. Reasons often carry text a stranger chose (a refusal, an abort message): they are cut
to a bound before we log, store or forward them.
"""
from __future__ import annotations

PEER_CHARS = 8  # the tail of a peer id: enough to tell the peers of a swarm apart in a log
HASH_CHARS = 12  # the head of a hex state hash
REASON_CHARS = 300  # one reason, as we log it, keep it or send it on


def short_id(peer_id: str) -> str:
    """A peer id as logs and messages show it."""
    return peer_id[-PEER_CHARS:]


def short_hash(state_hash: str) -> str:
    """A state hash as logs and messages show it."""
    return state_hash[:HASH_CHARS]


def bounded(text: str, limit: int = REASON_CHARS) -> str:
    """`text` cut to at most `limit` characters, marked with an ellipsis where it was cut."""
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "…"
