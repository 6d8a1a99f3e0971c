"""``python -m launcher.plot RUN_DIR``: turn a run's metrics.jsonl into PNGs.

One overview figure (``run.png``) with eight panels: losses; cumulative A/B steps and skips; queue depth; ver
and ver lag (with the final ver, pushed after the last step); pack fill; learner busy fraction; rollout P/R/F1
of the B steps (from their counts); validation quality (the evaluation records: F1@0.5, mAP, mAP@.5, parse
failures). The step panels read step records only. Needs matplotlib (Agg backend, headless).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from common.runs import cli
from common.detection.matching import precision_recall_f1
from launcher.summary import K, read_final_state, read_split

#: Panel titles the tests look for.
ROLLOUT_TITLE = "rollout P/R/F1 of B steps"
EVAL_TITLE = "validation quality"


def plot_run(run_dir: str | Path) -> list[Path]:
    """Draw ``{run_dir}/run.png``; returns the files written."""
    run_dir = Path(run_dir)
    fig = build_figure(run_dir)  # selects the headless backend before pyplot is imported here
    import matplotlib.pyplot as plt

    out = run_dir / "run.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return [out]


def build_figure(run_dir: str | Path) -> Any:
    """The overview figure of a run (a matplotlib Figure, not yet saved)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    recs, evals = read_split(run_dir)
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

    fig, axes = plt.subplots(4, 2, figsize=(12, 13), constrained_layout=True)
    ax = axes[0][0]
    # A and B steps weigh different terms (the coord CE exists on A steps only), so each channel gets its own
    # curve per term: one line through both would zigzag between them and draw 0 where a term cannot exist.
    coord_ce = ("loss/coord_ce",) if any(r.get("loss/coord_ce") for r in recs) else ()
    for ch, style, is_b in (("A", "-", False), ("B", "--", True)):
        idx = [i for i, r in enumerate(recs) if bool(r.get(K + "step_kind_b")) == is_b]
        if not idx:
            continue
        for n, key in enumerate(("loss/total", "loss/ce", "loss/bbox_smoothl1", "loss/bbox_ciou",
                                 *(coord_ce if not is_b else ()))):
            vals = series(key)
            ax.plot([steps[i] for i in idx], [vals[i] for i in idx], style, color=f"C{n}",
                    label=f"{key.split('/')[1]} ({ch})")
    ax.set_title("losses"); ax.set_xlabel("optimizer step")
    ax.legend(fontsize=7, title="A steps solid, B dashed", title_fontsize=7)

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
    final = read_final_state(run_dir, recs)  # the push after the last step: what the summary's "final ver" says
    if final and final.get("ver") is not None:
        ver = int(final["ver"])
        ax.plot([steps[-1] + 1], [ver], "*", ms=12, label=f"final ver {ver} (after the last step)")
    # ver lag is a property of trained B packs: A steps have none (plotting them as 0 would claim a lag).
    b_steps = [s for s, r in zip(steps, recs) if r.get(K + "step_kind_b")]
    b_recs = [r for r in recs if r.get(K + "step_kind_b")]
    ax.plot(b_steps, [float(r.get(K + "ver_lag_mean", 0.0)) for r in b_recs], ".", label="ver lag mean (B steps)")
    ax.plot(b_steps, [float(r.get(K + "ver_lag_max", 0.0)) for r in b_recs], "x", label="ver lag max (B steps)")
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

    _rollout_panel(axes[3][0], recs)
    _eval_panel(axes[3][1], evals)
    fig.suptitle(f"tandem run: {run_dir}")
    return fig


def _rollout_panel(ax: Any, recs: list[dict[str, Any]]) -> None:
    """Per B step P/R/F1 (markers, only steps whose packs held boxes) and the run's F1 so far, all from counts."""
    pts, run_f1, seen = [], [], {"n_matched": 0, "n_pred": 0, "n_gt": 0}
    for r in recs:
        if "rollout/n_pred" not in r:  # an A step, or a B step of a run older than the counts
            continue
        n = {k: int(r.get(f"rollout/{k}", 0)) for k in seen}
        for k in seen:
            seen[k] += n[k]
        if n["n_pred"] + n["n_gt"]:
            pts.append((r["step"], *precision_recall_f1(n["n_matched"], n["n_pred"], n["n_gt"])))
        if seen["n_pred"] + seen["n_gt"]:
            run_f1.append((r["step"], precision_recall_f1(seen["n_matched"], seen["n_pred"], seen["n_gt"])[2]))
    if pts:
        steps, p, rc, f1 = zip(*pts)
        ax.plot(steps, p, "^", label="precision", ms=4)
        ax.plot(steps, rc, "v", label="recall", ms=4)
        ax.plot(steps, f1, "o", label="F1", ms=4)
    if run_f1:
        ax.plot(*zip(*run_f1), "-", label="F1 of the run so far")
    if not pts:
        ax.text(0.5, 0.5, "no B rollouts", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0, 1.05); ax.set_title(ROLLOUT_TITLE); ax.set_xlabel("optimizer step")
    if pts:
        ax.legend()


def _eval_panel(ax: Any, evals: list[dict[str, Any]]) -> None:
    """F1@0.5, mAP, mAP@.5 and parse-failure rate of each evaluation, against the step its weights were taken at."""
    drawn = False
    for key, label, style in (("eval/f1", "F1@0.5", "o-"), ("eval/map", "mAP", "s-"), ("eval/map_50", "mAP@.5", "D--"),
                              ("eval/parse_failure_rate", "parse failure rate", "x:")):
        pts = [(r["step"], r[key]) for r in evals if isinstance(r.get(key), (int, float)) and "step" in r]
        if pts:
            ax.plot(*zip(*pts), style, label=label, ms=5)
            drawn = True
    if drawn:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no evaluation records\n(data.val_jsonl unset?)", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylim(0, 1.05); ax.set_title(EVAL_TITLE); ax.set_xlabel("optimizer step")


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser("python -m launcher.plot", __doc__)
    ap.add_argument("run_dir", nargs="?", default="runs/demo", help="a run's output_dir (default: %(default)s)")
    for png in plot_run(ap.parse_args(argv).run_dir):
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
