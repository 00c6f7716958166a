"""`swarmloco peer --join URL`: join a run from its manifest alone.

URL is a coordinator (its `/api/manifest` is read), the URL of a manifest file, or a local manifest file. The peer
then refuses in one line when this swarmloco speaks another protocol version than the run, and otherwise fills in
everything the run fixes: the run id, the authority, where the swarm is (bootstrap multiaddrs, to which the user's
own --initial-peer are added), the coordinator, and the settings every peer must share (`RUN_FIXED`: the model,
the inner and outer optimiser, the round rules, the seed of θ_0). The user sets only what belongs to the machine:
device, threads, workdir, budget, network reachability. Setting one of the run's settings to another value is an
error that names it, rather than a peer that never finds a group. When the manifest names the run's task and model
fingerprint, the peer builds its own from the filled-in config (`swarmloco.peer.run_model`) and refuses, in one
line, a task it does not know or a fingerprint that differs (another swarmloco, another plug-in, another --preset).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import requests

from swarmloco.peer.presets import builtin_tasks
from swarmloco.peer.run_model import RunModel
from swarmloco.protocol.base.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, package_version
from swarmloco.protocol.base.records import PROTOCOL_VERSION
from swarmloco.protocol.base.text import bounded

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0
# section -> the keys a run fixes for all its peers (None: every key of the section)
RUN_FIXED: dict[str, frozenset[str] | None] = {
    "run": frozenset({"preset", "task", "num_shards"}),
    "train": frozenset({"lr", "weight_decay", "beta1", "beta2", "warmup_steps", "decay_steps", "min_lr_ratio",
                        "grad_clip", "inner_steps"}),
    "outer": None,
    "round": None,
    "runtime": frozenset({"seed"}),
}


class JoinError(ValueError):
    """The run cannot be joined from this manifest; one line says why and what to do."""


def fetch_manifest(source: str, *, timeout: float = FETCH_TIMEOUT_S) -> tuple[Manifest, str]:
    """The manifest `source` points to, and the coordinator URL it came from ("" for a file or a manifest URL whose
    manifest names none). Raises JoinError within about `timeout` seconds."""
    if source.startswith(("http://", "https://")):
        url = source.rstrip("/")
        target = url if url.endswith(".json") else url + "/api/manifest"
        try:
            with requests.get(target, timeout=(timeout / 2, timeout / 2), stream=True) as resp:
                raw = resp.raw.read(MAX_MANIFEST_BYTES + 1, decode_content=True)
                status = resp.status_code
        except (requests.RequestException, OSError) as exc:
            raise JoinError(f"--join {source}: cannot read the run manifest at {target}: {type(exc).__name__}: "
                            f"{bounded(str(exc), 200)}") from None
        if status != 200:
            raise JoinError(f"--join {source}: {target} answered {status}; is that a swarmloco coordinator?")
        origin = "" if url.endswith(".json") else url
    else:
        path = Path(source)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise JoinError(f"--join {source}: cannot read the manifest file: {exc.strerror or exc}") from None
        origin = ""
    try:
        manifest = Manifest.from_bytes(raw)
    except ManifestError as exc:
        raise JoinError(f"--join {source}: {exc}") from None
    return manifest, origin or manifest.coordinator


def check_compatible(manifest: Manifest) -> None:
    """Refuse, in one line that says what to install, a run this swarmloco cannot take part in."""
    if manifest.protocol_version != PROTOCOL_VERSION:
        raise JoinError(f"the run {manifest.run_id!r} speaks protocol version {manifest.protocol_version} "
                        f"(swarmloco {manifest.package_version}); this peer speaks {PROTOCOL_VERSION} (swarmloco "
                        f"{package_version()}): install swarmloco=={manifest.package_version}")
    if manifest.package_version != package_version():
        logger.warning("the run uses swarmloco %s and this peer %s; the protocol (version %d) is the same",
                       manifest.package_version, package_version(), PROTOCOL_VERSION)


def check_model(manifest: Manifest, ours: RunModel) -> None:
    """Refuse, in one line that says what to do, a run whose task or model fingerprint is not the one this peer
    builds from the run's settings (`ours`: swarmloco.peer.run_model.expected_model). What the manifest leaves
    empty is not checked."""
    plugin = manifest.settings.get("run", {}).get("task")
    known = builtin_tasks() + ((ours.task,) if plugin else ())
    run = f"the run {manifest.run_id!r}"
    install = f"install swarmloco=={manifest.package_version} (this peer has {package_version()})"
    if manifest.task and manifest.task not in known:
        raise JoinError(f"{run} trains task {bounded(manifest.task, 80)!r}, which this swarmloco does not know (it "
                        f"knows {', '.join(known)}): {install}")
    if manifest.task and manifest.task != ours.task:
        raise JoinError(f"{run} trains task {manifest.task!r}; this peer would build {ours.task!r}: pass the run's "
                        "--preset and --task, or leave them out")
    if manifest.fingerprint and manifest.fingerprint != ours.fingerprint:
        todo = [install] if manifest.package_version != package_version() else []
        todo += [f"use the run's version of the plug-in {plugin}"] if plugin else []
        raise JoinError(f"{run} trains task {manifest.task or ours.task!r} with model fingerprint "
                        f"{manifest.fingerprint[:12]}…; this peer would build {ours.fingerprint[:12]}… from the same "
                        f"settings: {', or '.join([*todo, 'check --preset, --task and --seed'])}")


def check_run_settings(settings: Mapping[str, Mapping[str, Any]], known: Mapping[str, set[str]]) -> None:
    """Refuse settings a run may not fix: unknown sections or keys (`known`: section -> its keys), and per-peer
    ones (the device, the workdir, the network, the budget)."""
    for section, entries in settings.items():
        if section not in known:
            raise JoinError(f"the run's settings name an unknown section [{section}]")
        for key in entries:
            if key not in known[section]:
                raise JoinError(f"the run's settings name an unknown key {section}.{key}")
            fixed = RUN_FIXED.get(section, frozenset())
            if fixed is not None and key not in fixed:
                raise JoinError(f"{section}.{key} is for each peer to choose, not the run; the run may fix "
                                f"{describe_fixed()}")


def describe_fixed() -> str:
    return "; ".join(f"[{s}] " + ("every key" if keys is None else ", ".join(sorted(keys)))
                     for s, keys in RUN_FIXED.items())


def fixed_values(manifest: Manifest, origin: str) -> dict[str, dict[str, Any]]:
    """What the run fixes for this peer, in the config's sections (`build_config(fixed=...)`)."""
    values: dict[str, dict[str, Any]] = {name: dict(entries) for name, entries in manifest.settings.items()}
    values.setdefault("network", {})["run_id"] = manifest.run_id
    if manifest.authority:
        values.setdefault("admission", {})["authority"] = manifest.authority
    if origin:
        values.setdefault("run", {})["coordinator"] = origin
    return values


def describe(manifest: Manifest, origin: str) -> str:
    fixed = ", ".join(f"{s}.{k}" for s, entries in manifest.settings.items() for k in entries) or "none"
    task = f"task {manifest.task}, " if manifest.task else ""
    return (f"joining run {manifest.run_id!r} ({task}admission {manifest.admission}, {len(manifest.bootstrap)} "
            f"bootstrap address(es), coordinator {origin or 'none'}); the run fixes: {bounded(fixed, 300)}")


def manifest_json(manifest: Manifest) -> str:
    return json.dumps(manifest.to_value(), indent=2, sort_keys=True)
