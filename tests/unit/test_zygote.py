"""The fork server's entry points: a request runs `python -m MODULE ARGS` for one of our modules, nothing else; and
a chaos run's choice between forking and exec'ing its peers."""
from __future__ import annotations

from pathlib import Path

import pytest

from swarmloco.chaos_scenarios import ChaosConfig
from swarmloco.zygote import ENTRY_POINTS, _entry


def test_a_request_runs_the_module_after_dash_m_with_its_arguments() -> None:
    assert _entry(["/usr/bin/python3", "-m", "swarmloco.cli", "peer", "--quorum", "2"]) == (
        "swarmloco.cli", ["peer", "--quorum", "2"])
    assert _entry(["python", "-m", "swarmloco.chaos_hostile", "claimant", "--run-id", "r"]) == (
        "swarmloco.chaos_hostile", ["claimant", "--run-id", "r"])
    assert _entry(["python", "peer", "--solo"]) == ("swarmloco.cli", ["peer", "--solo"])
    assert set(ENTRY_POINTS) == {"swarmloco.cli", "swarmloco.chaos_hostile"}


@pytest.mark.parametrize("module", ["os", "runpy", "swarmloco.zygote", "swarmloco.cli.x"])
def test_any_other_module_is_refused(module: str) -> None:
    with pytest.raises(ValueError, match="fork server runs only"):
        _entry(["python", "-m", module, "whatever"])


def test_a_chaos_run_forks_or_execs_and_nothing_else() -> None:
    assert ChaosConfig(scenario="steady", workdir=Path("w"), json_out=Path("o")).spawn == "fork"
    with pytest.raises(ValueError, match="spawn: got 'frok'"):
        ChaosConfig(scenario="steady", workdir=Path("w"), json_out=Path("o"), spawn="frok")
