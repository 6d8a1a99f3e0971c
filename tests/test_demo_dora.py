"""configs/demo_cpu_qwen3_dora.yaml, shorter: the launcher's whole topology on the tiny Qwen3-VL with a DoRA adapter,
a frozen vision tower and merger/LLM learning rates: B steps trained, adapter-only syncs committed (the server
merges; the frozen tower and every unadapted base weight stay on it), a checkpoint holding the adapter, the frozen
tower's weights untouched, and every process exiting 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.ports import free_port_block

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 240
STEPS = 8


@pytest.mark.slow
def test_the_dora_demo_trains_b_steps_syncs_the_adapter_alone_and_checkpoints_it(tmp_path, tiny_qwen3_model_dir,
                                                                                         detector_data_dir):
    cfg = yaml.safe_load((REPO / "configs/demo_cpu_qwen3_dora.yaml").read_text())
    http, zmq = free_port_block(1), free_port_block(4)
    cfg["model"]["path"] = str(tiny_qwen3_model_dir)
    cfg["data"]["train_jsonl"] = str(detector_data_dir / "train.jsonl")
    cfg["training"].update(output_dir=str(tmp_path / "run"), max_steps=STEPS, save_every_steps=0)
    cfg["stage2_ab"]["schedule"]["b_ratio"] = 0.25  # B at steps 3 and 7
    cfg["weight_sync"]["every_steps"] = 3  # syncs at steps 0, 3, 6
    cfg["rollout_matching"]["decoding"]["max_new_tokens"] = 32
    cfg["rollout_matching"]["vllm"]["servers"] = [{"base_url": f"http://127.0.0.1:{http}"}]
    cfg["rollout_server"]["port"] = http
    cfg["transport"]["base_port"] = zmq
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "--config", str(path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"launcher did not finish within {DEADLINE_S} s; output tail:\n{out[-4000:]}")
    assert proc.returncode == 0, f"launcher exited {proc.returncode}:\n{out[-6000:]}"

    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"sync/' in line]
    first, last = records[0], records[-1]
    assert last["learner/steps_b_total"] >= 1 and last["learner/steps_a_total"] + last["learner/steps_b_total"] == STEPS
    assert last["sync/successes"] >= 2 and last["sync/failures"] == 0
    pushes = [r for r in records if r.get("sync/bytes")]
    assert pushes and all(r["sync/bytes"] * 5 < r["sync/skipped_bytes"] for r in pushes), \
        "an adapter sync sends the adapter, not the weights it merges into"
    # the lr after step 0's scheduler step (the end of the 2-step warmup): each group's own peak; the last
    # step's cosine reaches 0 for both, so only an early record tells the groups apart
    assert (first["train/lr_merger"], first["train/lr_llm"]) == pytest.approx((1e-3, 2e-4))
    assert "train/lr_vision" not in first
    ckpt = run / "checkpoints" / str(STEPS)
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    assert any("lora_magnitude_vector" in k for k in adapter), "a DoRA adapter has magnitudes"
    assert not any(".visual.blocks." in k for k in adapter), "the frozen vision tower got no adapter"
    base, original = load_file(ckpt / "model" / "model.safetensors"), load_file(tiny_qwen3_model_dir / "model.safetensors")
    vision = [k for k in original if ".visual." in k and ".merger" not in k and "deepstack" not in k]
    assert vision and all(torch.equal(base[k], original[k]) for k in vision)
