"""bench/bench_learner_op.py --quick: the operating-point bench's own code on the tiny model, on the CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys

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


def test_a_bad_row_flag_is_refused_naming_the_option():
    bad = subprocess.run([sys.executable, "bench/bench_learner_op.py", "--quick", "--rows", "varlen+ckpt9"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rows" in bad.stderr and "ckpt2" in bad.stderr
