"""Using the result: `swarmloco export` writes the agreed θ of a peer's checkpoint as plain safetensors that load into
the task's own model class without swarmloco's checkpoint code, and give the eval loss the run reported;
`swarmloco sample` prints text generated from a prompt, reproducibly for one seed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _coordinator_helpers import ROOT, child_env
from safetensors import safe_open
from safetensors.torch import load_file

from swarmloco.peer.data import ShardSpec
from swarmloco.peer.model import GPT
from swarmloco.peer.presets import GPTConfig
from swarmloco.peer.task import TaskContext, default_task

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarmloco.cli", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=240, check=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export")
    run = _cli("peer", "--solo", "--preset", "tiny", "--max-rounds", "3", "--inner-steps", "10", "--threads", "1",
               "--batch-size", "4", "--workdir", str(root / "w"), "--summary-json", str(root / "summary.json"),
               "--log-format", "json")
    assert run.returncode == 0, run.stderr[-3000:]
    return root


def test_the_exported_model_loads_plainly_and_gives_the_runs_eval_loss(trained: Path) -> None:
    out = trained / "model.safetensors"
    done = _cli("export", "--workdir", str(trained / "w"), "--out", str(out))
    assert done.returncode == 0 and "round 3" in done.stdout, done.stderr[-2000:]
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    config = json.loads(meta["task_config"])
    model = GPT(GPTConfig(**{k: config[k] for k in ("vocab_size", "context", "d_model", "n_layers", "n_heads")}))
    model.load_state_dict(load_file(str(out)), strict=True)
    task = default_task(TaskContext(shard=ShardSpec(index=0, count=1), seed=0, data_seed=0, preset="tiny"))
    reported = json.loads((trained / "summary.json").read_text())["final_eval_loss"]
    assert task.evaluate(model.eval()) == pytest.approx(reported, abs=1e-4)
    checkpoint = json.loads((trained / "w" / "checkpoint" / "state.json").read_text())
    assert meta["state_hash"] == checkpoint["state_hash"] and meta["round"] == "3"


def test_a_tampered_checkpoint_is_not_exported(trained: Path, tmp_path: Path) -> None:
    import shutil

    work = tmp_path / "w"
    shutil.copytree(trained / "w" / "checkpoint", work / "checkpoint")
    sidecar = work / "checkpoint" / "state.json"
    meta = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**meta, "state_hash": "0" * 64}))
    done = _cli("export", "--workdir", str(work), "--out", str(tmp_path / "m.safetensors"))
    assert done.returncode == 2 and "do not hash to the recorded state" in done.stderr
    assert not (tmp_path / "m.safetensors").exists()
    empty = _cli("export", "--workdir", str(tmp_path / "nothing"), "--out", str(tmp_path / "m.safetensors"))
    assert empty.returncode == 2 and "no readable checkpoint" in empty.stderr


def test_sample_prints_the_prompt_and_what_follows_reproducibly(trained: Path) -> None:
    args = ["sample", "--checkpoint", str(trained / "w"), "--prompt", "def ", "--tokens", "40", "--seed", "3"]
    first, again = _cli(*args), _cli(*args)
    assert first.returncode == 0 and first.stdout.startswith("def ") and first.stdout == again.stdout
    assert len(first.stdout.encode()) >= len("def ") + 1
    assert _cli("sample", "--checkpoint", str(trained / "w"), "--tokens", "0").returncode == 2
