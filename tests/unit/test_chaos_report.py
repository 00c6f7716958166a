"""What a chaos run reads from its peers' events: when the swarm agrees, and on which state."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from swarmloco.chaos_report import agreement


def _peer(*events: dict[str, Any]) -> Any:
    return SimpleNamespace(events=list(events))


def _committed(rnd: int, state: str, t: float) -> dict[str, Any]:
    return {"event": "round", "outcome": "committed", "round": rnd, "state_hash": state, "time": t}


def test_peers_on_one_newest_state_after_the_last_fault_agree() -> None:
    live = {"a": _peer(_committed(1, "aa" * 8, 5.0), _committed(2, "bb" * 8, 12.0)),
            "b": _peer(_committed(2, "bb" * 8, 12.0)),
            "c": _peer({"event": "resync", "round": 2, "state_hash": "bb" * 8, "time": 13.0})}
    agreed = agreement(live, since=10.0)
    assert agreed is not None and set(agreed) == {"a", "b", "c"} and len(set(agreed.values())) == 1


def test_no_agreement_without_a_commit_after_the_last_fault() -> None:
    live = {"a": _peer(_committed(2, "bb" * 8, 8.0)), "b": _peer(_committed(2, "bb" * 8, 8.0))}
    assert agreement(live, since=10.0) is None


def test_no_agreement_while_one_peer_is_a_round_behind_or_has_no_state() -> None:
    behind = {"a": _peer(_committed(3, "cc" * 8, 12.0)), "b": _peer(_committed(2, "bb" * 8, 11.0))}
    assert agreement(behind, since=10.0) is None
    empty = {"a": _peer(_committed(3, "cc" * 8, 12.0)), "b": _peer()}
    assert agreement(empty, since=10.0) is None
