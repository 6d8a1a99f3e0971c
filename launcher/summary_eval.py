"""The run summary's validation part: first, best and last evaluation, their intervals and the paired change.

``summarize_evals`` turns the run's evaluation records (``{"record": "eval", ...}`` in metrics.jsonl) into the
``eval`` block of summary.json; ``eval_lines`` prints it (launcher/summary.py puts the lines in place). Knows
nothing about how the evaluations were produced (learner/evaluation.py, common/evaluation/).
"""

from __future__ import annotations

from typing import Any


EVAL_KEYS = ("precision", "recall", "f1", "f1_ci_low", "f1_ci_high", "map", "map_50", "map_per_class",
             "parse_failure_rate", "truncated_rate", "objects_per_image", "gt_per_image", "n_images", "mean_matched_iou",
             "duplicate_rate", "ver")


def summarize_evals(evals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """First, best (highest ``eval/f1``; the later on ties) and last evaluation, or None without any."""
    if not evals:
        return None

    def point(r: dict[str, Any]) -> dict[str, Any]:
        return {"step": r.get("step"), **{k: r.get(f"eval/{k}") for k in EVAL_KEYS}}

    scored = [r for r in evals if isinstance(r.get("eval/f1"), (int, float))]
    best = max(reversed(scored), key=lambda r: r["eval/f1"]) if scored else None
    return {"n": len(evals), "best_by": "f1", "first": point(evals[0]),
            "best": point(best) if best is not None else None, "last": point(evals[-1]),
            "f1_change": f1_change(evals[0], evals[-1]) if len(evals) > 1 else None}


def f1_change(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any] | None:
    """Last − first val F1 with its paired-bootstrap interval over the same images (common/evaluation/stats.py);
    None when a record lacks ``eval/image_counts`` (older runs) or the two scored different image counts."""
    from common.evaluation.stats import ImageCounts, paired_f1_difference

    try:
        before, after = (ImageCounts.from_dict(r.get("eval/image_counts")) for r in (first, last))
    except ValueError:
        return None
    return paired_f1_difference(before, after)


def eval_lines(ev: dict[str, Any] | None, val_jsonl: Any, f: Any) -> list[str]:
    """``val F1@0.5 / mAP first → best → last`` and the last evaluation's parse failures and box counts."""
    if not ev:
        if val_jsonl is False:
            return ["validation             no evaluation (data.val_jsonl unset)"]
        if val_jsonl:
            return [f"validation             no evaluation records (data.val_jsonl = {val_jsonl}; did the run reach "
                    "its first evaluation? see the learner log)"]
        return ["validation             no evaluation records"]

    def at(p: dict[str, Any] | None) -> str:
        return "n/a" if p is None else f"{f(p.get('f1'))} / {f(p.get('map'))} (step {p.get('step')})"

    last = ev["last"]
    one = lambda x, fmt: "n/a" if not isinstance(x, (int, float)) else format(x, fmt)  # noqa: E731
    lines = [
        f"val F1@0.5 / mAP       first {at(ev['first'])} → best {at(ev['best'])} → last {at(last)}",
        f"val parse fail / obj   {one(last.get('parse_failure_rate'), '.2f')} / "
        f"{one(last.get('objects_per_image'), '.1f')} per image (GT {one(last.get('gt_per_image'), '.1f')})",
    ]
    # The best evaluation gets no interval: the maximum of noisy evaluations is biased upwards.
    ci = lambda p: f"[{f(p.get('f1_ci_low'))}, {f(p.get('f1_ci_high'))}]"  # noqa: E731
    if last.get("f1_ci_low") is not None:
        lines.append(f"val F1@0.5 95 % CI     first {ci(ev['first'])} → last {ci(last)}  (bootstrap over "
                     f"{last.get('n_images')} images)")
    if (d := ev.get("f1_change")) is not None:
        lines.append(f"val F1 last − first   {d['diff']:+.3f}  95 % CI [{d['low']:+.3f}, {d['high']:+.3f}] (paired "
                     f"bootstrap, same {d['n_images']} images): "
                     + ("outside the noise" if d["outside_noise"] else "within the noise"))
    return lines
