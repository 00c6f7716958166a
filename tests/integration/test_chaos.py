"""Chaos smoke tests (part of `make test`; alone: `make chaos-smoke`): short (`--quick`) runs of `swarmloco chaos run`
over real peers on 127.0.0.1. Each asserts that rounds commit after the faults, that every live peer ends on one
state hash, that nothing the run started is left alive, and that the JSON carries its keys.

The peers are forked from one process that imported torch once (`--spawn fork`, the default; the partition's
peers are exec'd in their network namespaces), and run at `--slowdown 3` (each sleeps twice a step's time after it,
like slower hardware): four peers that import torch each and train flat out take both cores for the whole run, and
the test beside this one waits for them. Rounds take about twice as long, and the faults still fall among them."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_swarmloco

from swarmloco.chaos_scenarios import SCENARIOS

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

KEYS = {"scenario", "rounds_committed", "views_per_round", "goodput_tokens_per_s", "final_hashes", "orphans",
        "faults", "per_peer", "notes"}


def _chaos(tmp_path: Path, env: dict[str, str], scenario: str, *extra: str, timeout: float) -> dict[str, object]:
    out = tmp_path / f"{scenario}.json"
    proc = run_swarmloco(["chaos", "run", scenario, "--quick", "--slowdown", "3", "--workdir", str(tmp_path / scenario),
                          "--json", str(out), *extra], env, timeout=timeout)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    result: dict[str, object] = json.loads(out.read_text())
    assert proc.returncode == 0, json.dumps(result, indent=1)[-3000:] + proc.stderr[-3000:]
    return result


def _check(result: dict[str, object], scenario: str, fault_kind: str) -> None:
    assert KEYS <= set(result), sorted(KEYS - set(result))
    assert result["scenario"] == scenario and result["error"] is None and result["slowdown"] == 3.0
    assert result["spawn"] == ("exec" if SCENARIOS[scenario].split else "fork")  # namespaces need an exec
    faults = result["faults"]
    assert isinstance(faults, list) and any(f["kind"] == fault_kind for f in faults), faults
    assert result["settled"] is True, result  # a round committed after the last fault, and the peers agree
    assert isinstance(result["rounds_committed"], int) and result["rounds_committed"] >= 1
    hashes = result["final_hashes"]
    assert isinstance(hashes, dict) and len(hashes) == 4 and len(set(hashes.values())) == 1, hashes
    assert None not in hashes.values()
    assert result["orphans"] == 0, result["orphan_cmdlines"]
    assert Path(str(result["plot"])).read_bytes().startswith(b"\x89PNG")
    per_peer = result["per_peer"]
    assert isinstance(per_peer, dict) and all(v["peak_rss_mb"] > 0 for v in per_peer.values()), per_peer


@pytest.mark.timeout(420)
def test_churn_quick(tmp_path: Path, cli_env: dict[str, str]) -> None:
    result = _chaos(tmp_path, cli_env, "churn-30s", timeout=400)
    _check(result, "churn-30s", "sigkill")
    assert any(f["kind"] == "restart" for f in result["faults"])  # type: ignore[union-attr]


@pytest.mark.timeout(420)
def test_burners_quick(tmp_path: Path, cli_env: dict[str, str]) -> None:
    result = _chaos(tmp_path, cli_env, "burners", timeout=400)
    _check(result, "burners", "burner-stop")
    assert sum(f["kind"] == "burner-start" for f in result["faults"]) == 2  # type: ignore[union-attr]


@pytest.mark.timeout(420)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a stopped leader and 3 peers need two cores")
def test_sigstop_leader_quick(tmp_path: Path, cli_env: dict[str, str]) -> None:
    result = _chaos(tmp_path, cli_env, "sigstop-leader", timeout=400)
    _check(result, "sigstop-leader", "sigcont")


@pytest.mark.timeout(420)
def test_leader_staller_quick(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """peer-0 holds every group it leads: it costs the views it leads, and the swarm still commits and agrees."""
    result = _chaos(tmp_path, cli_env, "leader-staller", timeout=400)
    _check(result, "leader-staller", "lead=hold@*")
    assert isinstance(result["views_per_round"], float) and result["views_per_round"] >= 1.0


@pytest.mark.timeout(420)
def test_reducer_withholder_quick(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """peer-3 never sends its reduced shard: a round it reduces in is reduced again without it and commits (backup
    reducers), and the swarm agrees. On the code before backup reducers, no round with it as a reducer commits."""
    result = _chaos(tmp_path, cli_env, "reducer-withholder", timeout=400)
    _check(result, "reducer-withholder", "reduce=withhold@*")
    assert isinstance(result["rounds_reduced_twice"], int) and result["rounds_reduced_twice"] >= 1, result


@pytest.mark.timeout(420)
def test_silent_claimants_quick(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """Three admitted peers claim a far newer state and never answer: the honest four commit on and agree."""
    result = _chaos(tmp_path, cli_env, "silent-claimants", timeout=400)
    _check(result, "silent-claimants", "claimant-stop")
    assert sum(f["kind"] == "claimant-start" for f in result["faults"]) == 3  # type: ignore[union-attr]


@pytest.mark.timeout(420)
@pytest.mark.skipif(os.geteuid() != 0, reason="partition-2-2 puts each peer in a network namespace: needs root")
def test_partition_quick(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """Two halves of two peers, cut apart for 12 s: neither half is a majority of the four, so nothing commits while
    the cut lasts (a round in flight may finish just after it); after the heal the swarm commits again and agrees."""
    result = _chaos(tmp_path, cli_env, "partition-2-2", timeout=400)
    _check(result, "partition-2-2", "heal")
    faults = {f["kind"]: f["t"] for f in result["faults"]}  # type: ignore[union-attr]
    assert set(faults) == {"partition", "heal"} and faults["heal"] - faults["partition"] >= 11, faults
    during = [t for t in result["committed_at_s"] if faults["partition"] + 5 < t < faults["heal"]]  # type: ignore
    assert not during, (during, faults, result["committed_at_s"])
    assert any(t > faults["heal"] for t in result["committed_at_s"]), result  # type: ignore[union-attr]
