"""A well-formed peer record for tests of the rules that read records; pass the fields a test is about."""
from __future__ import annotations

from swarmloco.protocol.base.records import PROTOCOL_VERSION, PeerRecord

H1, H2 = "1" * 64, "2" * 64


def rec(**changes: object) -> PeerRecord:
    base: dict[str, object] = dict(version=PROTOCOL_VERSION, fingerprint="fp", config_json='{"d_model": 128}', round=3,
                                   state_hash=H1, work=0, ready=False, view=0, eta=0.0, updated=1.0)
    base.update(changes)
    return PeerRecord(**base)  # type: ignore[arg-type]
