"""Plots of a results file: whatever plots its data allows, named ``<kind><suffix>.png``.

    python3 bench/plot_results.py RESULTS.json [...] [--kinds KIND,...] [--suffix _h200] [--label "4 x H200"]
        [--out DIR]

Kinds, each drawn where a results file holds its data:

- ``ddp_vs_fsdp``: ``ddp_vs_fsdp`` (or ``G1_ddp_vs_fsdp``), run name -> its ``summary.json``, names ending in
  ``-<ddp|fsdp>-<size>`` (the ``ddp-vs-fsdp`` scenario's runs): per-rank peak memory and step time, an 80 GB
  H100's capacity marked;
- ``stage_b_scaling``: ``bench/bench_stage_b.py --out``'s file (``rows``), or ``stage_b`` holding such rows or
  ``{"runs": {W: {batches, first_to_last_batch_s}}, "per_rank_rollout_batch_size": N}``: tickets/s against
  world size, with linear scaling for reference;
- ``quality_arms``: ``eval_curves``, arm -> [{learner_s, f1, map}]: val F1@0.5 and mAP against learner
  seconds, one line per arm (async arms named ``b<ratio>`` coloured by ratio);
- ``sweep_b_ratio``: ``sweep_rows`` with runs named ``b<ratio>`` (the ``sweep-b-ratio`` scenario's): B
  realised, stale-drop rate, B fill and val F1 against b_ratio.

The title carries ``--label`` and the file's ``date``. bench/results/ holds the committed results files;
docs/benchmarks.md names the command that drew each of its plots.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

H100_GIB = 79.2  # what torch reports as an 80 GB H100's capacity
KINDS = ("ddp_vs_fsdp", "stage_b_scaling", "quality_arms", "sweep_b_ratio")
RUN_NAME = re.compile(r"(ddp|fsdp)-([\d.]+b)$")
B_RUN = re.compile(r"^b(\d+(?:\.\d+)?)$")


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ddp_vs_fsdp(runs: dict[str, Any], title: str, path: Path) -> None:
    parsed = {RUN_NAME.search(name).groups(): r for name, r in runs.items() if RUN_NAME.search(name)}
    sizes = sorted({size for _, size in parsed}, key=lambda s: float(s[:-1]))
    fig, (mem, step) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.2
    for i, size in enumerate(sizes):
        for j, par in enumerate(("ddp", "fsdp")):
            r = parsed.get((par, size))
            if r is None:
                continue
            color = "tab:blue" if par == "ddp" else "tab:orange"
            for k, gib in enumerate(r["peak_memory_gb_by_rank"]["allocated"]):
                mem.bar(i + (j * 2 + k - 1.5) * width, gib, width, color=color, alpha=1 - 0.35 * k,
                        label=f"{par.upper()} rank {k}" if i == 0 else None)
            step.bar(i + (j - 0.5) * 0.35, r["step_time_median_s"], 0.35, color=color,
                     label=par.upper() if i == 0 else None)
    mem.axhline(H100_GIB, color="red", linestyle="--", linewidth=1, label="80 GB H100 capacity")
    for ax, name, unit in [(mem, "GPU peak allocated per rank", "GiB"), (step, "step time (median)", "s")]:
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_title(name)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.suptitle(f"learner, DDP vs FSDP2 ({title})", fontsize=10)
    _save(fig, path)


def stage_b_rates(stage_b: dict[str, Any] | list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(world size, tickets/s) from bench_stage_b.py's rows, or from per-run batch timings (batches 2..n)."""
    rows = stage_b.get("rows") if isinstance(stage_b, dict) else stage_b
    if rows is not None:
        return sorted((r["world_size"], r["tickets_per_s"]) for r in rows if r.get("tickets_per_s"))
    per_rank = stage_b["per_rank_rollout_batch_size"]
    return sorted((int(w), per_rank * int(w) * (r["batches"] - 1) / r["first_to_last_batch_s"])
                  for w, r in stage_b["runs"].items())


def plot_stage_b(rates: list[tuple[int, float]], title: str, path: Path) -> None:
    ws, rate = [w for w, _ in rates], [r for _, r in rates]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot(ws, rate, "o-", label="measured")
    ax.plot(ws, [rate[0] * w / ws[0] for w in ws], "--", color="grey", label="linear")
    ax.set_xticks(ws)
    ax.set_xlabel("world size (GPUs)")
    ax.set_ylabel("tickets / s")
    ax.set_title(f"Stage-B ({title})", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, path)


def _arm_style(name: str, ratios: list[float]) -> tuple[str, Any, str]:
    m = B_RUN.match(name)
    if m:
        i = ratios.index(float(m.group(1)))
        return f"async, b_ratio {m.group(1)}", plt.cm.viridis(i / max(1, len(ratios) - 1)), "-"
    fixed = {"a_only": ("A-only", "black", "--"), "step": ("step (synchronous)", "tab:red", "--"),
             "async_ab": ("async AB", "tab:green", "-")}
    return fixed.get(name, (name, None, ":"))


def plot_quality(curves: dict[str, list[dict[str, float]]], title: str, path: Path) -> None:
    ratios = sorted(float(m.group(1)) for m in map(B_RUN.match, curves) if m)
    fig, (f1, mp) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, c in curves.items():
        label, color, style = _arm_style(name, ratios)
        xs = [p["learner_s"] for p in c]
        f1.plot(xs, [p["f1"] for p in c], style, marker="o", color=color, label=label, linewidth=1.2, markersize=3)
        mp.plot(xs, [p["map"] for p in c], style, marker="o", color=color, linewidth=1.2, markersize=3)
    for ax, name in ((f1, "val F1@0.5"), (mp, "val mAP@[.5:.95]")):
        ax.set_xlabel("learner seconds (sum of time/step)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    f1.legend(fontsize=7)
    fig.suptitle(f"detector quality per arm ({title})", fontsize=9)
    _save(fig, path)


def plot_b_sweep(rows: list[dict[str, Any]], curves: dict[str, list[dict[str, float]]], title: str, path: Path) -> None:
    """B realised, stale-drop rate, B fill and val F1 (last; mean of the evaluations after step 0) against b_ratio."""
    picked = sorted((float(B_RUN.match(r["run"]).group(1)), r) for r in rows if B_RUN.match(r["run"]))
    bs = [b for b, _ in picked]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key, label in (("b_realised", "B realised / wanted"), ("stale_rate", "stale-drop rate"),
                       ("fill_b", "B pack fill"), ("val_f1_last", "val F1 (last)")):
        ax.plot(bs, [r.get(key) for _, r in picked], marker="o", label=label)
    post = {name: [p["f1"] for p in c if p["step"] > 0] for name, c in curves.items()}
    if all(post.get(r["run"]) for _, r in picked):
        ax.plot(bs, [sum(post[r["run"]]) / len(post[r["run"]]) for _, r in picked], marker="s", linestyle="--",
                label="val F1 (mean after step 0)")
    if post.get("a_only"):
        ax.axhline(sum(post["a_only"]) / len(post["a_only"]), color="black", linestyle=":", linewidth=1,
                   label="A-only val F1 (mean)")
    ax.set_xlabel("b_ratio")
    ax.set_xticks(bs)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"async arm, one run per b_ratio ({title})", fontsize=10)
    _save(fig, path)


def draw(res: dict[str, Any], kinds: tuple[str, ...], label: str, out: Path, suffix: str) -> list[Path]:
    """Every plot of ``kinds`` that ``res`` holds the data for; the paths written."""
    title = ", ".join(x for x in (label, res.get("date", "")) if x)
    wrote = []

    def target(kind: str) -> Path:
        wrote.append(out / f"{kind}{suffix}.png")
        return wrote[-1]

    runs = res.get("ddp_vs_fsdp") or res.get("G1_ddp_vs_fsdp")
    if "ddp_vs_fsdp" in kinds and runs:
        plot_ddp_vs_fsdp(runs, title, target("ddp_vs_fsdp"))
    stage_b = res if res.get("bench") == "stage_b" else res.get("stage_b")
    if "stage_b_scaling" in kinds and stage_b and stage_b_rates(stage_b):
        plot_stage_b(stage_b_rates(stage_b), title, target("stage_b_scaling"))
    curves = res.get("eval_curves") or {}
    if "quality_arms" in kinds and curves:
        plot_quality(curves, title, target("quality_arms"))
    if "sweep_b_ratio" in kinds and any(B_RUN.match(r.get("run", "")) for r in res.get("sweep_rows") or []):
        plot_b_sweep(res["sweep_rows"], curves, title, target("sweep_b_ratio"))
    return wrote


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results JSON files")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"a subset of {','.join(KINDS)} (default: all)")
    ap.add_argument("--suffix", default="", help="appended to each file name, e.g. _h200")
    ap.add_argument("--label", default="", help="the machine, for the titles, e.g. '4 x H200'")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if set(kinds) - set(KINDS):
        ap.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))} (known: {', '.join(KINDS)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wrote = [p for f in args.results
             for p in draw(json.loads(Path(f).read_text()), kinds, args.label, out, args.suffix)]
    if not wrote:
        print(f"none of {args.results} holds data for {', '.join(kinds)}")
        return 1
    print("wrote " + ", ".join(map(str, wrote)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
