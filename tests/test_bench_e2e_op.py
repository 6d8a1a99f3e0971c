"""bench/bench_e2e_op.py --quick: the end-to-end operating-point driver's own code on the tiny model, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server_proc import REPO


@pytest.mark.slow
def test_the_end_to_end_bench_runs_the_whole_topology_and_reports_the_run_summary(tmp_path, tiny_model_dir):
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "bench/bench_e2e_op.py", "--quick", "--work", str(tmp_path / "w"),
                           "--out", str(out), "--model", str(tiny_model_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    assert line["launcher_rc"] == 0 and line["steps"] == 6 == line["steps_a"] + line["steps_b"]
    assert line["syncs"] >= 2 and line["ver_final"] >= 2, "the quick form syncs every 2 steps"
    assert 0 < line["busy_fraction"] <= 1 and 0 <= line["sync_stall_share"] < 1
    assert line["tokens_per_s_median"] > 0 and line["mfu_median"] > 0 and line["peak_source"] == "measured"
    assert line["mean_fill_a"] > 0.5 and line["device"] == "cpu"
    assert line["model"] == str(tiny_model_dir) and line["preset"] is None and not list((tmp_path / "w").glob("model-*"))
    # a timing run writes no checkpoint: at 7b on 2 FSDP2 ranks the final one took 84 s of the call (2026-11-28)
    assert not list((tmp_path / "w" / "run").glob("checkpoints/[0-9]*")), "no checkpoint, not even the final one"


def test_a_preset_model_gets_the_widened_embedding_and_a_processor_taking_the_side_whole(tmp_path):
    """What the driver builds without --model (tools/make_tiny_model.py --vocab / --max-pixels)."""
    from tools.make_tiny_model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "m", vocab=4096, max_pixels=112 * 112)
    assert json.loads((model / "config.json").read_text())["text_config"]["vocab_size"] == 4096
    assert json.loads((model / "preprocessor_config.json").read_text())["size"]["longest_edge"] == 112 * 112
    with pytest.raises(ValueError, match="--vocab 100 < the tokenizer's"):
        ensure_tiny_model(tmp_path / "small", vocab=100)


def test_build_only_makes_the_inputs_the_run_then_reuses(tmp_path):
    argv = [sys.executable, "bench/bench_e2e_op.py", "--preset", "tiny", "--vocab", "0", "--side", "112", "--n", "4",
            "--max-objects", "3", "--work", str(tmp_path), "--build-only"]
    first = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    built = json.loads(first.stdout.strip().splitlines()[-1])
    assert (tmp_path / "model-qwen2.5-vl-tiny-v0-112" / "config.json").is_file()
    assert len((tmp_path / "data-112-3-4" / "train.jsonl").read_text().splitlines()) == 4
    again = json.loads(subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300).stdout.splitlines()[-1])
    assert {k: again[k] for k in ("model", "train")} == {k: built[k] for k in ("model", "train")}
    assert not (tmp_path / "run").exists(), "--build-only starts no launcher"


def test_the_end_to_end_bench_refuses_a_stray_argument():
    proc = subprocess.run([sys.executable, "bench/bench_e2e_op.py", "--quick", "--stesp", "3"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--stesp" in proc.stderr
