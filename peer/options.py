"""The table of every `swarmloco peer` setting: its flag, its TOML section and key, its env var and its help.

It is plain data, kept apart from the dataclasses it fills (peer/config.py) so that one glance shows the whole
command line, and so that flags, TOML keys and SWARMLOCO_* variables cannot drift apart: all three are derived
from the same row.
"""
from __future__ import annotations

from dataclasses import dataclass

from swarmloco.peer.presets import PRESETS

ENV_PREFIX = "SWARMLOCO_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"  # the TOML file, like --config
# SWARMLOCO_* variables that are not peer settings but are read elsewhere; every other unknown one is a typo.
OTHER_ENV = frozenset({
    CONFIG_ENV,
    ENV_PREFIX + "FAULTS",  # fault injection for the multi-process tests (protocol/testing/faults.py)
    ENV_PREFIX + "UPDATE_SCREENSHOT",  # lets the dashboard browser test refresh docs/dashboard.png
})


@dataclass(frozen=True)
class Option:
    """One setting. `section` names a field of PeerConfig, `field` a field of that section's dataclass."""

    flag: str
    section: str
    field: str
    help: str
    repeat: bool = False  # list-valued: the flag may repeat; the env var is comma-separated
    auto: bool = False  # the word "auto" is accepted and stored as None (the value is decided at startup)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.lstrip("-").replace("-", "_").upper()

    @property
    def dest(self) -> str:
        return f"{self.section}__{self.field}"

    @property
    def label(self) -> str:
        """The name used in error messages: the flag's, which is what the user typed (inner_lr, not lr)."""
        return self.flag.lstrip("-").replace("-", "_")


OPTIONS: tuple[Option, ...] = (
    # [run]: what this peer process does and where it writes
    Option("--preset", "run", "preset", f"model size of the default task: {', '.join(PRESETS)}"),
    Option("--task", "run", "task", "custom task as 'package.module:factory' (see README)"),
    Option("--solo", "run", "solo", "train alone, without any network (M=1 DiLoCo)"),
    Option("--max-steps", "run", "max_steps", "stop after this many inner steps (0 = no limit)"),
    Option("--max-rounds", "run", "max_rounds", "stop after this many outer rounds (0 = no limit)"),
    Option("--shard-index", "run", "shard_index",
           "which data shard this peer reads; auto: replica n of a compose service reads shard (n-1) mod "
           "--num-shards (from the container's reverse-DNS name; a random shard when there is no answer)", auto=True),
    Option("--num-shards", "run", "num_shards", "how many disjoint data shards the corpus is split into"),
    Option("--workdir", "run", "workdir", "directory for checkpoints and logs"),
    Option("--resume", "run", "resume", "continue from the checkpoint in --workdir"),
    Option("--checkpoint-every", "run", "checkpoint_every", "write a checkpoint every N rounds (0 = at exit only)"),
    Option("--eval-every", "run", "eval_every", "evaluate the global model every N rounds"),
    Option("--summary-json", "run", "summary_json", "write a JSON summary of the run to this path at the end"),
    Option("--log-format", "run", "log_format", "progress output: text (live bar) or json (one object per line)"),
    Option("--slowdown", "run", "slowdown", "artificial slowdown factor (>=1) to emulate slower hardware"),
    Option("--linger", "run", "linger_s", "swarm: seconds to keep serving state after the last round (with "
           "--wait-for-peers N: until all N peers are at this round, at most this long)"),
    Option("--coordinator", "run", "coordinator", "coordinator URL to report progress to (optional)"),
    Option("--join", "run", "join", "join the run a coordinator URL, a manifest URL or a manifest file describes: "
           "it fixes the run id, authority, bootstrap addresses and the settings every peer shares"),
    Option("--wait-for-peers", "run", "wait_for_peers",
           "swarm: start training only once this many peers (us included) are up"),
    Option("--train-while-waiting", "run", "train_while_waiting",
           "swarm: keep training while the group forms (default on)"),
    # [train]: the inner optimiser
    Option("--inner-lr", "train", "lr", "inner AdamW learning rate"),
    Option("--weight-decay", "train", "weight_decay", "inner AdamW weight decay"),
    Option("--beta1", "train", "beta1", "inner AdamW beta1"),
    Option("--beta2", "train", "beta2", "inner AdamW beta2"),
    Option("--warmup-steps", "train", "warmup_steps", "linear learning-rate warm-up, in global inner steps"),
    Option("--decay-steps", "train", "decay_steps", "cosine decay length in global inner steps (0 = constant)"),
    Option("--min-lr-ratio", "train", "min_lr_ratio", "final learning rate as a fraction of the peak"),
    Option("--grad-clip", "train", "grad_clip", "gradient norm clipping (0 disables)"),
    Option("--batch-size", "train", "batch_size", "sequences per inner step (0 = the task's default)"),
    Option("--inner-steps", "train", "inner_steps", "H: inner steps per round (when no token/second budget is set)"),
    # [outer]: the outer optimiser
    Option("--outer-lr", "outer", "lr", "outer Nesterov learning rate"),
    Option("--outer-momentum", "outer", "momentum", "outer Nesterov momentum"),
    # [runtime]: the local machine
    Option("--device", "runtime", "device", "auto (CUDA if available), cpu, cuda or cuda:N"),
    Option("--threads", "runtime", "threads", "torch CPU threads (0 = torch's default)"),
    Option("--seed", "runtime", "seed", "seed for model init and data order (must match across the swarm)"),
    # [network]: how this peer reaches the swarm
    Option("--run-id", "network", "run_id", "name of the training run; all DHT keys live under it"),
    Option("--initial-peer", "network", "initial_peers", "multiaddr of a peer already in the swarm (repeatable)",
           repeat=True),
    Option("--host-maddr", "network", "host_maddrs",
           "multiaddr to listen on (repeatable), e.g. /ip4/0.0.0.0/tcp/31337", repeat=True),
    Option("--announce-maddr", "network", "announce_maddrs", "public multiaddr others should dial (repeatable)",
           repeat=True),
    Option("--identity", "network", "identity",
           "private key file giving a stable peer id (created if missing; default WORKDIR/identity.key)"),
    Option("--client-mode", "network", "client_mode",
           "behind NAT: accept no incoming connections; this peer dials its own round connections and never leads"),
    Option("--use-relay", "network", "use_relay", "allow libp2p circuit relays (hivemind use_relay)"),
    Option("--data-plane", "network", "data_plane",
           "send round tensors over direct TCP when reachable (--no-data-plane: libp2p only)"),
    Option("--use-auto-relay", "network", "use_auto_relay",
           "look for relays automatically when behind NAT (hivemind use_auto_relay); like --client-mode, the peer "
           "then dials its own round connections and never leads"),
    Option("--dht-process", "network", "dht_process",
           "run the DHT node in hivemind's forked process (default: on this peer's own loop, half the memory)"),
    Option("--dht-timeout", "network", "dht_timeout_s", "seconds one DHT request may take (hivemind wait_timeout)"),
    Option("--heartbeat", "network", "heartbeat_s", "seconds between republishing this peer's DHT record"),
    Option("--record-ttl", "network", "record_ttl_s",
           "seconds this peer's DHT record lives unless republished (others drop a silent peer after it)"),
    # [bootstrap]: finding the first peer through a coordinator's ready file (the compose setup)
    Option("--bootstrap-file", "bootstrap", "file",
           "wait for this coordinator ready file (swarmloco coordinator --ready-file) and dial its DHT node; "
           "ignored when --initial-peer is given"),
    Option("--bootstrap-wait", "bootstrap", "wait_s", "seconds to wait for --bootstrap-file to name a DHT peer id"),
    Option("--bootstrap-host", "bootstrap", "host",
           "dial the coordinator's DHT node at this host name or IP (/dns4/HOST/tcp/PORT/p2p/ID, so a restarted "
           "coordinator with a new IP is still found); unset: the multiaddrs written in the ready file"),
    Option("--bootstrap-port", "bootstrap", "port", "TCP port of the coordinator's DHT node, with --bootstrap-host"),
    # [admission]: who may take part in the run, and this peer's ticket
    Option("--authority", "admission", "authority",
           "peer id of the run's authority, whose tickets admit peers (default: the coordinator's, or "
           "--authority-key's)"),
    Option("--authority-key", "admission", "authority_key",
           "the run's authority key file: sign this peer's own ticket with it (machines you control; created if "
           "missing)"),
    Option("--ticket", "admission", "ticket",
           "a ticket file the run's authority issued to this peer (swarmloco ticket)"),
    Option("--invite", "admission", "invite", "invite code for a run that admits by invitation"),
    Option("--private", "admission", "private",
           "no authority and no tickets: anyone who can reach the peers takes part (a warning is printed)"),
    Option("--ticket-lifetime", "admission", "ticket_s", "seconds a ticket signed with --authority-key is valid"),
    # [round]: how averaging groups form and how contributions merge
    Option("--quorum", "round", "quorum", "K: minimum peers in an averaging group"),
    Option("--grace-min", "round", "grace_min_s",
           "seconds a leader waits after reaching quorum when nobody else is expected"),
    Option("--grace-max", "round", "grace_max_s", "upper bound of the adaptive grace window, in seconds"),
    Option("--round-timeout", "round", "round_timeout_s",
           "seconds a ready peer waits for a group before giving the round up"),
    Option("--view", "round", "view_s",
           "length in seconds of a round's first view (later views double, up to 8x); 0: derived from the "
           "grace and control timeouts"),
    Option("--exchange-timeout", "round", "exchange_timeout_s", "deadline in seconds for moving one pseudo-gradient"),
    Option("--control-timeout", "round", "control_timeout_s",
           "deadline in seconds for one small control message (join request, reply, group closed, abort)"),
    Option("--codec", "round", "codec", "pseudo-gradient wire codec: fp32 (lossless), fp16, bf16, int8, int4"),
    Option("--weight-cap-factor", "round", "weight_cap_factor",
           "cap a member's token weight at this multiple of the group's median claim"),
    Option("--aggregator", "round", "aggregator",
           "per shard: clip (median-norm clip, far outliers dropped; robust) or mean (plain weighted mean)"),
    Option("--clip-factor", "round", "clip_factor", "clip radius, as a multiple of the median norm of a shard's parts"),
    Option("--reject-factor", "round", "reject_factor",
           "drop parts longer than this multiple of the median norm (0: clip only)"),
    Option("--audit-probes", "round", "audit_probes", "random probes per shard auditing every result (0: no audit)"),
    Option("--stale-discount", "round", "stale_discount",
           "weight multiplier per round of staleness of a late pseudo-gradient"),
    Option("--max-staleness", "round", "max_staleness", "drop local progress that is more than this many rounds stale"),
    # [budget]: when a peer's round of local training is over
    Option("--round-tokens", "budget", "round_tokens",
           "round budget in tokens (slow peers take longer; 0 = --inner-steps)"),
    Option("--round-seconds", "budget", "round_seconds",
           "round budget in seconds (slow peers run fewer steps; 0 = --inner-steps)"),
    Option("--close-early", "budget", "close_early",
           "end the round's local training early to join a group already forming for our round (a slow peer then "
           "contributes fewer tokens instead of missing the round; default on)"),
    # [adopt]: what a state offered by other peers must pass before this peer adopts it
    Option("--adopt-tolerance", "adopt", "tolerance",
           "refuse a certified state whose loss on our own held-out batches exceeds our state's by more than this "
           "fraction (its claimants are then distrusted)"),
    Option("--adopt-step-factor", "adopt", "step_factor",
           "refuse a state one round past ours that lies farther from ours than this many of our recent outer steps "
           "(0: no distance check)"),
)
