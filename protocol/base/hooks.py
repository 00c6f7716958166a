"""Points where a test harness may step into a peer's round; production code runs with the no-op `Hooks()`.

The fault injector that kills a peer mid-round or sends a malformed contribution (`swarmloco.protocol.testing.faults`)
subclasses this. Production modules only ever see this interface, never the injector, so no test behaviour can
be reached from a real run unless a harness passes one in.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


class Hooks:
    def observe(self, report: Callable[[str, str, int], None]) -> None:
        """Where to report (phase, action, round) each time the harness steps in; the no-op hooks never do."""
    def inner_step(self, round_number: int) -> None:
        """Before each inner training step."""

    def contribution(self, round_number: int, delta: torch.Tensor, tokens: int, *,
                     leader: bool = False) -> tuple[torch.Tensor, int]:
        """A member's pseudo-gradient and token count, just before they are encoded and sent (`leader`: the group's
        leader contributes too)."""
        return delta, tokens

    def after_send(self, round_number: int) -> None:
        """A member has sent its contribution and now waits for the result."""

    def before_commit(self, round_number: int) -> None:
        """The leader holds the average; nobody has the result yet."""

    def hold_group(self, round_number: int) -> bool:
        """As the view's leader: keep every member that joins and never close the group (a leader that stalls)."""
        return False

    def send_delay(self, round_number: int) -> float:
        """Seconds to sit on each part and each reduced shard before sending it (a member that stalls)."""
        return 0.0

    def reduced_shard(self, round_number: int, shard: int, reduced: torch.Tensor) -> torch.Tensor:
        """The shard this peer reduced, before it is signed and sent to every member."""
        return reduced

    def shard_result(self, round_number: int, shard: int, peer: str, reduced: torch.Tensor) -> torch.Tensor | None:
        """What this peer sends `peer` as its reduced shard (another tensor: a signed variant; None: nothing)."""
        return reduced

    def refuse_download(self) -> bool:
        """As a donor: answer this state download "busy", as a donor under load would."""
        return False

    def served_state(self, blob: bytes) -> bytes:
        """The state blob a donor is about to send to a downloader."""
        return blob
