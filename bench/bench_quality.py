"""Quality per learner-second: A-only vs async AB vs the synchronous ``step`` mode, from one warm start.

    python bench/bench_quality.py [--config configs/demo_cpu.yaml] [--budget-s 90] [--eval-every 25]
        [--arms a_only,async_ab,step] [--out runs/bench-quality] [--quick] [--json OUT] [key=value ...]

Every arm is the real topology (``python -m launcher``: rollout server, actors where the mode has them,
the torchrun learner) started from the config's ``model.path`` (the Stage-1 warm start) with the same
data, seed, batch and learning rate, and stopped by the same learner-time budget
(``training.max_train_seconds``: the sum of ``time/step`` after the process's first step, so start-up (the
first step's start-up sync and CUDA initialisation) and evaluation threads are not charged, sync stalls and
waits for rollouts are). The learner evaluates ``data.val_jsonl`` at step 0,
every ``--eval-every`` steps and at the end (learner/evaluation.py). Arms:

- ``a_only``:   ``b_ratio 0`` — supervised steps only; no actors are started.
- ``async_ab``: ``b_ratio 0.5``, mode ``async`` — tandem's actor-learner runtime.
- ``step``:     ``b_ratio 0.5``, mode ``step`` with ``enable_pipeline`` — the synchronous baseline
                (rollouts inside the learner's B steps, one learner process).

Every arm runs ONE learner rank (``step`` cannot run more), so the comparison is per learner. Output:
``<out>/<arm>/`` (each a normal run directory), ``<out>/quality.json`` and ``<out>/quality.png``
(val F1@0.5 and mAP against learner seconds). The table: first, last and best F1/mAP, learner seconds,
steps, B steps, and the ratio of each arm's final F1 to the A-only arm's.

``--quick`` (what ``make test`` runs, so the script cannot rot): a 4-second budget and one evaluation
at each end — it checks the plumbing, not the quality.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.summary import read_split  # noqa: E402

ARMS: dict[str, list[str]] = {
    "a_only": ["stage2_ab.schedule.b_ratio=0"],
    "async_ab": ["stage2_ab.schedule.b_ratio=0.5", "stage2_ab.channel_b.mode=async"],
    "step": ["stage2_ab.schedule.b_ratio=0.5", "stage2_ab.channel_b.mode=step",
             "stage2_ab.channel_b.enable_pipeline=true", "stage2_ab.channel_b.async.sync_mode=blocking"],
}


def run_arm(name: str, args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """Start one arm through the launcher (deadline: the budget plus start-up and evaluation room)."""
    out = Path(args.out) / name
    argv = [sys.executable, "-m", "launcher", "--config", args.config, *ARMS[name],
            f"training.output_dir={out}", f"run_name=bench-quality-{name}", "learner.nproc_per_node=1",
            f"training.max_train_seconds={args.budget_s}", "training.max_steps=100000",
            f"training.eval_every_steps={args.eval_every}", "training.save_every_steps=0",
            "training.overwrite=true", *overrides]  # a re-run moves the arm's previous run aside (never deletes)
    launcher_out = Path(args.out) / f"{name}.launcher.out"  # beside the run: the run dir may be moved aside
    launcher_out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(launcher_out, "w") as log:
        proc = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.budget_s * 3 + 300)
    steps, evals = read_split(out)
    if proc.returncode != 0 or not steps:
        raise RuntimeError(f"arm {name} failed (exit {proc.returncode}, {len(steps)} step records); "
                           f"see {launcher_out} and {out / 'logs'}")
    return arm_figures(name, steps, evals, wall_s=time.monotonic() - t0)


def learner_seconds_at(steps: list[dict[str, Any]], step: float) -> float:
    """Learner seconds spent before optimizer step ``step``: the sum of time/step after the run's first step,
    as ``training.max_train_seconds`` counts them (the first step is start-up: :func:`arm_figures` reports it)."""
    first = min((r.get("step", 0) for r in steps), default=0)
    return sum(r.get("time/step", 0.0) for r in steps if first < r.get("step", 0) < step)


def arm_figures(name: str, steps: list[dict[str, Any]], evals: list[dict[str, Any]], *, wall_s: float) -> dict[str, Any]:
    """The curve (learner seconds → F1, mAP) and the headline numbers of one arm."""
    curve = [{"step": e["step"], "learner_s": learner_seconds_at(steps, e["step"]), "f1": e.get("eval/f1"),
              "map": e.get("eval/map"), "map_50": e.get("eval/map_50"), "ver": e.get("eval/ver")} for e in evals]
    scored = [c for c in curve if c["f1"] is not None]
    return {
        "arm": name, "steps": len(steps), "b_steps": sum(1 for r in steps if r.get("stage2_ab/async/step_kind_b")),
        "learner_s": learner_seconds_at(steps, float("inf")),
        "startup_step_s": min(steps, key=lambda r: r.get("step", 0)).get("time/step") if steps else None,
        "wall_s": wall_s,
        "wait_for_rollouts_s": sum(r.get("time/wait_for_packs", 0.0) for r in steps),
        "curve": curve, "first": scored[0] if scored else None, "last": scored[-1] if scored else None,
        "best": max(scored, key=lambda c: c["f1"]) if scored else None,
    }


def table(results: list[dict[str, Any]]) -> str:
    base = next((r for r in results if r["arm"] == "a_only" and r["last"]), None)
    lines = [f"{'arm':9} {'learner s':>9} {'steps':>6} {'B':>4} {'F1 first':>8} {'F1 last':>8} {'F1 best':>8} "
             f"{'mAP last':>8} {'mAP50 last':>10} {'F1 vs A-only':>12}"]
    for r in results:
        first, last, best = r["first"] or {}, r["last"] or {}, r["best"] or {}
        ratio = (last["f1"] / base["last"]["f1"]) if base and last and base["last"]["f1"] else None

        def f(v: Any, w: int = 8) -> str:
            return f"{v:{w}.3f}" if isinstance(v, (int, float)) else f"{'n/a':>{w}}"

        lines.append(f"{r['arm']:9} {r['learner_s']:9.1f} {r['steps']:6d} {r['b_steps']:4d} {f(first.get('f1'))} "
                     f"{f(last.get('f1'))} {f(best.get('f1'))} {f(last.get('map'))} {f(last.get('map_50'), 10)} "
                     f"{f(ratio, 12)}")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for key, ax, title in (("f1", axes[0], "val F1@0.5"), ("map", axes[1], "val COCO mAP@[.5:.95]")):
        for r in results:
            pts = [(c["learner_s"], c[key]) for c in r["curve"] if c[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{r['arm']} ({r['b_steps']} B of {r['steps']} steps)")
        ax.set_title(title)
        ax.set_xlabel("learner seconds (sum of time/step)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/bench_quality.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo_cpu.yaml")
    ap.add_argument("--budget-s", type=float, default=90.0, help="learner seconds per arm (default %(default)s)")
    ap.add_argument("--eval-every", type=int, default=25, help="optimizer steps between evaluations")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    ap.add_argument("--out", default="runs/bench-quality")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="4 s per arm, evaluation at the ends only: a smoke run")
    args, overrides = ap.parse_known_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if bad := [a for a in arms if a not in ARMS]:
        ap.error(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    if args.quick:
        args.budget_s, args.eval_every = 4.0, 0
    results = []
    for name in arms:
        print(f"arm {name}: {args.budget_s:g} learner seconds ...", flush=True)
        results.append(run_arm(name, args, overrides))
    out = Path(args.out)
    payload = {"config": args.config, "budget_s": args.budget_s, "overrides": overrides, "arms": results}
    (out / "quality.json").write_text(json.dumps(payload, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=1))
    plot(results, out / "quality.png")
    print(table(results))
    print(f"curves: {out / 'quality.png'}; figures: {out / 'quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
