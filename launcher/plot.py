"""``python -m launcher.plot RUN_DIR``: turn a run's metrics.jsonl into PNGs.

One overview figure (``run.png``) with six panels: losses; cumulative A/B steps and skips; queue
depth; ver and ver lag; pack fill; learner busy fraction. Needs matplotlib (Agg backend, headless).
"""

from __future__ import annotations

import sys
from pathlib import Path

from launcher.summary import K, read_metrics


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    recs = read_metrics(run_dir)
    if not recs:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no records: nothing to plot")
    steps = [r.get("step", i) for i, r in enumerate(recs)]

    def series(key: str, default: float = 0.0) -> list[float]:
        return [float(r.get(key, default) or 0.0) for r in recs]

    def cumulative(key: str) -> list[int]:
        out, n = [], 0
        for r in recs:
            n += int(bool(r.get(key)))
            out.append(n)
        return out

    fig, axes = plt.subplots(3, 2, figsize=(12, 10), constrained_layout=True)
    ax = axes[0][0]
    for key in ("loss/total", "loss/ce", "loss/bbox_smoothl1", "loss/bbox_ciou"):
        ax.plot(steps, series(key), label=key.split("/")[1])
    ax.set_title("losses"); ax.legend(); ax.set_xlabel("optimizer step")

    ax = axes[0][1]
    kinds_b = cumulative(K + "step_kind_b")
    ax.plot(steps, kinds_b, label="B steps")
    ax.plot(steps, [i + 1 - b for i, b in enumerate(kinds_b)], label="A steps")
    ax.plot(steps, cumulative(K + "policy_wants_b"), "--", label="B wanted (policy)")
    ax.plot(steps, cumulative(K + "b_step_skipped_due_to_queue"), ":", label="B skipped (queue)")
    ax.set_title("A/B steps (cumulative)"); ax.legend(); ax.set_xlabel("optimizer step")

    ax = axes[1][0]
    ax.plot(steps, series(K + "queue_depth"), label="mean depth")
    ax.plot(steps, series(K + "queue_depth_min"), label="min depth over ranks")
    ax.plot(steps, series(K + "drop_stale_total"), "--", label="stale drops (total)")
    ax.plot(steps, series(K + "drop_oldest_total"), ":", label="oldest drops (total)")
    ax.set_title("ready queues"); ax.legend(); ax.set_xlabel("optimizer step")

    ax = axes[1][1]
    ax.plot(steps, series(K + "ver_current"), label="ver_current")
    ax.plot(steps, series(K + "ver_lag_mean"), label="ver lag mean (B)")
    ax.plot(steps, series(K + "ver_lag_max"), "--", label="ver lag max (B)")
    ax.set_title("versions"); ax.legend(); ax.set_xlabel("optimizer step")

    ax = axes[2][0]
    b = [bool(r.get(K + "step_kind_b")) for r in recs]
    fill = series("packing/fill")
    ax.scatter([s for s, k in zip(steps, b) if k], [f for f, k in zip(fill, b) if k], label="B packs", s=12)
    ax.scatter([s for s, k in zip(steps, b) if not k], [f for f, k in zip(fill, b) if not k], label="A packs", s=12)
    ax.set_ylim(0, 1.05); ax.set_title("mean pack fill"); ax.legend(); ax.set_xlabel("optimizer step")

    ax = axes[2][1]
    ax.plot(steps, series("learner/busy_fraction"), label="busy fraction")
    ax.plot(steps, series("time/wait_for_packs"), "--", label="wait for packs (s)")
    ax.plot(steps, series("time/wait_for_a_window"), ":", label="wait for A window (s)")
    ax.set_title("learner utilisation"); ax.legend(); ax.set_xlabel("optimizer step")

    fig.suptitle(f"tandem run: {run_dir}")
    out = run_dir / "run.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return [out]


if __name__ == "__main__":
    for p in plot_run(sys.argv[1] if len(sys.argv) > 1 else "runs/demo"):
        print(p)
