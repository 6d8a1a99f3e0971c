"""The quality benchmark's figure (bench/bench_quality.py): per arm the mean val F1@0.5 and mAP curve over seeds
against learner seconds, with its 95 % t-band.

What this module does not know: how the runs were made (their dicts come from ``bench_quality.arm_figures``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.evaluation.stats import t_interval  # noqa: E402


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for key, ax, title in (("f1", axes[0], "val F1@0.5"), ("map", axes[1], "val COCO mAP@[.5:.95]")):
        for arm in dict.fromkeys(r["arm"] for r in results):
            runs = [r for r in results if r["arm"] == arm]
            band = mean_band(runs, key)
            if band is None:
                continue
            x, mean, low, high = band
            steps = sum(r["steps"] for r in runs) / len(runs)
            b_steps = sum(r["b_steps"] for r in runs) / len(runs)
            seeds = f"{len(runs)} seed{'s' * (len(runs) > 1)}"
            line, = ax.plot(x, mean, marker="o" if len(runs) == 1 else None,
                            label=f"{arm} ({b_steps:.0f} B of {steps:.0f} steps, {seeds})")
            if low is not None:
                ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(title)
        ax.set_xlabel("learner seconds (sum of time/step); bands: 95 % t-interval over seeds")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mean_band(runs: list[dict[str, Any]], key: str, points: int = 25) -> tuple | None:
    """(x, mean, low, high) of ``key`` over ``runs`` (one arm, several seeds): each run's curve interpolated onto
    common learner seconds up to the shortest run's end (evaluations fall at different seconds per seed);
    low/high the 95 % t-interval per point, None for one run (then x and mean are its own evaluations)."""
    import numpy as np

    curves = [[(c["learner_s"], c[key]) for c in r["curve"] if c[key] is not None] for r in runs]
    curves = [c for c in curves if c]
    if not curves:
        return None
    if len(curves) == 1:
        x, y = zip(*curves[0])
        return list(x), list(y), None, None
    grid = np.linspace(0.0, min(c[-1][0] for c in curves), points)
    ys = np.array([np.interp(grid, *zip(*c)) for c in curves])
    bands = [t_interval(list(col)) for col in ys.T]
    return (list(grid), [b["mean"] for b in bands], [b["low"] for b in bands], [b["high"] for b in bands])
