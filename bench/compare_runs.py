"""Side by side: runs of the same config in different modes (e.g. async vs the synchronous ``step``).

Reads each run's ``metrics.jsonl`` (``read_split``: step and evaluation records) and prints, per run, what
a user weighs when choosing a mode: training time (sum of ``time/step``, so start-up is excluded),
the time spent waiting for rollouts, B steps and the Channel-B samples and tokens they trained, and
B samples per second of training time. Ratios are taken against the first run given. Where the runs
evaluated (``"record": "eval"``): the last evaluation's val F1 with its 95 % bootstrap interval over
images, and, against the first run, the paired-bootstrap difference of the last evaluations when both
scored as many images (``eval/image_counts``; common/evaluation/stats.py; pairing assumes the same
validation set, in the same order, which the runs' ``data.val_jsonl`` must ensure): one run each, so this is the
evaluation noise only, not the seed-to-seed spread (bench/bench_quality.py --seeds measures that).

    python bench/compare_runs.py [--json OUT] RUN_DIR RUN_DIR...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.evaluation.stats import ImageCounts, paired_f1_difference  # noqa: E402
from launcher.summary import K, read_split  # noqa: E402


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def compare_one(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one run (empty dict for a run without records)."""
    if not records:
        return {}
    b = [r for r in records if r.get(K + "step_kind_b")]
    a = [r for r in records if not r.get(K + "step_kind_b")]
    train_s = sum(r.get("time/step", 0.0) for r in records)
    wait_s = sum(r.get("time/wait_for_packs", 0.0) for r in records)
    b_samples = sum(int(r.get("packing/segments", 0)) for r in b)
    return {
        "steps": len(records), "b_steps": len(b), "train_s": train_s,
        "step_s_median_a": _median([r["time/step"] for r in a if "time/step" in r]),
        "step_s_median_b": _median([r["time/step"] for r in b if "time/step" in r]),
        "wait_for_rollouts_s": wait_s, "wait_fraction": wait_s / train_s if train_s else None,
        "sync_stall_s": sum(r.get("time/sync_stall", 0.0) for r in records),
        "b_samples": b_samples, "b_tokens": sum(int(r.get("packing/tokens", 0)) for r in b),
        "b_samples_per_train_s": b_samples / train_s if train_s else None,
        "steps_per_train_s": len(records) / train_s if train_s else None,
    }


def eval_figures(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The last evaluation's F1 and its bootstrap interval (absent without evaluations)."""
    if not evals or evals[-1].get("eval/f1") is None:
        return {}
    last = evals[-1]
    return {"val_f1_last": last["eval/f1"], "val_f1_last_ci_low": last.get("eval/f1_ci_low"),
            "val_f1_last_ci_high": last.get("eval/f1_ci_high")}


def _last_counts(evals: list[dict[str, Any]]) -> ImageCounts | None:
    try:
        return ImageCounts.from_dict(evals[-1].get("eval/image_counts")) if evals else None
    except ValueError:  # a run from before the counts were recorded
        return None


def compare(run_dirs: list[Path]) -> dict[str, dict[str, Any]]:
    read = {str(d): read_split(d) for d in run_dirs}
    out = {k: {**compare_one(steps), **eval_figures(evals)} if steps else {} for k, (steps, evals) in read.items()}
    base = next(iter(out.values()), {})
    base_counts = _last_counts(next(iter(read.values()), ([], []))[1])
    for i, (run, figures) in enumerate(out.items()):
        for key in ("b_samples_per_train_s", "steps_per_train_s"):
            if figures.get(key) and base.get(key):
                figures[key.replace("_per_train_s", "_rate_vs_first")] = figures[key] / base[key]
        counts = _last_counts(read[run][1]) if i else None
        if base_counts is not None and counts is not None and (d := paired_f1_difference(base_counts, counts)):
            figures.update({"val_f1_vs_first": d["diff"], "val_f1_vs_first_ci_low": d["low"],
                            "val_f1_vs_first_ci_high": d["high"], "val_f1_vs_first_outside_noise": d["outside_noise"]})
    return out


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/compare_runs.py")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args(argv)
    out = compare(args.runs)
    for run, figures in out.items():
        print(f"[{run}] " + (", ".join(f"{k} {_fmt(v)}" for k, v in figures.items()) or "no metrics records"))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0 if all(out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
