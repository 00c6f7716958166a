"""Dashboard in headless Chromium, fed by a real small swarm: 2 peer processes train 3 rounds and report to a
coordinator process this test starts. The page is opened while the swarm trains and must fill itself in: charts
drawn with the points the peers reported, the peers table with both peers, the rounds listed, no console errors.

Needs the Debian packages ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them); skipped otherwise.
The screenshot is saved under the test's tmp dir; with ``SWARMLOCO_UPDATE_SCREENSHOT=1`` it is also copied to
docs/dashboard.png (the picture in docs/coordinator.md).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _coordinator_helpers import ROOT
from test_coordinator_e2e import PEER_ARGS, Procs, finished, get, peer_ids, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.integration]

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
RUN_ID, PEERS, ROUNDS = "browser-run", 2, 3


def _missing() -> str | None:
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        return "chromium/chromedriver not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install -e '.[test]')"
    return None


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def _driver(tmp_path: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1900", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log"))
    return webdriver.Chrome(service=service, options=options)


_CANVAS_INK = """
const c = document.getElementById(arguments[0]);
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let ink = 0;
for (let i = 3; i < d.length; i += 4) if (d[i] > 0) ink++;
return ink;
"""

_DATASETS = "return window.swarmlocoCharts[arguments[0]].data.datasets.map(d => ({label: d.label, data: d.data}))"


def test_dashboard_shows_real_swarm(procs: Procs, tmp_path: Path) -> None:
    reason = _missing()
    if reason:
        pytest.skip(reason)
    _, info = procs.coordinator(tmp_path / "coordinator.sqlite", RUN_ID, "--price", "cpu=0.25")
    url = info["url"]
    work, summary_path = tmp_path / "swarm", tmp_path / "summary.json"
    # --slowdown stretches each step (sleeping, not computing) so that the peers' 5 s metric reports give the
    # curves several points while the whole run stays around a minute.
    swarm = procs.swarm(work, "--peers", str(PEERS), "--rounds", str(ROUNDS), "--inner-steps", "10",
                        "--slowdown", "8,8", "--coordinator", url, "--run-id", RUN_ID,
                        "--summary-json", str(summary_path), f"--peer-arg=--invite={info['invite']}", *PEER_ARGS)
    driver = _driver(tmp_path)
    try:
        driver.set_page_load_timeout(60)
        driver.get(url + "/")
        def refreshes():
            return driver.execute_script("return window.swarmloco ? window.swarmloco.refreshes : 0")
        wait_for(lambda: refreshes() >= 1, 60, "the dashboard's first refresh")

        finished(swarm, work.with_suffix(".log"), 240)
        summary = json.loads(summary_path.read_text())
        ids = peer_ids(work, PEERS)
        # Reports are sent in order, so once both peers' goodbyes are stored everything before them is too.
        wait_for(lambda: all(p["left_at"] for p in get(url, "/api/peers", run_id=RUN_ID)["items"])
                 and len(get(url, "/api/peers", run_id=RUN_ID)["items"]) == PEERS, 30, "both peers' bye reports")
        seen = refreshes()
        wait_for(lambda: refreshes() >= seen + 2, 30, "two more dashboard refreshes")  # no reload: it polls

        metrics = get(url, "/api/metrics", run_id=RUN_ID, limit=1000)["items"]
        train = driver.execute_script(_DATASETS, "train")
        assert len(train) == PEERS
        for peer_id in ids.values():
            want = sorted((m["tokens_total"], m["train_loss"]) for m in metrics
                          if m["peer_id"] == peer_id and m["train_loss"] is not None)
            (got,) = [d["data"] for d in train if d["label"] == "…" + peer_id[-8:]]
            assert len(want) >= 2 and sorted((p["x"], p["y"]) for p in got) == want, (want, got)

        (swarm_eval, *_) = driver.execute_script(_DATASETS, "eval")
        assert [p["y"] for p in swarm_eval["data"]] == pytest.approx([r["eval_loss"] for r in summary["rounds"]])
        xs = [p["x"] for p in swarm_eval["data"]]
        assert xs == sorted(xs) and xs[0] > 0  # committed swarm tokens grow round by round

        throughput = driver.execute_script(_DATASETS, "throughput")
        assert len(throughput) == PEERS and all(d["data"] and all(p["y"] > 0 for p in d["data"]) for d in throughput)
        labels = driver.execute_script("return window.swarmlocoCharts.rounds.data.labels")
        assert labels == [str(r + 1) for r in range(ROUNDS)]
        _assert_contributors(driver, url, ids)
        for canvas in ("chart-train", "chart-eval", "chart-throughput", "chart-rounds", "chart-cost", "chart-contrib"):
            assert driver.execute_script(_CANVAS_INK, canvas) > 2000, f"{canvas} looks empty"

        rows = driver.execute_script("return [...document.querySelectorAll('#peers-table tbody tr')]"
                                     ".map(tr => [tr.cells[0].title, ...[...tr.cells].map(td => td.textContent)])")
        assert sorted(r[0] for r in rows) == sorted(ids.values()), rows
        for row in rows:
            assert row[2] == "left" and row[3].startswith("cpu") and row[8] == str(ROUNDS), row
            assert row[9] != "–", row  # last train loss
        rounds = driver.execute_script("return [...document.querySelectorAll('#rounds-table tbody tr')]"
                                       ".map(tr => [...tr.cells].map(td => td.textContent))")
        assert [r[0] for r in rounds] == [str(ROUNDS - i) for i in range(ROUNDS)], rounds
        for row, rec in zip(rounds, reversed(summary["rounds"]), strict=False):
            assert row[1] == "committed" and row[6] == next(iter(rec["hashes"].values()))[:12], (row, rec)
        assert driver.execute_script("return window.swarmloco.lastError") is None
        join = driver.execute_script("return document.getElementById('join-command').textContent")
        assert join == f"swarmloco peer --join {url} --invite CODE", join  # the code itself is never shown
        driver.execute_script("document.getElementById('join-copy').click()")

        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not errors, errors
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot))
        if os.environ.get("SWARMLOCO_UPDATE_SCREENSHOT") == "1":
            (ROOT / "docs").mkdir(exist_ok=True)
            shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")
    finally:
        driver.quit()


def _assert_contributors(driver: Any, url: str, ids: dict[str, str]) -> None:
    """The contributors table, the contributions and cost charts and the cost card show what the API accounts."""
    peers = {p["peer_id"]: p for p in get(url, "/api/peers", run_id=RUN_ID)["items"]}
    run = get(url, "/api/accounting", run_id=RUN_ID)
    rows = driver.execute_script("return [...document.querySelectorAll('#contributors-table tbody tr')]"
                                 ".map(tr => [tr.cells[0].title, ...[...tr.cells].map(td => td.textContent)])")
    assert sorted(r[0] for r in rows) == sorted(ids.values()), rows
    for row in rows:
        p = peers[row[0]]
        assert row[2] == "cpu" and float(row[3]) > 0 and row[5] == f"{p['credited_tokens']:,}", (row, p)
        assert row[9].startswith(f"{p['rounds_joined']} / ") and p["rounds_joined"] >= ROUNDS, (row, p)
        assert float(row[7]) > 0 and float(row[8]) > 0, row  # MiB sent and received
    contrib = driver.execute_script(_DATASETS, "contrib")
    assert sorted(contrib[0]["data"]) == sorted(p["credited_tokens"] for p in peers.values()), contrib
    (cost_curve,) = driver.execute_script(_DATASETS, "cost")
    points = [p for p in run["progress"] if p["eval_loss"] is not None]
    assert [p["y"] for p in cost_curve["data"]] == pytest.approx([p["eval_loss"] for p in points])
    assert len(points) == ROUNDS and run["cost"] > 0
    card = driver.execute_script("return document.getElementById('card-cost').textContent")
    assert card.startswith(f"{run['cost']:.2f}"), (card, run["cost"])
