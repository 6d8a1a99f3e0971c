"""``cd $(mktemp -d) && tandem launch --config <abs path>``: every path the launcher builds is absolute, so a
run starts from any directory (it used to look for ``<cwd>/learner/main.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ports import free_port_block

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 300


def short_config(tmp_path: Path, model: Path, data: Path) -> Path:
    """The demo topology cut to a server and one learner rank for 2 Channel-A steps, every path absolute."""
    cfg = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    http, zmq = free_port_block(1), free_port_block(2)
    cfg["model"]["path"] = str(model)
    cfg["data"].update(train_jsonl=str(data / "train.jsonl"), val_jsonl=None)
    cfg["training"].update(output_dir=str(tmp_path / "run"), max_steps=2, save_every_steps=0, save_final=False,
                           per_device_train_batch_size=1, gradient_accumulation_steps=1, eval_every_steps=0)
    cfg["stage2_ab"]["schedule"]["b_ratio"] = 0.0  # no actors: the launch, not Channel-B, is under test
    cfg["rollout_matching"]["vllm"]["servers"] = [{"base_url": f"http://127.0.0.1:{http}"}]
    cfg["rollout_server"]["port"] = http
    cfg["transport"]["base_port"] = zmq
    cfg["learner"]["nproc_per_node"] = 1
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_tandem_launch_runs_from_a_directory_outside_the_repository(tmp_path, tiny_model_dir, synth_data_dir):
    tandem = shutil.which("tandem")
    assert tandem, "no `tandem` script on PATH: `pip install -e .` registers it"
    config = short_config(tmp_path, tiny_model_dir, synth_data_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([tandem, "launch", "--config", str(config)], cwd=elsewhere, capture_output=True, text=True,
                          timeout=DEADLINE_S, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    logs = tmp_path / "run" / "logs"
    tail = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs.glob("*.log")) if logs.is_dir() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{tail}"
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "step" in s][-1] == 2
    learner = next(p for p in json.loads((tmp_path / "run" / "processes.json").read_text())["processes"]
                   if p["name"] == "learner")
    assert str(REPO / "learner" / "main.py") in learner["argv"] and str(config) in learner["argv"]
    assert list(elsewhere.iterdir()) == []  # nothing written into the directory it was started from
