"""Fault injection for multi-process tests: faults keyed by (phase, round), counted when they fire.

A peer process started with `SWARMLOCO_FAULTS` (a comma-separated list of `phase=action[@round]`; round omitted:
the first time the phase is reached) runs with a `FaultInjector` as its hooks. Phases and actions:
    inner_step=kill            SIGKILL this peer's whole session (peer, DHT process, p2pd) during inner steps
    member_after_send=kill     die after sending the contribution, before the result arrives
    leader_before_commit=kill  die as leader after averaging, before anyone got the result
    contribute=nan|huge|wrong_numel|inflate|zero_tokens   send a malformed contribution (as a member); huge: every
        value finite but 1e20, so that its float32 norm overflows
    contribute=negate1000|random1000   poison: Δ × −1000, or a random Δ 1000× as long, claiming 1000× the tokens
    contribute=freeride|freeride_noise  a free rider: a zero Δ, or a random Δ as long as the honest one, claiming
                               1000× the tokens
    reduce=flip|noise1000      as a reducer, sign and send −(the true shard), or random noise 1000× as long
    reduce=equivocate          as a reducer, send every other member a different (signed) shard than the rest
    reduce=withhold            as a reducer, send nobody its reduced shard
    exchange=stall             sit 8 s on the first part of a round before sending anything (longer than the
                               grace a test's round gives a straggler; shorter than its transfer deadline)
    exchange=stall30           the same for 30 s: past the grace of any round with the default control deadline,
                               on a machine however busy (a slow-drip member)
    serve_state=corrupt        serve random bytes to state downloaders (a lying donor)
    serve_session=busy         answer the first state download "busy" (a loaded donor; the joiner asks again later)
    lead=hold                  as a view's leader, accept every member and never close the group
A round of `*` arms the fault for every round.
Every firing is appended to `fired` and reported through `on_fire` before the action happens.
"""
from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarmloco.protocol.base.hooks import Hooks

logger = logging.getLogger(__name__)
ENV = "SWARMLOCO_FAULTS"
FREE_RIDES = ("freeride", "freeride_noise")
PHASES = {"inner_step", "member_after_send", "leader_before_commit", "contribute", "reduce", "exchange",
          "serve_state", "serve_session", "lead"}
ACTIONS = {"kill", "nan", "huge", "wrong_numel", "inflate", "zero_tokens", "corrupt", "negate1000", "random1000",
           "flip", "noise1000", "equivocate", "withhold", "stall", "stall30", "hold", "busy", "freeride",
           "freeride_noise"}
EVERY = -1  # the round of a fault armed for every round


@dataclass
class Fault:
    phase: str
    action: str
    round: int | None
    fired: int = 0


@dataclass
class FaultInjector(Hooks):
    faults: list[Fault] = field(default_factory=list)
    fired: list[tuple[str, str, int]] = field(default_factory=list)
    on_fire: Callable[[str, str, int], None] | None = None
    kill: Callable[[], None] = field(default=lambda: die())  # tests of the injector itself replace it

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        faults = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            phase, _, rest = item.partition("=")
            action, _, round_text = rest.partition("@")
            if phase not in PHASES or action not in ACTIONS:
                raise ValueError(f"{ENV}: got {item!r}, allowed phase=action[@round] with phases {sorted(PHASES)}, "
                                 f"actions {sorted(ACTIONS)}")
            every = round_text == "*"
            faults.append(Fault(phase, action, EVERY if every else int(round_text) if round_text else None))
        return cls(faults)

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls.parse(os.environ.get(ENV, ""))

    def match(self, phase: str, round_number: int) -> str | None:
        """The action to take now, if a fault is armed for (phase, round); each fault fires once."""
        for fault in self.faults:
            if fault.phase != phase:
                continue
            if fault.round == EVERY or (not fault.fired and fault.round in (None, round_number)):
                fault.fired += 1
                self.fired.append((phase, fault.action, round_number))
                logger.warning("fault injected: %s=%s at round %d", phase, fault.action, round_number)
                if self.on_fire is not None:
                    self.on_fire(phase, fault.action, round_number)
                return fault.action
        return None

    def _hit(self, phase: str, round_number: int) -> None:
        if self.match(phase, round_number) == "kill":
            self.kill()

    # --- the hooks ------------------------------------------------------------------------------------------------
    def observe(self, report: Callable[[str, str, int], None]) -> None:
        self.on_fire = report

    def inner_step(self, round_number: int) -> None:
        self._hit("inner_step", round_number)

    def after_send(self, round_number: int) -> None:
        self._hit("member_after_send", round_number)

    def before_commit(self, round_number: int) -> None:
        self._hit("leader_before_commit", round_number)

    def contribution(self, round_number: int, delta: torch.Tensor, tokens: int, *,
                     leader: bool = False) -> tuple[torch.Tensor, int]:
        # A free rider rides in every round, those it leads too; the other contribution faults act as a member only.
        if leader and not any(f.phase == "contribute" and f.action in FREE_RIDES for f in self.faults):
            return delta, tokens
        action = self.match("contribute", round_number)
        if action == "nan":
            delta = delta.clone()
            delta[len(delta) // 2] = float("nan")
        elif action == "huge":
            delta = torch.full_like(delta, 1e20)
        elif action == "wrong_numel":
            delta = delta[:-1].clone()
        elif action == "inflate":
            tokens = 10**12
        elif action == "zero_tokens":
            tokens = 0
        elif action == "negate1000":
            delta, tokens = delta * -1000.0, tokens * 1000
        elif action == "random1000":
            noise = torch.randn(delta.shape, generator=torch.Generator().manual_seed(round_number))
            delta = noise * (1000.0 * float(delta.norm()) / max(float(noise.norm()), 1e-30))
            tokens *= 1000
        elif action in FREE_RIDES:
            noise = torch.randn(delta.shape, generator=torch.Generator().manual_seed(round_number))
            scale = float(delta.norm()) / max(float(noise.norm()), 1e-30) if action == "freeride_noise" else 0.0
            delta, tokens = noise * scale, tokens * 1000
        return delta, tokens

    def hold_group(self, round_number: int) -> bool:  # asked on every poll: fires once per round it holds
        if getattr(self, "_held_round", None) == round_number:
            return True
        if self.match("lead", round_number) != "hold":
            return False
        self._held_round = round_number
        return True

    def send_delay(self, round_number: int) -> float:
        if getattr(self, "_stalled_round", None) == round_number:
            return 0.0
        action = self.match("exchange", round_number)
        if action not in ("stall", "stall30"):
            return 0.0
        self._stalled_round = round_number
        return 30.0 if action == "stall30" else 8.0

    def reduced_shard(self, round_number: int, shard: int, reduced: torch.Tensor) -> torch.Tensor:
        action = self.match("reduce", round_number)
        self._equivocating, self._recipients = action == "equivocate", 0
        self._withholding = action == "withhold"
        if action == "flip":
            return -reduced
        if action == "noise1000":
            noise = torch.randn(reduced.shape, generator=torch.Generator().manual_seed(round_number))
            return noise * (1000.0 * max(float(reduced.norm()), 1e-6) / max(float(noise.norm()), 1e-30))
        return reduced

    def shard_result(self, round_number: int, shard: int, peer: str, reduced: torch.Tensor) -> torch.Tensor | None:
        # every second recipient gets a different shard, each properly signed (so with two or more recipients,
        # some hold the true one and some the variant)
        if getattr(self, "_withholding", False):
            return None
        if not getattr(self, "_equivocating", False):
            return reduced
        self._recipients += 1
        return reduced * 0.5 if self._recipients % 2 == 0 else reduced

    def refuse_download(self) -> bool:
        return self.match("serve_session", 0) == "busy"

    def served_state(self, blob: bytes) -> bytes:
        # Armed once, then every download is served corrupt: a donor that lies consistently.
        if any(f.phase == "serve_state" and f.action == "corrupt" and f.fired for f in self.faults) or \
                self.match("serve_state", 0) == "corrupt":
            return corrupt(blob)
        return blob


def die() -> None:
    """Simulate the machine vanishing: SIGKILL our session if we lead one (peer + DHT + p2pd), else ourselves."""
    pid = os.getpid()
    if os.getpgid(0) == pid and os.getsid(0) == pid:
        os.killpg(pid, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)


def corrupt(blob: bytes) -> bytes:
    g = torch.Generator().manual_seed(len(blob))
    return torch.randint(0, 256, (len(blob),), dtype=torch.uint8, generator=g).numpy().tobytes()
