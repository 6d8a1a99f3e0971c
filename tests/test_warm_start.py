"""``python -m learner.warm_start``: config checks, a real 3-step build of the tiny model, the build cache, refusals.

The real config (configs/warm_start_cpu.yaml, 2500 steps) with overrides: 3 steps, batch 2, the test
model and dataset (private copies, so a concurrent rebuild of the shared artifacts cannot change the
build parameters under the test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.config.load import load_config
from learner.warm_start import BUILD_FILE, METRICS_FILE, build_params, check_config, ensure_warm_start, main
from tests.test_learner_harness import private_copy

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "warm_start_cpu.yaml"
STEPS = 3
CLI_DEADLINE_S = 300


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir, synth_data_dir):
    root = tmp_path_factory.mktemp("warm-start")
    model, data = private_copy(tiny_model_dir, root / "model"), private_copy(synth_data_dir, root / "data")
    overrides = [f"model.path={model}", f"data.train_jsonl={data / 'train.jsonl'}",
                 f"data.val_jsonl={data / 'val.jsonl'}", f"training.max_steps={STEPS}",
                 "training.per_device_train_batch_size=2", "training.log_every_steps=1", "training.warmup_steps=1",
                 f"training.output_dir={root / 'unused'}", "training.progress=false"]
    return {"root": root, "model": model, "data": data, "overrides": overrides}


def cfg_of(overrides: list[str]):
    return load_config(CONFIG, overrides, world_size=1)


@pytest.fixture(scope="module")
def built(inputs):
    """One build through the real entry point (a subprocess, as `make tiny-detector` runs it)."""
    out = inputs["root"] / "detector"
    cmd = [sys.executable, "-m", "learner.warm_start", "--config", str(CONFIG), "--out", str(out), *inputs["overrides"]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CLI_DEADLINE_S,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert proc.returncode == 0, f"warm start exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return {"out": out, "stdout": proc.stdout}


def test_check_config_names_the_key_and_the_fix_for_coord_ce_weight_zero_and_a_b_ratio(inputs):
    assert check_config(cfg_of(inputs["overrides"])) == []
    problems = check_config(cfg_of([*inputs["overrides"], "stage2_ab.coord_ce_weight=0",
                                    "stage2_ab.schedule.b_ratio=0.5"]))
    assert len(problems) == 2, problems
    coord = next(p for p in problems if p.startswith("stage2_ab.coord_ce_weight"))
    ratio = next(p for p in problems if p.startswith("stage2_ab.schedule.b_ratio"))
    assert "Fix: set stage2_ab.coord_ce_weight: 1.0" in coord
    assert "Fix: set stage2_ab.schedule.b_ratio: 0" in ratio


@pytest.mark.parametrize("bad", ["stage2_ab.coord_ce_weight=0", "stage2_ab.schedule.b_ratio=0.5"])
def test_the_cli_exits_2_on_a_config_unfit_for_a_warm_start_and_builds_nothing(inputs, bad, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["--config", str(CONFIG), "--out", str(out), *inputs["overrides"], bad]) == 2
    err = capsys.readouterr().err
    assert bad.split("=")[0] in err and "Fix:" in err
    assert not out.exists()


@pytest.mark.slow
def test_a_three_step_build_is_a_loadable_model_with_coord_tokens_and_new_weights(inputs, built):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from common.detection.coord_tokens import require_coord_tokens

    out = built["out"]
    assert "built" in built["stdout"] and f"{STEPS} steps" in built["stdout"]
    tok = AutoTokenizer.from_pretrained(out)
    base_tok = AutoTokenizer.from_pretrained(inputs["model"])
    assert require_coord_tokens(tok, str(out)) == require_coord_tokens(base_tok, str(inputs["model"]))
    new = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    old = AutoModelForImageTextToText.from_pretrained(inputs["model"]).state_dict()
    assert new.keys() == old.keys()
    changed = [k for k in new if not torch.equal(new[k], old[k])]
    assert len(changed) > len(new) // 2, f"only {len(changed)} of {len(new)} tensors changed"
    assert not list(out.parent.glob(f".{out.name}.tmp-*")), "the private build folder was left behind"


@pytest.mark.slow
def test_the_build_record_holds_the_params_and_three_steps_and_metrics_show_coord_ce(inputs, built):
    info = json.loads((built["out"] / BUILD_FILE).read_text())
    assert info["params"] == build_params(cfg_of(inputs["overrides"]))
    assert info["result"]["steps"] == STEPS
    lines = [json.loads(x) for x in (built["out"] / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for r in lines:
        assert r["loss/coord_ce"] > 0, r
        assert r["loss/total"] > r["loss/coord_ce"]  # CE + geometry + coord CE
    assert info["result"]["final"]["loss/coord_ce"] == lines[-1]["loss/coord_ce"]


@pytest.mark.slow
def test_a_second_identical_call_reuses_the_build_without_touching_a_file(inputs, built):
    out = built["out"]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    path, built_now = ensure_warm_start(cfg_of(inputs["overrides"]), out)
    assert (path, built_now) == (out, False)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


@pytest.mark.slow
def test_changing_the_learning_rate_rebuilds(inputs, built, tmp_path):
    out = private_copy(built["out"], tmp_path / "detector")  # this test's own folder, holding the first build
    cfg = cfg_of(inputs["overrides"])
    assert ensure_warm_start(cfg, out) == (out, False)
    cfg2 = cfg_of([*inputs["overrides"], "training.lr=1.0e-4"])
    assert build_params(cfg2) != build_params(cfg)
    first = json.loads((out / BUILD_FILE).read_text())
    path, built_now = ensure_warm_start(cfg2, out)
    assert built_now and path == out
    second = json.loads((out / BUILD_FILE).read_text())
    assert second["params"] == build_params(cfg2) and second["params"]["training"]["lr"] == 1.0e-4
    assert first["params"]["training"]["lr"] == 2.0e-3


def test_out_equal_to_model_path_is_refused(inputs, capsys):
    before = sorted(p.name for p in inputs["model"].iterdir())
    with pytest.raises(FileExistsError, match="model.path"):
        ensure_warm_start(cfg_of(inputs["overrides"]), inputs["model"])
    assert main(["--config", str(CONFIG), "--out", str(inputs["model"]), *inputs["overrides"]]) == 2
    assert "model.path" in capsys.readouterr().err
    assert sorted(p.name for p in inputs["model"].iterdir()) == before


def test_an_out_folder_with_foreign_content_is_refused_and_left_alone(inputs, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="not written by learner.warm_start"):
        ensure_warm_start(cfg_of(inputs["overrides"]), out)
    assert main(["--config", str(CONFIG), "--out", str(out), *inputs["overrides"]]) == 2
    assert "pick another --out" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_two_torchrun_ranks_train_their_own_shards_with_ddp_and_rank_0_alone_writes(inputs, built):
    # torchrun --nproc_per_node=2 (gloo on the CPU): a step is 2 x per_device samples, the logged loss the ranks'
    # mean, one metrics line a step; the build record says 2 ranks, so it is not the one-rank build's cache.
    from safetensors.torch import load_file

    out = inputs["root"] / "detector-2ranks"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "learner.warm_start", "--config", str(CONFIG), "--out", str(out), *inputs["overrides"],
           "learner.backend=gloo"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CLI_DEADLINE_S,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("warm start: ") == 1  # rank 0 reports; rank 1 only trained
    info = json.loads((out / BUILD_FILE).read_text())
    one_rank = json.loads((built["out"] / BUILD_FILE).read_text())
    assert info["params"] == {"ranks": 2, **one_rank["params"]}
    assert info["result"]["ranks"] == 2 and info["result"]["samples_drawn"] == 2 * STEPS * 2  # ranks x steps x batch
    assert one_rank["result"]["samples_drawn"] == STEPS * 2
    lines = [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1)) and {r["ranks"] for r in lines} == {2}
    base, two, one = (load_file(next(d.glob("*.safetensors"))) for d in (inputs["model"], out, built["out"]))
    moved = [k for k in base if k in two and not torch.equal(base[k], two[k])]
    assert moved and any(not torch.equal(two[k], one[k]) for k in moved)  # trained, and not the one-rank run


@pytest.mark.slow
def test_a_time_budget_stops_the_build_and_saves_what_it_trained(inputs, tmp_path):
    """``training.max_train_seconds`` ends the warm start after the step that spends it and saves that model (a GPU
    stage's deadline killed a warm start that had planned its steps from a faster calibration: nothing was saved)."""
    cfg = cfg_of([*inputs["overrides"], "training.max_steps=100000", "training.max_train_seconds=2"])
    out = tmp_path / "budgeted"
    path, built_now = ensure_warm_start(cfg, out)
    info = json.loads((out / BUILD_FILE).read_text())
    steps = info["result"]["steps"]
    assert built_now and path == out and 2 <= steps < 100000
    assert info["params"]["max_train_seconds"] == 2 and "max_train_seconds" not in build_params(cfg_of(inputs["overrides"]))
    lines = [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines()]
    assert lines[-1]["step"] == steps, "the last step's record is written"
    assert sum(r["time/step"] for r in lines[1:]) >= 2, "it stopped only once the budget was spent"
    from transformers import AutoModelForImageTextToText

    assert AutoModelForImageTextToText.from_pretrained(out) is not None
