"""Plots of the 4 x H200 session (docs/benchmarks.md sections 15 and 18) from its committed results.

    python bench/plot_h200x4.py [--results bench/results/h200x4_2026-11-26.json] [--out docs]

Writes ``ddp_vs_fsdp_h200.png`` (per-rank peak memory and step time, DDP vs FSDP2 at 1.5b and 7b, with an
80 GB H100's capacity marked) and ``stage_b_scaling_h200.png`` (Stage-B tickets/s against world size, with
linear scaling for reference).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="bench/results/h200x4_2026-11-26.json")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    res = json.loads(Path(args.results).read_text())
    out = Path(args.out)
    plot_ddp_vs_fsdp(res["G1_ddp_vs_fsdp"], out / "ddp_vs_fsdp_h200.png")
    plot_stage_b(res["stage_b"], out / "stage_b_scaling_h200.png")
    print(f"wrote {out / 'ddp_vs_fsdp_h200.png'} and {out / 'stage_b_scaling_h200.png'}")


if __name__ == "__main__":
    main()
