"""Plots of the 4 x H200 sessions (docs/benchmarks.md sections 15, 16, 18 and 19) from their committed results.

    python bench/plot_h200x4.py [--results FILE ...] [--out docs]

From ``bench/results/h200x4_2026-11-26.json``: ``ddp_vs_fsdp_h200.png`` (per-rank peak memory and step time,
DDP vs FSDP2 at 1.5b and 7b, with an 80 GB H100's capacity marked) and ``stage_b_scaling_h200.png`` (Stage-B
tickets/s against world size, with linear scaling for reference). From ``h200x4_2026-11-27.json``:
``quality_arms_h200.png`` (val F1@0.5 and mAP against learner seconds: A-only, step, async at b_ratio
0.1-0.5) and ``sweep_b_ratio_h200.png`` (B realised, stale-drop rate, B fill and val F1 against b_ratio).
Each file draws the plots whose data it holds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

H100_GIB = 79.2  # what torch reports as an 80 GB H100's capacity (docs/benchmarks.md section 13)


def plot_ddp_vs_fsdp(runs: dict, path: Path) -> None:
    sizes, pars = ["1.5b", "7b"], ["ddp", "fsdp"]
    fig, (mem, step) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.2
    for i, size in enumerate(sizes):
        for j, par in enumerate(pars):
            r = runs[f"g1-{par}-{size}"]
            alloc = r["peak_memory_gb_by_rank"]["allocated"]
            for k, gib in enumerate(alloc):
                x = i + (j * 2 + k - 1.5) * width
                mem.bar(x, gib, width, color=("tab:blue" if par == "ddp" else "tab:orange"), alpha=1 - 0.35 * k,
                        label=f"{par.upper()} rank {k}" if i == 0 else None)
            step.bar(i + (j - 0.5) * 0.35, r["step_time_median_s"], 0.35,
                     color=("tab:blue" if par == "ddp" else "tab:orange"), label=par.upper() if i == 0 else None)
    mem.axhline(H100_GIB, color="red", linestyle="--", linewidth=1, label="80 GB H100 capacity")
    for ax, title, unit in [(mem, "GPU peak allocated per rank", "GiB"), (step, "step time (median of 12)", "s")]:
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.suptitle("2-rank learner, DDP vs FSDP2 (4 x H200, 2026-11-26)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stage_b(stage_b: dict, path: Path) -> None:
    runs = stage_b["runs"]
    ws = sorted(int(w) for w in runs)
    rate = []
    for w in ws:
        r = runs[str(w)]
        per_batch = stage_b["per_rank_rollout_batch_size"] * w
        rate.append(per_batch * (r["batches"] - 1) / r["first_to_last_batch_s"])  # batches 2..n
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(ws, rate, "o-", label="measured (batches 2..n)")
    ax.plot(ws, [rate[0] * w for w in ws], "--", color="grey", label="linear")
    ax.set_xticks(ws)
    ax.set_xlabel("world size (GPUs)")
    ax.set_ylabel("tickets / s")
    ax.set_title("Stage-B, 0.5b preset (4 x H200)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_quality(curves: dict, path: Path) -> None:
    """Val F1@0.5 and mAP against learner seconds, one line per arm (the async arms by b_ratio)."""
    arms = [("a_only", "A-only", "black", "--"), ("step", "step (synchronous)", "tab:red", "--")]
    arms += [(f"b{b}", f"async, b_ratio {b}", plt.cm.viridis(i / 4), "-") for i, b in enumerate((0.1, 0.2, 0.3, 0.4, 0.5))]
    fig, (f1, mp) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label, color, style in arms:
        c = curves[key]
        xs = [p["learner_s"] for p in c]
        f1.plot(xs, [p["f1"] for p in c], style, marker="o", color=color, label=label, linewidth=1.2, markersize=3)
        mp.plot(xs, [p["map"] for p in c], style, marker="o", color=color, linewidth=1.2, markersize=3)
    for ax, title in ((f1, "val F1@0.5 (64 images)"), (mp, "val mAP@[.5:.95]")):
        ax.set_xlabel("learner seconds (sum of time/step)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    f1.legend(fontsize=7)
    fig.suptitle("tiny detector from its warm start, 1 vLLM + 1 learner rank, 75 learner-s an arm (4 x H200, 2026-11-27)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_b_sweep(rows: list, curves: dict, path: Path) -> None:
    """B realised, stale-drop rate, B fill and val F1 (last; mean of the evaluations after step 0) against b_ratio."""
    by_run = {r["run"]: r for r in rows}
    bs = [0.1, 0.2, 0.3, 0.4, 0.5]
    picked = [by_run[f"b{b}"] for b in bs]
    mean_f1 = []
    for b in bs:
        post = [p["f1"] for p in curves[f"b{b}"] if p["step"] > 0]
        mean_f1.append(sum(post) / len(post))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key, label in (("b_realised", "B realised / wanted"), ("stale_rate", "stale-drop rate"),
                       ("fill_b", "B pack fill"), ("val_f1_last", "val F1 (last)")):
        ax.plot(bs, [r.get(key) for r in picked], marker="o", label=label)
    ax.plot(bs, mean_f1, marker="s", linestyle="--", label="val F1 (mean after step 0)")
    a_only = [p["f1"] for p in curves["a_only"] if p["step"] > 0]
    ax.axhline(sum(a_only) / len(a_only), color="black", linestyle=":", linewidth=1, label="A-only val F1 (mean)")
    ax.set_xlabel("b_ratio")
    ax.set_xticks(bs)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("async arm, one run per b_ratio (4 x H200, 2026-11-27)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DEFAULT_RESULTS = ["bench/results/h200x4_2026-11-26.json", "bench/results/h200x4_2026-11-27.json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", nargs="+", default=DEFAULT_RESULTS)
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    out = Path(args.out)
    wrote = []
    for results in args.results:
        res = json.loads(Path(results).read_text())
        if "G1_ddp_vs_fsdp" in res:
            plot_ddp_vs_fsdp(res["G1_ddp_vs_fsdp"], out / "ddp_vs_fsdp_h200.png")
            wrote.append("ddp_vs_fsdp_h200.png")
        if "stage_b" in res and "runs" in res["stage_b"]:
            plot_stage_b(res["stage_b"], out / "stage_b_scaling_h200.png")
            wrote.append("stage_b_scaling_h200.png")
        if "eval_curves" in res:
            plot_quality(res["eval_curves"], out / "quality_arms_h200.png")
            plot_b_sweep(res["sweep_rows"], res["eval_curves"], out / "sweep_b_ratio_h200.png")
            wrote += ["quality_arms_h200.png", "sweep_b_ratio_h200.png"]
    if not wrote:
        raise SystemExit(f"none of {args.results} holds data this script plots")
    print("wrote " + ", ".join(str(out / w) for w in wrote))


if __name__ == "__main__":
    main()
