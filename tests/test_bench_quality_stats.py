"""bench/bench_quality.py's statistics (issue 34) on hand-built runs: t-intervals per arm over seeds, the
paired difference across arms by seed, the table, the plot's bands, and the larger generated validation set."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import bench_quality as bq  # noqa: E402
import quality_plot  # noqa: E402


def run(arm: str, seed: int, f1s: list[float], learner_s: list[float]) -> dict:
    curve = [{"step": 10 * i, "learner_s": s, "f1": f, "map": f / 4, "map_50": f / 2, "ver": i + 1}
             for i, (f, s) in enumerate(zip(f1s, learner_s))]
    return {"arm": arm, "seed": seed, "steps": 40, "b_steps": 0 if arm == "a_only" else 10, "learner_s": learner_s[-1],
            "curve": curve, "first": curve[0], "last": curve[-1], "best": max(curve, key=lambda c: c["f1"])}


def runs() -> list[dict]:
    out = []
    for seed, noise in enumerate([0.00, 0.04, -0.02, 0.02, -0.04]):
        out.append(run("a_only", seed, [0.30, 0.31 + noise, 0.32 + noise], [0.0, 40.0, 90.0 + seed]))
        # async is better by 0.02 +- 0.003 on every seed: the paired interval excludes 0 though the arms' overlap
        out.append(run("async_ab", seed, [0.30, 0.34 + noise, 0.34 + noise + 0.003 * (-1) ** seed],
                       [0.0, 45.0, 92.0 - seed]))
    return out


def test_each_arm_gets_a_t_interval_over_seeds_and_the_paired_difference_is_by_seed():
    stats = bq.statistics_of(runs())
    a, b = stats["per_arm"]["a_only"]["last_f1"], stats["per_arm"]["async_ab"]["last_f1"]
    assert a["n"] == b["n"] == 5 and abs(a["mean"] - 0.32) < 1e-12 and a["low"] < 0.32 < a["high"]
    assert b["low"] < a["high"]  # the unpaired intervals overlap ...
    d = stats["vs_a_only"]["async_ab"]["last_f1"]
    assert d["seeds"] == [0, 1, 2, 3, 4] and abs(d["mean"] - 0.0206) < 1e-9
    assert 0.015 < d["low"] < d["high"] < 0.026 and d["outside_noise"] is True  # ... the paired one excludes 0
    after = stats["per_arm"]["async_ab"]["mean_f1_after_start"]
    assert abs(after["mean"] - (0.34 + 0.3406) / 2) < 1e-9


def test_the_statistics_table_names_every_arm_and_the_paired_verdict():
    text = bq.stats_table(bq.statistics_of(runs()))
    assert "  a_only    n=5  F1 last 0.320 [" in text
    assert "async_ab − a_only (paired over seeds [0, 1, 2, 3, 4]): F1 last +0.021 [+0.0" in text
    assert "(outside the noise)" in text
    one = bq.stats_table(bq.statistics_of([run("a_only", 0, [0.3, 0.4], [0, 9]), run("step", 0, [0.3, 0.5], [0, 9])]))
    assert "0.400 (1 seed: no interval)" in one and "(no interval)" in one
    rows = bq.table(runs()).splitlines()
    assert rows[0].split()[:2] == ["arm", "seed"] and len(rows) == 11
    assert rows[2].split()[:2] == ["async_ab", "0"] and rows[2].split()[-1] == f"{0.343 / 0.32:.3f}"


def test_the_band_is_over_common_learner_seconds_up_to_the_shortest_run(tmp_path):
    arm = [r for r in runs() if r["arm"] == "async_ab"]
    x, mean, low, high = quality_plot.mean_band(arm, "f1")
    assert x[0] == 0.0 and x[-1] == 88.0 and len(x) == len(mean) == len(low) == 25  # seed 4 ends at 88 s
    assert all(lo <= m <= hi for lo, m, hi in zip(low, mean, high)) and high[-1] > low[-1]
    single = quality_plot.mean_band(arm[:1], "f1")
    assert single[0] == [0.0, 45.0, 92.0] and single[2] is None
    quality_plot.plot(runs(), tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 10_000


def test_a_larger_validation_set_comes_from_the_training_data_generator_and_keeps_its_val_images_first(tmp_path):
    from common.data.synthetic import generate

    train = generate(tmp_path / "d", split=(6, 2), seed=4, sides=(56,), max_objects=3)
    val = bq.larger_val_set(str(REPO / "configs/demo_cpu.yaml"), [f"data.train_jsonl={train}"], 5)
    assert val == tmp_path / "d-val5" / "val.jsonl"
    small, large = (p.read_text().splitlines() for p in (train.parent / "val.jsonl", val))
    assert len(large) == 5 and large[:2] == small  # the config's own val images are the first ones
    params = json.loads((val.parent / "manifest.json").read_text())["params"]
    assert params["sides"] == [56] and params["max_objects"] == 3 and params["seed"] == 4
    try:
        bq.larger_val_set(str(REPO / "configs/demo_cpu.yaml"), [f"data.train_jsonl={tmp_path / 'x/train.jsonl'}"], 5)
    except ValueError as exc:
        assert "data.val_jsonl=<a JSONL with >= 5 records>" in str(exc)
    else:
        raise AssertionError("no manifest must be refused")


def test_compare_runs_adds_the_last_val_f1_interval_and_the_paired_difference_to_the_first_run(tmp_path):
    from bench.compare_runs import compare
    from common.evaluation.stats import ImageCounts, f1_interval

    def write(name: str, good: int, counts: bool = True) -> Path:
        c = ImageCounts((2,) * good + (0,) * (64 - good), (2,) * 64, (2,) * 64, (0,) * 64)
        low, high = f1_interval(c)
        ev = {"record": "eval", "step": 2, "eval/f1": good / 64, "eval/f1_ci_low": low, "eval/f1_ci_high": high,
              **({"eval/image_counts": c.as_dict()} if counts else {})}
        d = tmp_path / name
        d.mkdir()
        steps = [{"step": i, "time/step": 1.0} for i in range(2)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*steps, ev]))
        return d

    base, better, old = write("a", 32), write("b", 48), write("c", 48, counts=False)
    out = compare([base, better, old])
    a, b, c = out[str(base)], out[str(better)], out[str(old)]
    assert a["val_f1_last"] == 0.5 and a["val_f1_last_ci_low"] < 0.5 < a["val_f1_last_ci_high"]
    assert "val_f1_vs_first" not in a and "val_f1_vs_first" not in c  # itself; a run without counts
    assert b["val_f1_vs_first"] == 0.25 and b["val_f1_vs_first_ci_low"] > 0 and b["val_f1_vs_first_outside_noise"]


def test_an_override_that_would_change_what_an_arm_is_is_refused_naming_it_and_the_fix(capsys):
    # applied after the arm's own keys, stage2_ab.schedule.b_ratio=0.5 once turned the A-only arm into a B arm
    every = list(bq.ARMS)
    assert bq.refused_overrides(["training.lr=1e-4", "stage2_ab.coord_ce_weight=1.0"], every) == []
    assert bq.refused_overrides(["stage2_ab.schedule.b_ratio=0.3"], ["async_ab", "step"]) == []  # a b_ratio sweep
    refused = bq.refused_overrides(["stage2_ab.schedule.b_ratio=0.5", "training.seed=3", "weight_sync.mode=overlap"],
                                   every)
    assert refused == [
        "stage2_ab.schedule.b_ratio=0.5: arm a_only is defined by stage2_ab.schedule.b_ratio=0. Fix: drop it, or "
        "leave a_only out of --arms (a B arm takes any b_ratio > 0)",
        "training.seed: the benchmark sets it for every run. Fix: drop it",
        "weight_sync.mode=overlap: arm step is defined by weight_sync.mode=blocking. Fix: drop it, or leave step out "
        "of --arms (a B arm takes any b_ratio > 0)"]
    assert bq.refused_overrides(["stage2_ab.schedule.b_ratio=0"], ["async_ab"])  # 0 would make it A-only
    try:
        bq.main(["--seeds", "1", "stage2_ab.schedule.b_ratio=0.5"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("the benchmark started with an override that changes the A-only arm")
    assert "arm a_only is defined by stage2_ab.schedule.b_ratio=0" in capsys.readouterr().err
