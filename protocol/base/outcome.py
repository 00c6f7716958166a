"""How a round ended for one peer: one vocabulary for logs, summaries, coordinator reports and the dashboard.

Kept in a module of its own, free of torch, because the coordinator validates reports against it."""
from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    COMMITTED = "committed"  # the average was applied and this peer holds the agreed θ_{r+1}
    DISCARDED = "discarded"  # the round was given up before anything was applied (no group, a lost leader, an abort)
    BEHIND = "behind"  # the swarm held a newer state: this peer fetched it instead of averaging
    MISMATCH = "mismatch"  # the average was applied but the result differs from the leader's: this peer re-syncs
