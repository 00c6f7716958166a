"""Dashboard in headless Chromium: charts drawn from real signed reports, peers table filled, no console errors.

Needs the Debian packages ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them); skipped otherwise.
The screenshot is saved under the test's tmp dir and copied to docs/dashboard.png.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from _coordinator_helpers import ROOT, hello_body, make_identities, start_server

from coordinator.server import CoordinatorServer
from protocol.reports import build_report

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
PEERS, ROUNDS, STEPS_PER_ROUND = 3, 6, 5


def _missing() -> str | None:
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        return "chromium/chromedriver not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install -e '.[test]')"
    return None


@pytest.fixture
def fed_server(tmp_path: Path) -> Iterator[CoordinatorServer]:
    """A coordinator holding a small, realistic run: 3 peers, 6 rounds (one discarded), per-step metrics."""
    server = start_server(tmp_path / "db.sqlite", run_id="browser-run")
    ids = make_identities(tmp_path / "ids", PEERS)
    members = [i.peer_id for i in ids]
    devices = ["NVIDIA H100 80GB", "Apple M2", "cpu (16 cores)"]
    reports = [build_report(i, "browser-run", "hello", hello_body(device=d, tokens_per_s=1000.0 * (k + 1)))
               for k, (i, d) in enumerate(zip(ids, devices))]
    tokens = [0] * PEERS
    for rnd in range(ROUNDS):
        for k, ident in enumerate(ids):
            for s in range(STEPS_PER_ROUND):
                step = rnd * STEPS_PER_ROUND + s
                tokens[k] += 512 * (k + 1)
                loss = 5.5 * math.exp(-step / 12) + 1.2 + 0.05 * k
                reports.append(build_report(ident, "browser-run", "metrics", {
                    "step": step, "train_loss": loss, "tokens_per_s": 1000.0 * (k + 1) + 10 * s,
                    "tokens_total": tokens[k]}))
        discarded = rnd == 3
        for k, ident in enumerate(ids):
            reports.append(build_report(ident, "browser-run", "round", {
                "round": rnd, "members": members, "tokens": [512 * STEPS_PER_ROUND * (j + 1) for j in range(PEERS)],
                "state_hash": None if discarded else f"{rnd:02x}" * 32, "train_s": 5.0, "wait_s": 0.3 * k,
                "average_s": 0.8, "outcome": "discarded" if discarded else "committed",
                "failure_reason": "peer left mid all-reduce" if discarded else None,
                "eval_loss": 5.0 * math.exp(-rnd / 3) + 1.3}))
    for r in reports:
        assert requests.post(server.url + "/api/reports", data=r.encode(), timeout=10).status_code == 200
    try:
        yield server
    finally:
        server.stop()


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


def test_dashboard_shows_run(fed_server: CoordinatorServer, tmp_path: Path) -> None:
    reason = _missing()
    if reason:
        pytest.skip(reason)
    driver = _driver(tmp_path)
    try:
        driver.set_page_load_timeout(30)
        driver.get(fed_server.url + "/")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if driver.execute_script("return window.swarmloco && window.swarmloco.refreshes >= 1"):
                break
            time.sleep(0.2)
        else:
            pytest.fail("dashboard never completed a refresh: "
                        + str(driver.execute_script("return window.swarmloco && window.swarmloco.lastError")))

        lengths = lambda chart: driver.execute_script(
            f"return window.swarmlocoCharts.{chart}.data.datasets.map(d => d.data.length)")
        assert lengths("train") == [ROUNDS * STEPS_PER_ROUND] * PEERS
        assert lengths("eval") == [ROUNDS - 1]  # the discarded round adds no committed tokens or eval point
        assert lengths("throughput") == [ROUNDS * STEPS_PER_ROUND] * PEERS
        assert lengths("rounds") == [ROUNDS] * 3  # train / wait / average per round
        for canvas in ("chart-train", "chart-eval", "chart-throughput", "chart-rounds"):
            assert driver.execute_script(_CANVAS_INK, canvas) > 2000, f"{canvas} looks empty"

        rows = driver.execute_script("return [...document.querySelectorAll('#peers-table tbody tr')]"
                                     ".map(tr => [...tr.cells].map(td => td.textContent))")
        assert len(rows) == PEERS
        assert {r[2] for r in rows} == {"NVIDIA H100 80GB", "Apple M2", "cpu (16 cores)"}
        assert all(r[1] == "online" and r[6] == str(ROUNDS - 1) for r in rows)
        rounds_text = driver.execute_script("return document.querySelector('#rounds-table').textContent")
        assert "peer left mid all-reduce" in rounds_text and "discarded" in rounds_text

        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not errors, errors
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot))
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")
    finally:
        driver.quit()
