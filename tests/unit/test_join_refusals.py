"""`swarmloco peer --join` checks the run's task and model fingerprint: the coordinator computes them from its
--run-config as a peer would (the fingerprint a real replica announces, whatever batch size each peer picks), a
peer with the same model joins, and a differing fingerprint or a task this install does not know is refused in one
line that says what to do. No network: the manifest is a file."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from swarmloco.coordinator_cmd import run_model
from swarmloco.peer.cli import build_replica, joined_config
from swarmloco.peer.cli_args import add_arguments
from swarmloco.peer.config import ConfigError, build_config
from swarmloco.peer.join import JoinError, check_model
from swarmloco.peer.presets import builtin_tasks
from swarmloco.peer.run_model import RunModel, expected_model
from swarmloco.peer.swarm_state import local_model
from swarmloco.protocol.base.manifest import Manifest, package_version
from swarmloco.protocol.base.records import PROTOCOL_VERSION

SETTINGS: dict[str, dict[str, Any]] = {"run": {"preset": "tiny"}, "train": {"inner_steps": 10},
                                       "runtime": {"seed": 3}}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _manifest(**over: Any) -> Manifest:
    base: dict[str, Any] = dict(run_id="pub", protocol_version=PROTOCOL_VERSION, package_version=package_version(),
                                authority="", admission="none", settings=SETTINGS)
    return Manifest(**{**base, **over})


def _one_line(exc: pytest.ExceptionInfo[Exception], *parts: str) -> None:
    text = str(exc.value)
    assert "\n" not in text and all(p in text for p in parts), text


def test_the_coordinator_names_the_model_a_replica_of_the_run_announces() -> None:
    task, fp = run_model(build_config(None, {}, fixed=SETTINGS))
    assert task == "stdlib-gpt-tiny" and len(fp) == 32
    # a real peer of the run, with a batch size of its own: the batch size is not part of the model
    replica = build_replica(build_config(_args("--batch-size", "2", "--shard-index", "0"), {}, fixed=SETTINGS))
    assert (replica.task.name, local_model(replica, 3).fingerprint) == (task, fp)
    other = run_model(build_config(None, {}, fixed={**SETTINGS, "runtime": {"seed": 4}}))
    assert other[0] == task and other[1] != fp  # θ_0 differs: another model to average
    assert run_model(build_config(None, {}, fixed={"run": {"task": "no_such_module:make"}})) == ("", "")


def test_a_peer_with_the_runs_model_passes_and_an_empty_manifest_checks_nothing() -> None:
    ours = RunModel(task="stdlib-gpt-tiny", fingerprint="ab" * 16)
    check_model(_manifest(task=ours.task, fingerprint=ours.fingerprint), ours)
    check_model(_manifest(), ours)  # a coordinator that could not compute them
    check_model(_manifest(task=ours.task), ours)


def test_another_fingerprint_or_task_is_refused_in_one_line_that_says_what_to_do() -> None:
    ours = RunModel(task="stdlib-gpt-tiny", fingerprint="cd" * 16)
    with pytest.raises(JoinError) as info:
        check_model(_manifest(task=ours.task, fingerprint="ab" * 16, package_version="9.9.9"), ours)
    _one_line(info, "trains task 'stdlib-gpt-tiny' with model fingerprint abababababab…",
              "this peer would build cdcdcdcdcdcd…", "install swarmloco==9.9.9", "check --preset, --task and --seed")
    with pytest.raises(JoinError) as info:
        check_model(_manifest(fingerprint="ab" * 16), ours)  # the same swarmloco: no version to install
    assert "install" not in str(info.value)
    with pytest.raises(JoinError) as info:
        check_model(_manifest(task="vision-net", fingerprint=ours.fingerprint, package_version="9.9.9"), ours)
    _one_line(info, "trains task 'vision-net', which this swarmloco does not know", ", ".join(builtin_tasks()),
              "install swarmloco==9.9.9")
    with pytest.raises(JoinError) as info:
        check_model(_manifest(task="stdlib-gpt-small"), ours)
    _one_line(info, "trains task 'stdlib-gpt-small'; this peer would build 'stdlib-gpt-tiny'", "--preset")
    plugin = _manifest(task="my-task", settings={"run": {"task": "mine:make"}}, fingerprint="ab" * 16)
    with pytest.raises(JoinError) as info:
        check_model(plugin, RunModel(task="my-task", fingerprint="cd" * 16))  # a plug-in's task is known by loading
    _one_line(info, "use the run's version of the plug-in mine:make")


def test_join_builds_the_local_model_from_the_manifest_and_refuses_another(tmp_path: Path) -> None:
    task, fp = run_model(build_config(None, {}, fixed=SETTINGS))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_manifest(task=task, fingerprint=fp).to_value()))
    cfg = joined_config(_args("--join", str(path), "--workdir", str(tmp_path / "w"), "--batch-size", "4"))
    assert (cfg.network.run_id, cfg.runtime.seed) == ("pub", 3) and expected_model(cfg) == RunModel(task=task,
                                                                                                     fingerprint=fp)
    unseeded = {k: v for k, v in SETTINGS.items() if k != "runtime"}  # a run that leaves the seed to its peers
    task, fp = run_model(build_config(None, {}, fixed=unseeded))
    path.write_text(json.dumps(_manifest(task=task, fingerprint=fp, settings=unseeded).to_value()))
    joined_config(_args("--join", str(path), "--workdir", str(tmp_path / "w")))
    with pytest.raises(ConfigError) as info:
        joined_config(_args("--join", str(path), "--workdir", str(tmp_path / "w"), "--seed", "5"))
    _one_line(info, f"model fingerprint {fp[:12]}…", "check --preset, --task and --seed")
