"""bench/bench_learner_op.py --quick: the operating-point bench's own code on the tiny model, on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.server_proc import REPO

FIELDS = ("tokens_per_s", "mfu", "peak_gib", "kernel_launches_per_step", "vision_s", "lm_s", "loss_s", "step_s")


def test_the_operating_point_bench_prints_one_json_line_per_row_with_its_split(tmp_path):
    out = tmp_path / "op.json"
    proc = subprocess.run([sys.executable, "bench/bench_learner_op.py", "--quick", "--rows", "sdpa,varlen+ckpt2",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    setup, rows = lines[0]["setup"], lines[1:]
    assert [(r["row"], r["checkpoint_every"]) for r in rows] == [("sdpa", 1), ("varlen+ckpt2", 2)]
    assert rows == json.loads(out.read_text())["rows"], "the file holds the printed rows"
    assert setup["packs"] >= 1 and all(t >= 0.9 * setup["packing_length"] for t in setup["pack_tokens"])
    assert setup["lm_params_non_embedding"] > 0 and setup["peak_tflops"] > 0
    for r in rows:
        assert set(FIELDS) <= set(r), r
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"], r
        assert r["tokens_per_step"] in setup["pack_tokens"], "a step trains one whole pack"
        parts = sum(r[k] for k in ("inputs_s", "vision_s", "lm_s", "loss_s", "optimizer_s"))
        assert 0 < parts <= r["step_s"] * 1.05, f"the split must lie within the step: {r}"
        assert r["vision_s"] > 0 and r["lm_s"] > 0 and r["loss_s"] > 0, r
        assert r["peak_gib"] is None and r["kernel_launches_per_step"] is None, "no GPU here: absent, not 0"
        assert r["top_ops"] and (tmp_path / f"op-{r['row'].replace('+', '-')}.txt").read_text().count("aten::") > 3
        assert all(math.isfinite(x) for x in r["losses"]), r


@pytest.mark.parametrize("recipe", ["freeze-vision", "lora"])
def test_the_users_recipes_train_what_they_name_and_keep_the_split(tmp_path, recipe):
    """--recipe runs the learner's own recipe code: a frozen vision tower has no backward in the split (its
    forward stays), an adapter trains a small share of the weights while MFU keeps the model's LM as its base."""
    proc = subprocess.run([sys.executable, "bench/bench_learner_op.py", "--quick", "--recipe", recipe, "--rows",
                           "varlen+chunked"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    setup, row = lines[0]["setup"], lines[1]
    trainable = setup["trainable_params"]
    assert setup["recipe"] == recipe
    if recipe == "freeze-vision":
        assert trainable["vision"] == 0 and trainable["llm"] > 0 and trainable["merger"] > 0, trainable
    else:  # rank-16 adapters everywhere: far fewer trained weights than the LM's own
        assert 0 < sum(trainable.values()) < 0.5 * setup["lm_params_non_embedding"], trainable
        assert trainable["vision"] > 0, "all-linear adapts the vision tower too"
    assert row["vision_s"] > 0 and row["lm_s"] > 0 and row["tokens_per_s"] > 0 and row["mfu"] > 0, row
    assert all(math.isfinite(x) for x in row["losses"]), row


def test_the_medians_leave_out_the_steps_in_which_any_rank_compiled(monkeypatch):
    """A new pack length recompiles every kind of layer (9-24 s a step at 3b and 7b): such a step would be the
    median of 4 timed steps' upper half. One rank compiling stalls the others, so the step goes for every rank."""
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the script imports its folder's op_inputs
    spec = importlib.util.spec_from_file_location("bench_learner_op", REPO / "bench/bench_learner_op.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rank0 = [{"compiled": 3}, {"compiled": 0}, {"compiled": 0}, {"compiled": 0}]
    rank1 = [{"compiled": 0}, {"compiled": 0}, {"compiled": 2}, {"compiled": 0}]
    assert bench.steady_steps([rank0, rank1]) == [1, 3]
    assert bench.steady_steps([[{"compiled": 1}] * 2]) == [0, 1], "none clean: every step rather than nothing"


def test_a_bad_row_flag_is_refused_naming_the_option():
    bad = subprocess.run([sys.executable, "bench/bench_learner_op.py", "--quick", "--rows", "varlen+ckpt9"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rows" in bad.stderr and "ckpt2" in bad.stderr


def test_under_torchrun_two_ranks_train_their_own_packs_wrapped_as_the_learner_wraps_them(tmp_path):
    """2 gloo ranks, FSDP2: one setup line and one line per row (rank 0's), all ranks' tokens in the figure."""
    out = tmp_path / "op2.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "bench/bench_learner_op.py", "--quick", "--parallel", "fsdp", "--rows", "varlen+chunked",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 2, "rank 0 alone prints: the setup and the row"
    setup, row = lines[0]["setup"], lines[1]
    assert (setup["ranks"], setup["parallel"], row["ranks"], row["parallel"]) == (2, "fsdp", 2, "fsdp")
    assert json.loads(out.read_text())["rows"] == [row]
    # one step: both ranks' tokens over the slower rank's step; the ranks meet at the reduce-scatter, so the steps
    # are nearly equal and the figure is ~2x rank 0's own tokens over its own step
    assert row["tokens_per_s"] > 1.5 * row["tokens_per_step"] / row["step_s"], row
    assert all(math.isfinite(x) for x in row["losses"]), row["losses"]
    assert len(row["rank_step_s"]) == len(row["graphs_compiled_in_timed_steps"]) == 2  # each rank's own, side by side
    assert max(row["rank_step_s"][0] + row["rank_step_s"][1]) == pytest.approx(row["step_s"], rel=0.5)
    table = (tmp_path / "op2-varlen-chunked.txt").read_text()  # the profiled step: by host time, and by Python frame
    assert table.count("Self CPU time total") == 2 and ".py(" in table, table[-2000:]


def test_under_torchrun_every_row_shares_one_compile_setting():
    bad = subprocess.run([sys.executable, "bench/bench_learner_op.py", "--quick", "--rows", "varlen,varlen+compile"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "WORLD_SIZE": "2"})
    assert bad.returncode == 2 and "+compile on every row or on none" in bad.stderr, bad.stderr
