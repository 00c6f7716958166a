"""The run manifest and `swarmloco peer --join`: a stranger's JSON parsed strictly, versions refused in one line,
and the settings a run fixes merged into the peer's config (a user's conflicting value is an error naming it). The
task and model fingerprint checks of a join are in test_join.py."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path

import pytest

from swarmloco.coordinator.service import CoordinatorService, ServiceConfig
from swarmloco.coordinator.store import SQLiteStore
from swarmloco.peer.cli_args import add_arguments
from swarmloco.peer.config import SECTIONS, ConfigError, build_config
from swarmloco.peer.join import JoinError, check_compatible, check_run_settings, fetch_manifest, fixed_values
from swarmloco.protocol.base.manifest import (
    MAX_BOOTSTRAP,
    MAX_FINGERPRINT,
    MAX_MANIFEST_BYTES,
    MAX_TASK,
    Manifest,
    ManifestError,
)
from swarmloco.protocol.base.records import PROTOCOL_VERSION

KNOWN = {name: {f.name for f in fields(cls)} for name, cls in SECTIONS.items()}
BOOT = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWJ8Z3xv8Qwb8V7jDNZAAt2S1qFqf3jnBTzVQ4sE9Mh1RN"
AUTHORITY = "12D3KooWJ8Z3xv8Qwb8V7jDNZAAt2S1qFqf3jnBTzVQ4sE9Mh1RN"


def _manifest(**over: object) -> Manifest:
    base = dict(run_id="pub", protocol_version=PROTOCOL_VERSION, package_version="0.1.0", authority=AUTHORITY,
                admission="invite", bootstrap=(BOOT,), coordinator="http://127.0.0.1:8000",
                settings={"run": {"preset": "tiny"}, "train": {"lr": 1e-3, "inner_steps": 20},
                          "round": {"quorum": 3}, "runtime": {"seed": 7}})
    return Manifest(**{**base, **over})  # type: ignore[arg-type]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_manifest_round_trips_and_every_malformed_one_is_refused() -> None:
    m = _manifest()
    assert Manifest.from_bytes(json.dumps(m.to_value()).encode()) == m
    good = m.to_value()
    for bad, why in [
        ([1], "not a JSON object"),
        ({**good, "manifest": 2}, "format 2"),
        ({**good, "extra": 1}, "unknown fields"),
        ({k: v for k, v in good.items() if k != "authority"}, "lacks authority"),
        ({**good, "protocol_version": "5"}, "small non-negative integers"),
        ({**good, "run_id": ""}, "run_id is empty"),
        ({**good, "run_id": "x" * 600}, "short strings"),
        ({**good, "bootstrap": [BOOT] * (MAX_BOOTSTRAP + 1)}, "at most"),
        ({**good, "settings": {"train": {"lr": float("nan")}}}, "train.lr"),
        ({**good, "settings": {"train": {"lr": {"nested": 1}}}}, "train.lr"),
        ({**good, "settings": {"train": [1]}}, "section"),
        ({**good, "settings": {"round": {"quorum": 2**60}}}, "round.quorum"),
    ]:
        with pytest.raises(ManifestError, match=why):
            Manifest.parse(bad)
    with pytest.raises(ManifestError, match="larger than"):
        Manifest.from_bytes(b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.from_bytes(b"{")


def test_another_protocol_version_is_refused_in_one_line_that_says_what_to_install() -> None:
    check_compatible(_manifest())
    with pytest.raises(JoinError) as info:
        check_compatible(_manifest(protocol_version=PROTOCOL_VERSION + 1, package_version="9.9.9"))
    assert "install swarmloco==9.9.9" in str(info.value) and "\n" not in str(info.value)


def test_a_run_fixes_shared_settings_only() -> None:
    check_run_settings(_manifest().settings, KNOWN)
    for settings, why in [({"runtime": {"device": "cuda"}}, "runtime.device is for each peer"),
                          ({"network": {"run_id": "x"}}, "network.run_id is for each peer"),
                          ({"train": {"batch_size": 8}}, "train.batch_size is for each peer"),
                          ({"train": {"nope": 1}}, "unknown key train.nope"),
                          ({"gpu": {}}, "unknown section")]:
        with pytest.raises(JoinError, match=why):
            check_run_settings(settings, KNOWN)


def test_the_runs_settings_fill_the_config_and_a_conflicting_one_is_named() -> None:
    m = _manifest()
    fixed = fixed_values(m, "http://127.0.0.1:8000")
    added = {"network": {"initial_peers": m.bootstrap}}
    cfg = build_config(_args("--join", "http://x", "--device", "cpu", "--initial-peer", BOOT.replace("31337", "4")),
                       {}, fixed=fixed, added=added)
    assert (cfg.network.run_id, cfg.admission.authority, cfg.run.coordinator) == ("pub", AUTHORITY,
                                                                                  "http://127.0.0.1:8000")
    assert (cfg.train.lr, cfg.train.inner_steps, cfg.round.quorum, cfg.runtime.seed) == (1e-3, 20, 3, 7)
    assert cfg.network.initial_peers == (BOOT.replace("31337", "4"), BOOT)  # the user's own, then the run's
    assert cfg.runtime.device == "cpu"
    same = build_config(_args("--inner-lr", "0.001"), {}, fixed=fixed)  # the same value, written otherwise: fine
    assert same.train.lr == 1e-3
    with pytest.raises(ConfigError, match="--inner-lr is fixed by the run you join at 0.001"):
        build_config(_args("--inner-lr", "0.01"), {}, fixed=fixed)
    with pytest.raises(ConfigError, match="--run-id is fixed"):
        build_config(_args("--run-id", "other"), {}, fixed=fixed)
    with pytest.raises(ConfigError, match="--quorum is fixed"):
        build_config(None, {"SWARMLOCO_QUORUM": "2"}, fixed=fixed)


def test_fetching_a_manifest_fails_fast_and_clearly(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_manifest().to_value()))
    manifest, origin = fetch_manifest(str(path))
    assert manifest == _manifest() and origin == "http://127.0.0.1:8000"  # a file: the coordinator it names
    path.write_text("{not json")
    with pytest.raises(JoinError, match="not JSON"):
        fetch_manifest(str(path))
    with pytest.raises(JoinError, match="cannot read the manifest file"):
        fetch_manifest(str(tmp_path / "missing.json"))
    started = time.monotonic()
    with pytest.raises(JoinError, match="cannot read the run manifest at http://127.0.0.1:9/api/manifest"):
        fetch_manifest("http://127.0.0.1:9", timeout=2)
    assert time.monotonic() - started < 10


def test_the_task_and_fingerprint_round_trip_are_optional_and_bounded() -> None:
    m = _manifest(task="stdlib-gpt-tiny", fingerprint="0123abcd" * 4)
    assert Manifest.from_bytes(json.dumps(m.to_value()).encode()) == m
    unknown = _manifest().to_value()  # a coordinator that cannot name them leaves them out: older readers accept it
    assert "task" not in unknown and "fingerprint" not in unknown
    assert (Manifest.parse(unknown).task, Manifest.parse(unknown).fingerprint) == ("", "")
    for bad, why in [({**unknown, "task": "t" * (MAX_TASK + 1)}, "task must be"),
                     ({**unknown, "task": "two\nlines"}, "task must be"),
                     ({**unknown, "task": 7}, "task must be"),
                     ({**unknown, "fingerprint": "a" * (MAX_FINGERPRINT + 1)}, "fingerprint must be"),
                     ({**unknown, "fingerprint": "ABCDEF"}, "fingerprint must be"),
                     ({**unknown, "fingerprint": ["ab"]}, "fingerprint must be")]:
        with pytest.raises(ManifestError, match=why):
            Manifest.parse(bad)


def test_the_coordinator_serves_the_task_and_fingerprint_it_was_given(tmp_path: Path) -> None:
    config = ServiceConfig(run_id="run", run_settings={"run": {"preset": "tiny"}}, run_task="stdlib-gpt-tiny",
                           run_fingerprint="ab" * 16)
    served = Manifest.parse(CoordinatorService(SQLiteStore(tmp_path / "db.sqlite"), config).manifest())
    assert (served.task, served.fingerprint) == ("stdlib-gpt-tiny", "ab" * 16)
    with pytest.raises(ValueError, match="fingerprint must be"):
        ServiceConfig(run_fingerprint="not hex")
