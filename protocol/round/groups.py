"""What matchmaking produces and decides without a network: the closed group, a leader's answer to a join, and the
plain state of a leader's open group."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from swarmloco.protocol.base import swarmloco_wire_pb2 as pb
from swarmloco.protocol.base.records import PROTOCOL_VERSION, describe_difference
from swarmloco.protocol.round.config import LocalModel
from swarmloco.protocol.round.exchange import Link

MAX_REFUSAL_CONFIG = 8192  # bytes of a refused peer's config we are willing to parse to name the difference


class RoundAborted(RuntimeError):
    """The round was discarded; nothing was applied. The message says why; `blame` names the peer whose failure
    ended it, when one did (a member skips a leader it blames for the next rounds); `cheaters` the peers proven to
    have cheated, with the evidence in words (they are banned for the run)."""

    def __init__(self, message: str, *, blame: str = "", cheaters: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.blame = blame
        self.cheaters = dict(cheaters or {})


@dataclass
class Group:
    """A closed group. `links` are the peers this peer exchanges with: a leader's members, or a member's leader."""

    round: int
    me: str
    leader: str
    members: list[str]  # everyone in the group, leader first
    links: dict[str, Link]
    release: asyncio.Future[None] | None = None  # leader: resolved once the exchange is over (join handlers then end)
    swarm: int = 1  # active peers the group is a majority of (the leader's count, checked by every member)
    view: int = 0  # the view of the round's schedule the group formed in
    tickets: dict[str, bytes] = field(default_factory=dict)  # leader: each member's ticket, for the certificate
    # leader: how far the round got, so that an abort is the message members wait for (a Plan, the Contributors,
    # or a Commit)
    stage: str = "closed"

    @property
    def is_leader(self) -> bool:
        return self.me == self.leader


def admit(
    req: pb.JoinRequest,
    *,
    run_id: str,
    model: LocalModel,
    state_hash: str,
    collecting_round: int | None,
    closed: bool,
    size: int,
    max_group: int,
    not_admitted: str = "",
) -> tuple[int, str]:
    """A leader's answer to a join request, with the reason a refused peer is shown (`not_admitted`: why its
    ticket is refused, "" when it is valid)."""
    if req.protocol_version != PROTOCOL_VERSION:
        return (
            pb.JoinReply.INCOMPATIBLE,
            f"protocol version differs: ours {PROTOCOL_VERSION}, yours {req.protocol_version}",
        )
    if req.run_id != run_id:
        return pb.JoinReply.INCOMPATIBLE, f"run id differs: ours {run_id!r}, yours {req.run_id!r}"
    if not_admitted:
        return pb.JoinReply.NOT_ADMITTED, f"not admitted to this run: {not_admitted}"
    if req.fingerprint != model.fingerprint:
        try:
            theirs = json.loads(req.task_config_json) if len(req.task_config_json) < MAX_REFUSAL_CONFIG else {}
        except json.JSONDecodeError:
            theirs = {}
        return pb.JoinReply.INCOMPATIBLE, "model differs: " + describe_difference(
            model.config, theirs if isinstance(theirs, dict) else {}
        )
    if collecting_round is None or collecting_round != req.round:
        return pb.JoinReply.NOT_LEADER, f"not collecting round {req.round}"
    if closed:
        return pb.JoinReply.ROUND_CLOSED, f"group for round {req.round} already closed"
    if req.state_hash != state_hash:
        return pb.JoinReply.WRONG_STATE, f"state hash differs at round {req.round}: re-sync"
    if size + 1 >= max_group:
        return pb.JoinReply.FULL, f"group is full ({max_group})"
    return pb.JoinReply.ACCEPTED, ""


@dataclass(frozen=True)
class Declined:
    """A join that did not get us into a group, and why (we try again within the view, or follow the next one)."""

    reason: str


@dataclass
class Collecting:
    """A leader's open group for one view: members that joined, and what their join handlers wait on."""

    round: int
    view: int = 0
    members: dict[str, Link] = field(default_factory=dict)
    tickets: dict[str, bytes] = field(default_factory=dict)
    closed: bool = False
    quorum_at: float | None = None  # when the group first reached the size it needs (monotonic)
    seen_ready: dict[str, float] = field(default_factory=dict)  # peers first seen ready in our view (monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
