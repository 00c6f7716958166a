"""Smoke test of the benchmark harness: every `scripts.bench` subcommand with --quick prints a table and writes
sane JSON (positive times, finite ratios, losses below ln 256). Checks sanity, never speed: the timeouts are
generous upper bounds for a loaded 2-core machine; unloaded, the whole file takes about a minute."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarmloco.proc_memory import descendants

pytestmark = pytest.mark.bench_smoke  # run by `make bench-smoke`, not by `make test`

ROOT = Path(__file__).resolve().parents[2]
LN256 = math.log(256)


def run_bench(args: list[str], tmp_path: Path, timeout: float) -> tuple[str, dict[str, Any]]:
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.bench", *args, "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        for pid in descendants(proc.pid) + [proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)
        _delete_our_namespaces(f"slb{proc.pid % 100000}")
    assert proc.returncode == 0, f"bench {args[0]} exited {proc.returncode}:\n{stderr[-3000:]}"
    assert "| " in stdout and "|---" in stdout, f"no table printed:\n{stdout}"
    return stdout, json.loads(out.read_text())


def _delete_our_namespaces(tag: str) -> None:
    """Namespaces the killed benchmark would have deleted itself (scripts.bench_net names them after its pid)."""
    if os.geteuid() != 0:
        return
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=30).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name == f"{tag}hub" or re.fullmatch(rf"{tag}p\d+", name):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=30)


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def none_or_positive(x: Any) -> bool:
    return x is None or positive(x)


@pytest.mark.timeout(160)
def test_allreduce_quick(tmp_path: Path) -> None:
    stdout, data = run_bench(["allreduce"], tmp_path, 150)
    entry = data["results"]["1"]["2"]
    assert positive(entry["gloo_s"]) and positive(entry["hivemind_s"]) and positive(entry["hivemind_step_s"])
    assert positive(entry["hivemind_vs_gloo"])
    assert none_or_positive(entry["ours_s"]) and none_or_positive(entry["ours_vs_gloo"])
    if entry["ours_s"] is None:
        assert entry["ours_note"] and "ours" in stdout


@pytest.mark.timeout(160)
def test_quality_quick(tmp_path: Path) -> None:
    _, data = run_bench(["quality"], tmp_path, 150)
    runs = data["runs"]
    assert {r["kind"] for r in runs} == {"dp", "diloco"} and any(r["warm"] for r in runs)
    assert len({r["tokens"] for r in runs}) == 1, "every run must see the same number of tokens"
    for r in runs:
        assert math.isfinite(r["eval_loss"]) and 0 < r["eval_loss"] < LN256, r
        assert positive(r["ratio_to_dp"]) and positive(r["seconds"])
    assert "simulation" in data["mode"]


@pytest.mark.timeout(100)
def test_comm_quick(tmp_path: Path) -> None:
    _, data = run_bench(["comm"], tmp_path, 90)
    tiny = data["results"]["tiny"]
    assert positive(tiny["dp_bytes_per_token"])
    ratios = {c: v["dp_over_diloco"]["100"] for c, v in tiny["codecs"].items()}
    assert ratios["fp32"] == pytest.approx(100.0)
    assert ratios["fp32"] < ratios["fp16"] < ratios["int8"] < ratios["int4"] < 800
    measured = tiny["codecs"]["fp32"]["measured_over_analytic"]
    if measured is not None:  # wire bytes = payload + small headers
        assert 0.99 < measured < 1.1, measured


@pytest.mark.timeout(130)
def test_join_quick(tmp_path: Path) -> None:
    _, data = run_bench(["join"], tmp_path, 120)
    for entry in data["results"].values():
        assert positive(entry["socket_s"]) and positive(entry["socket_mib_s"]) and positive(entry["socket_fresh_s"])
        assert none_or_positive(entry["ours_s"])


@pytest.mark.timeout(130)
def test_utilisation_quick(tmp_path: Path) -> None:
    _, data = run_bench(["utilisation"], tmp_path, 120)
    check = data["shaped_link_check"]
    if check is None:
        assert data["shaped_link_note"], "a skipped shaped-link check must say why"
    else:
        assert 0 < check["mbit_s"] < 150, f"link shaped to 100 Mbit/s measured {check['mbit_s']:.0f} Mbit/s"
    for run in data["runs"]:
        assert run["result"] is not None or run["note"]
        for peer in (run["result"] or {}).get("peers", []):
            assert 0 < peer["compute_s"] <= peer["wall_s"] * 1.01 and peer["wait_s"] >= 0, peer


@pytest.mark.timeout(130)
def test_trust_quick(tmp_path: Path) -> None:
    out, data = run_bench(["trust"], tmp_path, 120)
    assert "round / exchange" in out
    for entry in data["rounds"].values():
        assert positive(entry["round_s"]) and 0 < entry["certify_s"] < entry["round_s"]
    assert all(positive(us) for us in data["checks_us"].values())


@pytest.mark.timeout(330)
def test_scale_quick(tmp_path: Path) -> None:
    out, data = run_bench(["scale", "--peers", "2"], tmp_path, 320)
    assert "÷ log2" in out
    (entry,) = data["results"]
    assert entry["peers"] == 2 and not entry.get("note"), entry
    assert entry["members"] == [2] and positive(entry["overhead_s"]), entry
    assert "matchmaking_share" in entry  # None with one round: it needs the time between two commits
    assert "formation_share" in entry and 0 <= entry["formation_s"] <= entry["matchmaking_s"], entry
    assert positive(entry["memory"]["per_peer_pss_mb"]), entry["memory"]


@pytest.mark.timeout(100)
def test_codecs_quick(tmp_path: Path) -> None:
    out, data = run_bench(["codecs"], tmp_path, 90)
    assert "before" in out and positive(data["fp32_send_s"])
    for name, entry in data["results"].items():
        timed = ("encode_s", "decode_s", "decode_into_s", "decode_accumulate_s", "send_s")
        assert all(positive(entry[k]) for k in timed), name
        assert none_or_positive(entry["before_encode_s"]) and positive(entry["pipeline_vs_fp32_send"])
        assert 0 < entry["size_ratio"] <= 1 and entry["rel_error"] < 0.2, (name, entry)


@pytest.mark.timeout(100)
def test_views_quick(tmp_path: Path) -> None:
    out, data = run_bench(["views"], tmp_path, 90)
    assert "seconds ÷ first view" in out
    cells = data["cells"]
    assert {c["peers"] for c in cells} == {4, 32}
    assert all(c["formed"] == c["trials"] for c in cells), cells  # 10 views is ample for every cell
    calm = [c for c in cells if c["stalling_leaders"] == 0 and c["records_seen"] == 1]
    assert all(c["views_mean"] == 1 for c in calm), calm  # nobody stalls, everyone sees all: the first view closes


@pytest.mark.timeout(150)
def test_scores_quick(tmp_path: Path) -> None:
    out, data = run_bench(["scores"], tmp_path, 140)
    assert "honest z (min)" in out
    cells = data["cells"]
    assert len(cells) == 2 and all(c["z_zero"] == 0 for c in cells)
    # even after 5 inner steps an honest Δ lowers the probe loss far beyond what chance gives a random Δ
    assert all(c["z_honest_min"] > 8 and abs(c["z_random"]) < 5 and c["z_negated"] < -8 for c in cells), cells


@pytest.mark.timeout(200)
def test_ingest_quick(tmp_path: Path) -> None:
    out, data = run_bench(["ingest"], tmp_path, 190)
    assert "reports per commit" in out
    single, group = data["arms"]
    assert not single["group_commit"] and group["group_commit"]
    assert all(a["acknowledged"] > 0 and a["lost"] == 0 for a in (single, group)), data
    # the baseline: one transaction per report (the window edges of the two counts differ slightly)
    assert single["commits"] >= 0.9 * single["acknowledged"], single
