"""Bridges a Replica's named tensors and the protocol's flat views: pseudo-gradients as one fp32 vector, the global
state as one blob for donors (layout in `swarmloco.protocol.base.hashing.pack_state`), re-basing local progress
onto a newer global state, and the certified head a (resumed) replica's state stands at."""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from swarmloco.peer.replica import Replica
from swarmloco.peer.run_model import fingerprint_config
from swarmloco.protocol.base.hashing import StateLayout, pack_state, state_hash, state_layout, unpack_state
from swarmloco.protocol.base.records import PeerRecord, fingerprint
from swarmloco.protocol.base.text import short_hash
from swarmloco.protocol.chain.chain import Chain
from swarmloco.protocol.chain.config import FetchConfig
from swarmloco.protocol.chain.forks import Behind
from swarmloco.protocol.chain.state_sync import StateSyncError, download_latest
from swarmloco.protocol.network.transport import Transport
from swarmloco.protocol.round.config import LocalModel
from swarmloco.protocol.trust.certificates import Certificate, Head

logger = logging.getLogger(__name__)
DOWNLOAD_TIMEOUT_S = 600.0


def local_model(replica: Replica, seed: int) -> LocalModel:
    config = fingerprint_config(replica.task.config, seed)  # as a coordinator computes it for the run's manifest
    layout = [(n, tuple(replica.global_params[n].shape)) for n in replica.names]
    numel = sum(replica.global_params[n].numel() for n in replica.names)
    return LocalModel(fingerprint=fingerprint(config, layout), config=config, numel=numel)


def genesis_hash(replica: Replica) -> str:
    """The hash of θ_0 (m_0 = 0) as every peer of the run computes it from the task and the seed, so the start
    of the chain needs nobody's word. Built twice: a task whose initial model is not a function of the seed could
    never average with anyone, which is better said at start than discovered as peers that never group."""
    hashes = set()
    for _ in range(2):
        model = replica.task.model_factory()
        params = {n: p.detach().to("cpu", torch.float32) for n, p in model.named_parameters()}
        hashes.add(state_hash(params, {n: torch.zeros_like(t) for n, t in params.items()}, replica.names))
    if len(hashes) != 1:
        raise ValueError("the task's model_factory builds a different model each time; seed it (torch.manual_seed) "
                         "so every peer starts from the same θ_0")
    return hashes.pop()


def all_finite(params: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in (*params.values(), *momentum.values()))


def flatten(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1).to(torch.float32) for n in names])


def unflatten(flat: torch.Tensor, like: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for n in names:
        numel = like[n].numel()
        out[n] = flat[offset : offset + numel].view_as(like[n]).clone()
        offset += numel
    if offset != flat.numel():
        raise ValueError(f"flat tensor has {flat.numel()} elements, model needs {offset}")
    return out


def _shapes(replica: Replica) -> dict[str, torch.Size]:
    return {n: replica.global_params[n].shape for n in replica.names}


def state_blob(replica: Replica) -> bytes:
    return pack_state(replica.global_params, replica.momentum, replica.names)


def parse_blob(
    blob: bytes | bytearray | memoryview, replica: Replica
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return unpack_state(blob, _shapes(replica), replica.names)


def layout_of(replica: Replica) -> StateLayout:
    """What a certified state hash of this model commits to besides its chunks (checked before any download)."""
    return state_layout(_shapes(replica), replica.names)


def progress_kept(target: Behind, *, round_number: int, state_hash: str, me: str, steps: int, staleness: int,
                  max_staleness: int) -> tuple[bool, bool]:
    """Whether a peer at (`round_number`, `state_hash`) that trained `steps` inner steps keeps its progress as a
    stale contribution (`staleness` rounds old once adopted) when it adopts `target`; and whether that progress is
    already merged in `target` (its certificate, one round on from our state, names us as a member: we voted but
    missed the certificate). A kept Δ is merged later only where the group knows its base, a certified state of
    their chain: a target at our round, or one round on but not from our state, is another fork, whose peers never
    held our state and would refuse the Δ in every round we offered it (a swarm healed from a split livelocked so)."""
    cert = target.certificate
    next_round = cert is not None and target.round == round_number + 1 and cert.statement.prev_hash == state_hash
    ours = next_round and cert is not None and me in cert.statement.members
    fork = target.round <= round_number + 1 and not next_round
    return steps > 0 and staleness <= max_staleness and not (ours or fork), ours


def distrust(node: Transport, chain: Chain, target: Behind, problem: str, *, timeout: float) -> list[str]:
    """Never adopt `target`, and distrust whoever claimed or signed it (on the node's loop, where the chain's tables
    live); returns those peers."""
    cert = target.certificate
    signers = set(cert.signatures) & set(cert.statement.members) if cert is not None else set()
    peers = sorted(set(target.donors) | signers)
    logger.error("not adopting round %d %s…: %s; distrusting its %d claimant(s) and signer(s)", target.round,
                 short_hash(target.state_hash), problem, len(peers))

    async def refuse() -> None:
        chain.refuse(target.round, target.state_hash, peers)

    node.call(refuse(), timeout=timeout)
    return peers


@torch.no_grad()
def rebase(
    replica: Replica,
    params: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor],
    round_number: int,
    *,
    keep_progress: bool,
) -> None:
    """Adopt a newer global state. With keep_progress, local ← θ_new − (θ_old − local): the local pseudo-gradient
    survives (it will be merged later as a stale contribution); otherwise local ← θ_new."""
    delta = replica.pseudo_gradient() if keep_progress else None
    round_steps, round_tokens = replica.round_steps, replica.round_tokens
    replica.load_global(params, momentum, round_number, keep_local=False)
    if delta is not None:
        for name, p in replica.model.named_parameters():
            p.copy_((replica.global_params[name] - delta[name]).to(p.device, p.dtype))
        replica.round_steps, replica.round_tokens = round_steps, round_tokens


def resumed_head(replica: Replica, resumed: dict[str, Any], *, genesis: str,
                 verify: Callable[[Certificate], str]) -> Head:
    """θ_0, or the certified state a resumed checkpoint holds (`resumed`: its sidecar, where a swarm peer keeps the
    certificate of its state). A checkpoint without a valid certificate for its state still trains, but nobody
    adopts its state until a round certifies one. `verify` says why a certificate proves nothing ("" if valid)."""
    if replica.round == 0:
        if replica.state_hash() != genesis:
            raise ValueError("the checkpoint at round 0 does not hold this run's θ_0 (another seed or task?)")
        return Head(0, genesis)
    raw = resumed.get("certificate")
    state_hash = replica.state_hash()
    if isinstance(raw, str):
        try:
            cert = Certificate.from_bytes(raw.encode())
        except ValueError:
            cert = None
        if cert is not None and (cert.statement.round, cert.statement.new_hash) == (replica.round, state_hash) and \
                not verify(cert):
            return Head.of(cert)
    logger.warning("the checkpoint's round %d has no valid certificate: training on, but no peer will adopt this "
                   "state, and any certified state of the swarm replaces it", replica.round)
    return Head(replica.round, state_hash, 0)  # no certified work: it never outranks a certified chain


def fetch_state(node: Transport, chain: Chain, target: Behind, replica: Replica, *, fingerprint: str,
                control_timeout_s: float, ticket: bytes) -> tuple[memoryview, list[str], Behind] | None:
    """Download the target's state from its donors, every chunk checked against the leaves its certified hash
    commits to; returns (blob, donors that failed or lied, the state downloaded), or None (logged) when no donor
    delivered in time. The state downloaded is a newer one than the target when the donors moved on to it since the
    target was chosen and `chain` takes it instead (`Chain.follows`)."""
    try:
        blob, bad, followed = node.call(
            download_latest(node, donors=target.donors, round_number=target.round, state_hash=target.state_hash,
                            layout=layout_of(replica), follow=lambda cert: chain.follows(cert, target),
                            fingerprint=fingerprint, config=FetchConfig(control_timeout_s=control_timeout_s),
                            ticket=ticket, timeout=DOWNLOAD_TIMEOUT_S - 5),
            timeout=DOWNLOAD_TIMEOUT_S,
        )
    except (StateSyncError, concurrent.futures.TimeoutError) as exc:
        logger.warning("re-sync to round %d failed: %s", target.round, exc)
        return None
    if followed is not None:
        s = followed.statement
        target = Behind(round=s.round, state_hash=s.new_hash, donors=target.donors, work=s.work, certificate=followed)
    return blob, bad, target


def linger_for_peers(seconds: float, *, round_: int, wanted: int, read: Callable[[], dict[str, PeerRecord]],
                     stop: threading.Event, poll_s: float = 1.0) -> None:
    """Keep serving our state (the caller's node stays up) for up to `seconds` after our last round, for peers that
    are still catching up.

    A peer told to wait for `wanted` peers (2 or more) at the start belongs to a swarm of known size: it leaves early
    once that many peers, itself included, are visible at its round or later and no compatible record is behind it.
    Otherwise (`wanted` < 2: a donor kept up for joiners that may come later) it stays the whole time. `read`
    returns the other peers' compatible records ({} when the read failed). Records are self-reported: a false one
    can at most keep us the full `seconds`, or make us leave early, as a crash would."""
    deadline = time.monotonic() + seconds
    while not stop.wait(max(0.0, min(poll_s, deadline - time.monotonic()))) and time.monotonic() < deadline:
        if wanted >= 2 and caught_up(read(), round_=round_, wanted=wanted):
            return


def caught_up(records: Mapping[str, PeerRecord], *, round_: int, wanted: int) -> bool:
    """Whether `wanted` peers (us included) are at round `round_` or later and none is behind it."""
    rounds = [r.round for r in records.values()]
    return all(r >= round_ for r in rounds) and 1 + len(rounds) >= wanted
