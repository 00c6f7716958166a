"""What a round's signatures cover: the canonical bytes of a claim, a part, a result and the audit messages.

Every payload a member sends in a round is signed by its sender over a digest bound to the run, the round and the
plan (the plan's own digest names the group: its members, weights and endpoints), so a part or a result cannot be
altered on the path, replayed into another round or another group, or denied later: a signed result that
contradicts the signed parts it was computed from is evidence anyone can check.

Bodies are length-prefixed fields after a per-kind domain tag, so no two different field lists share bytes.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from blake3 import blake3

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.trust.identity import Identity, verify

_DOMAIN = b"swarmloco-round-v4\n"
NONCE_BYTES = 32
DIGEST_BYTES = 32


def digest(payload: bytes | bytearray | memoryview) -> bytes:
    """The digest a part, a result or audit evidence is signed over: BLAKE3, 32 bytes. Every member hashes about
    2.5 × the vector per round (its parts and result out, the parts and results it receives); sha256 made that the
    largest CPU cost of a 4-peer round after the audit, BLAKE3 runs about 4× faster and releases the GIL."""
    return blake3(payload).digest()


def _body(kind: str, *fields: bytes | str | int | float | Sequence[float] | Sequence[str]) -> bytes:
    out = [_DOMAIN, kind.encode(), b"\n"]
    for f in fields:
        if isinstance(f, bytes):
            raw = f
        elif isinstance(f, str):
            raw = f.encode()
        elif isinstance(f, bool | int):
            raw = str(int(f)).encode()
        elif isinstance(f, float):
            raw = struct.pack("<d", f)
        elif all(isinstance(x, str) for x in f):
            raw = b"".join(struct.pack("<I", len(x.encode())) + x.encode() for x in f)  # type: ignore[union-attr]
        else:
            raw = struct.pack(f"<{len(f)}d", *f)
        out.append(struct.pack("<Q", len(raw)) + raw)
    return b"".join(out)


def claim_body(run_id: str, c: pb.ContributionClaim) -> bytes:
    return _body("claim", run_id, c.round, c.prev_hash, c.leader, c.tokens, c.codec, c.numel, c.base_round,
                 c.base_hash, list(c.data_addrs), c.data_token, float(c.bandwidth), c.audit_commit, c.dials_out)


def plan_digest(plan: pb.Plan) -> bytes:
    """The plan as every member received it, its signature left out: equal digests mean equal plans (an
    equivocating leader's two plans yield parts signed over different digests, which the other members refuse)."""
    unsigned = pb.Plan()
    unsigned.CopyFrom(plan)
    unsigned.ClearField("signature")
    return hashlib.sha256(unsigned.SerializeToString(deterministic=True)).digest()


def plan_body(run_id: str, round_number: int, plan: bytes) -> bytes:
    return _body("plan", run_id, round_number, plan)


def part_body(run_id: str, round_number: int, plan: bytes, shard: int, sender: str, payload_digest: bytes) -> bytes:
    return _body("part", run_id, round_number, plan, shard, sender, payload_digest)


def result_body(run_id: str, plan: bytes, reducer: str, r: pb.ShardResult) -> bytes:
    """What a reducer signs: the digest of its result's header, so that the pair (digest, signature) alone, 96
    bytes, is what members compare in the audit."""
    return _body("result", hashlib.sha256(result_fields(run_id, plan, reducer, r)).digest())


def result_fields(run_id: str, plan: bytes, reducer: str, r: pb.ShardResult) -> bytes:
    return _body("result-fields", run_id, r.round, plan, r.shard, reducer, r.digest, list(r.members),
                 list(r.norms), list(r.coeffs), float(r.tau))


def signed_digest(body: bytes) -> bytes:
    """The digest inside a `result_body` (what it commits to)."""
    return body[-DIGEST_BYTES:]


def result_body_of(fields_digest: bytes) -> bytes:
    """The `result_body` that commits to `fields_digest`."""
    return _body("result", fields_digest)


def sketch_body(run_id: str, plan: bytes, sender: str, s: pb.AuditSketch) -> bytes:
    return _body("sketch", run_id, s.round, plan, sender, list(s.sketches))


def verdict_body(run_id: str, plan: bytes, reducer: str, v: pb.AuditVerdict) -> bytes:
    return _body("verdict", run_id, v.round, plan, v.shard, reducer, v.accused, v.part_digest, v.part_signature)


def sign(identity: Identity, body: bytes) -> bytes:
    return identity.sign(body)


def signed(peer: str, body: bytes, signature: bytes) -> bool:
    """Whether `signature` is `peer`'s Ed25519 signature of `body` (the key is inlined in the peer id)."""
    return verify(peer, body, bytes(signature))


def commitment(nonce: bytes) -> str:
    return hashlib.sha256(b"swarmloco-audit-nonce\n" + nonce).hexdigest()
