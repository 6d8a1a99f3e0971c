"""The figures of one finished run for the knob sweep (``bench/bench_knobs.py``), and their table and plot.

Reads what every run leaves: ``summary.json`` (the launcher's summary), ``metrics.jsonl`` (rank 0's
step records) and the actors' records. One row per run; the columns are the seeds' tuning questions:
learner busy, B wanted/realised/skipped, ver lag, stale drops, rollout and learner throughput, sync
time, pack fill and validation quality.

What this module does not know: how runs are started (the sweep runner does that).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from launcher.summary import K, read_actor_records, read_metrics


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _last_per_actor(actors: list[dict[str, Any]], key: str) -> dict[tuple, float]:
    """A cumulative actor counter's final value per actor process ((rank, actor) -> value)."""
    out: dict[tuple, float] = {}
    for r in actors:
        out[(r.get("rank"), r.get("actor"))] = max(out.get((r.get("rank"), r.get("actor")), 0.0), float(r.get(key, 0)))
    return out


def run_row(run_dir: Path) -> dict[str, Any]:
    """One sweep row from a finished run directory (``error`` set when the run left no summary)."""
    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    if not path.exists():
        return {"run": run_dir.name, "error": "no summary.json (the run failed: see its logs/)"}
    s = json.loads(path.read_text())
    records = read_metrics(run_dir)
    actors = [r for r in read_actor_records(run_dir) if r.get("event") != "final"]
    train_s = sum(float(r.get("time/step", 0.0)) for r in records) or float("nan")
    b = [r for r in records if r.get(K + "step_kind_b")]
    wanted = int(s.get("policy_wanted_b", 0))
    received = sum(v for k, v in records[-1].items() if k.startswith("queue/rank") and k.endswith("/received")) if records else 0
    span = [float(r["ts"]) for r in actors if "ts" in r]
    actor_wall = (max(span) - min(span)) if len(span) > 1 else float("nan")
    ev = (s.get("eval") or {})
    syncs = [float(r["time/sync_total"]) for r in records if r.get("time/sync_total")]
    return {
        "run": run_dir.name,
        "steps": s.get("steps"), "steps_b": s.get("steps_b"), "wanted_b": wanted,
        "b_realised": (s.get("steps_b", 0) / wanted) if wanted else None,
        "skip_rate": (s.get("b_skipped_due_to_queue", 0) / wanted) if wanted else None,
        "busy": s.get("busy_fraction"), "fill_a": s.get("mean_fill_a"), "fill_b": s.get("mean_fill_b"),
        "ver_lag_mean": statistics.fmean(float(r.get(K + "ver_lag_mean", 0.0)) for r in b) if b else None,
        "ver_lag_max": max((int(r.get(K + "ver_lag_max", 0)) for r in b), default=None),
        "stale_drops": s.get("drop_stale_total"),
        "stale_rate": (s.get("drop_stale_total", 0) / received) if received else None,
        "rollouts_per_s": sum(int(r.get("rollout/samples", 0)) for r in actors) / actor_wall,
        "rollout_tokens_per_s": sum(_last_per_actor(actors, "actor/tokens_sent").values()) / actor_wall,
        "steps_per_s": len(records) / train_s,
        "learner_tokens_per_s": sum(float(r.get("packing/tokens", 0)) for r in records) / train_s,
        "sync_total_median_s": _med(syncs), "sync_stall_share": s.get("sync_stall_share"),
        "val_f1_first": (ev.get("first") or {}).get("f1"), "val_f1_best": (ev.get("best") or {}).get("f1"),
        "val_f1_last": (ev.get("last") or {}).get("f1"), "val_map_last": (ev.get("last") or {}).get("map"),
        "wall_s": s.get("wall_s"), "b_bound": (s.get("b_bound") or {}).get("bound"),
    }


COLUMNS = [("run", "{}"), ("busy", "{:.3f}"), ("wanted_b", "{}"), ("steps_b", "{}"), ("b_realised", "{:.2f}"),
           ("fill_a", "{:.2f}"), ("fill_b", "{:.2f}"), ("ver_lag_mean", "{:.2f}"), ("ver_lag_max", "{}"),
           ("stale_rate", "{:.2f}"), ("rollouts_per_s", "{:.2f}"), ("steps_per_s", "{:.2f}"),
           ("learner_tokens_per_s", "{:.0f}"), ("sync_total_median_s", "{:.3f}"), ("val_f1_first", "{:.3f}"),
           ("val_f1_last", "{:.3f}"), ("val_f1_best", "{:.3f}")]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (``-`` for a missing figure)."""
    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        v = row.get(key)
        return "-" if v is None or v != v else fmt.format(v)  # v != v: NaN
    head = "| " + " | ".join(k for k, _ in COLUMNS) + " |"
    sep = "|" + "---|" * len(COLUMNS)
    return "\n".join([head, sep] + ["| " + " | ".join(cell(r, k, f) for k, f in COLUMNS) + " |" for r in rows])


def plot(rows: list[dict[str, Any]], x_key: str, out: Path) -> None:
    """B realised fraction, learner busy, B fill and last val F1 against ``x_key`` (one PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get(x_key) is not None and "error" not in r]
    rows.sort(key=lambda r: r[x_key])
    xs = [r[x_key] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("b_realised", "B realised / wanted"), ("busy", "learner busy"), ("fill_b", "B pack fill"),
                       ("val_f1_last", "val F1 (last)")):
        ax.plot(xs, [r.get(key) for r in rows], marker="o", label=label)
    ax.set_xlabel(x_key)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_grid(rows: list[dict[str, Any]], out: Path) -> None:
    """The sync_every_steps × version_window grid: B realised and stale-drop rate, one line per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "sync_every_steps" in r and "version_window" in r and "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, key, title in ((axes[0], "b_realised", "B realised / wanted"), (axes[1], "stale_rate", "stale-drop rate")):
        for w in sorted({r["version_window"] for r in rows}):
            pts = sorted((r["sync_every_steps"], r.get(key)) for r in rows if r["version_window"] == w)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"version_window {w}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sync_every_steps")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
