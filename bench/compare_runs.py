"""Side by side: runs of the same config in different modes (e.g. async vs the synchronous ``step``).

Reads each run's ``metrics.jsonl`` step records (``read_metrics``: evaluation records are left out) and prints, per run, what
a user weighs when choosing a mode: training time (sum of ``time/step``, so start-up is excluded),
the time spent waiting for rollouts, B steps and the Channel-B samples and tokens they trained, and
B samples per second of training time. Ratios are taken against the first run given.

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

from launcher.summary import K, read_metrics  # noqa: E402


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


def compare(run_dirs: list[Path]) -> dict[str, dict[str, Any]]:
    out = {str(d): compare_one(read_metrics(d)) for d in run_dirs}
    base = next(iter(out.values()), {})
    for figures in out.values():
        for key in ("b_samples_per_train_s", "steps_per_train_s"):
            if figures.get(key) and base.get(key):
                figures[key.replace("_per_train_s", "_rate_vs_first")] = figures[key] / base[key]
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
