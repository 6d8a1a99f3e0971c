"""Converted data trains: a COCO- and an LVIS-shaped file through ``tandem data convert`` and ``tandem data check``,
then the Stage-1 warm start and a short Stage-2 run (one A step, one B step in step mode) on the result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.data_files import write_coco
from tests.test_launch_anywhere import short_config

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 300
ENV = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=DEADLINE_S, env=ENV)
    assert proc.returncode == 0, f"{argv[:4]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["coco", "lvis"])
def test_converted_coco_and_lvis_files_warm_start_and_run_a_short_stage2(fmt, tmp_path, tiny_model_dir):
    tandem = [sys.executable, "-m", "tandem"]
    ann, images = write_coco(tmp_path / "src", lvis=fmt == "lvis")
    data = tmp_path / "data"
    run(*tandem, "data", "convert", "--format", fmt, "--annotations", str(ann), "--images", str(images),
        "--out", str(data), "--max-side", "112", "--multiple-of", "28", cwd=tmp_path)
    run(*tandem, "data", "check", str(data / "train.jsonl"), "--config", str(REPO / "configs" / "demo_cpu.yaml"),
        f"model.path={tiny_model_dir}", cwd=tmp_path)

    detector = tmp_path / "detector"
    run(*tandem, "warm-start", "--config", str(REPO / "configs" / "warm_start_cpu.yaml"), "--out", str(detector),
        f"model.path={tiny_model_dir}", f"data.train_jsonl={data / 'train.jsonl'}", "data.val_jsonl=null",
        "training.max_steps=2", "training.per_device_train_batch_size=2", "training.warmup_steps=1",
        "training.progress=false", cwd=tmp_path)
    steps = [json.loads(x) for x in (detector / "warm_start_metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss/total"] > 0 for s in steps)

    config = short_config(tmp_path, detector, data)  # every path absolute, one learner rank
    cfg = yaml.safe_load(config.read_text())
    cfg["stage2_ab"]["schedule"]["b_ratio"] = 0.5  # step 0 is A, step 1 is B
    cfg["stage2_ab"]["channel_b"]["mode"] = "step"  # B rolls out inside the learner: no actors to start
    cfg["rollout_matching"]["decoding"]["max_new_tokens"] = 48
    config.write_text(yaml.safe_dump(cfg))
    run(shutil.which("tandem") or "tandem", "launch", "--config", str(config), cwd=tmp_path)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kinds = [r.get("stage2_ab/async/step_kind_b") for r in records if "step" in r and r.get("record") is None]
    assert kinds[-2:] == [0, 1], kinds  # an A step, then a B step on rollouts of the converted images
