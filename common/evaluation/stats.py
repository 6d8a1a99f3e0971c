"""How sure an evaluation is: bootstrap intervals over images, t-intervals over seeds, per-image counts.

    per image: (n_matched, n_pred, n_gt, n_dup) ─► ImageCounts (kept with the eval record)
        ├─► f1_interval:          percentile bootstrap over images of the pooled F1@0.5
        ├─► paired_f1_difference: the same resampled images for two evaluations (first vs last)
        └─► by_gt_count:          P/R/F1 per bucket of GT objects per image (crowded scenes)
    per seed: one number per run ─► t_interval (mean ± t) and paired_t_difference (same seeds, two arms)

Why the bootstrap resamples images, not boxes: boxes of one image are not independent (one bad
rollout loses all of them), and an image is what the validation set samples. F1 pools counts over
images (``common/detection/matching.py:precision_recall_f1``), so each resample sums the drawn images'
counts and computes F1 once, as the evaluation does. The resampling is ``scipy.stats.bootstrap``
(``method="percentile"``: BCa needs a jackknife per call and warns on the degenerate sets a
detector that finds nothing produces), with a fixed seed so the same evaluation prints the same
interval.

What this module does not know: boxes, matchers, models; it gets counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

N_RESAMPLES = 1000
CONFIDENCE = 0.95
SEED = 0
#: GT-objects-per-image buckets, (low, high) inclusive; images without GT are in none (F1 needs GT to find).
GT_BUCKETS: tuple[tuple[int, int | None], ...] = ((1, 4), (5, 9), (10, 19), (20, 39), (40, None))


@dataclass(frozen=True)
class ImageCounts:
    """Per-image matcher counts, parallel lists in evaluation (record) order.

    ``n_dup``: predictions the matcher left unmatched whose IoU with an already-matched GT is ≥ the gate
    (a second box on a found object). As a dict (``as_dict``) it rides in the eval record
    (``eval/image_counts``), so the summary can bootstrap without the images.
    """

    n_matched: tuple[int, ...]
    n_pred: tuple[int, ...]
    n_gt: tuple[int, ...]
    n_dup: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.n_matched) == len(self.n_pred) == len(self.n_gt) == len(self.n_dup):
            raise ValueError("image counts: n_matched, n_pred, n_gt, n_dup must have one entry per image")

    def __len__(self) -> int:
        return len(self.n_gt)

    def as_dict(self) -> dict[str, list[int]]:
        return {k: list(getattr(self, k)) for k in ("n_matched", "n_pred", "n_gt", "n_dup")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageCounts:
        """From :meth:`as_dict`; ``n_dup`` zeros when absent. ValueError for anything else."""
        if not isinstance(d, dict) or not all(isinstance(d.get(k), list) for k in ("n_matched", "n_pred", "n_gt")):
            raise ValueError(f"not image counts: {str(d)[:80]}")
        return cls(tuple(d["n_matched"]), tuple(d["n_pred"]), tuple(d["n_gt"]),
                   tuple(d.get("n_dup") or [0] * len(d["n_gt"])))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.asarray(self.n_matched, float), np.asarray(self.n_pred, float), np.asarray(self.n_gt, float))


def pooled_f1(m: np.ndarray, p: np.ndarray, g: np.ndarray, axis: int = -1) -> np.ndarray:
    """F1 of counts summed along ``axis``: ``2 m / (p + g)``, 1.0 where nothing was claimed nor present
    (``precision_recall_f1``'s convention)."""
    m, denom = np.sum(m, axis=axis), np.sum(p, axis=axis) + np.sum(g, axis=axis)
    return np.where(denom > 0, 2 * m / np.where(denom > 0, denom, 1), 1.0)


def _bootstrap(data: tuple[np.ndarray, ...], statistic: Any, n_resamples: int, seed: int) -> tuple[float, float]:
    from scipy.stats import bootstrap  # deferred: scipy's import costs ~0.3 s

    if len(data[0]) < 2:  # one image: nothing to resample; scipy refuses it
        value = float(statistic(*data, axis=-1))
        return value, value
    res = bootstrap(data, statistic, paired=True, vectorized=True, n_resamples=n_resamples,
                    confidence_level=CONFIDENCE, method="percentile", rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def f1_interval(counts: ImageCounts, *, n_resamples: int = N_RESAMPLES, seed: int = SEED) -> tuple[float, float] | None:
    """The 95 % percentile-bootstrap interval of pooled F1@0.5 over images; None for no images."""
    if not len(counts):
        return None
    return _bootstrap(counts.arrays(), pooled_f1, n_resamples, seed)


def paired_f1_difference(before: ImageCounts, after: ImageCounts, *, n_resamples: int = N_RESAMPLES,
                         seed: int = SEED) -> dict[str, Any] | None:
    """F1(after) − F1(before) on the same images, with its 95 % paired-bootstrap interval.

    Each resample draws the same images for both evaluations, so what the two share (an easy or
    hard image) cancels; the interval is of the difference itself. ``outside_noise``: 0 is not in
    the interval. None when the two did not score the same number of images (not pairable).
    """
    if len(before) != len(after) or not len(before):
        return None
    data = (*before.arrays(), *after.arrays())

    def diff(m0: Any, p0: Any, g0: Any, m1: Any, p1: Any, g1: Any, axis: int = -1) -> np.ndarray:
        return pooled_f1(m1, p1, g1, axis) - pooled_f1(m0, p0, g0, axis)

    low, high = _bootstrap(data, diff, n_resamples, seed)
    return {"diff": float(diff(*data)), "low": low, "high": high, "n_images": len(before),
            "outside_noise": not low <= 0.0 <= high}


def bucket_name(low: int, high: int | None) -> str:
    """``(10, 19)`` -> ``"10_19"``, ``(40, None)`` -> ``"40_plus"`` (the ``eval/f1_gt_<name>`` suffix)."""
    return f"{low}_plus" if high is None else f"{low}_{high}"


def by_gt_count(counts: ImageCounts) -> dict[str, dict[str, float | int]]:
    """Per GT-count bucket (:data:`GT_BUCKETS`) that holds an image: images, P, R, F1 of the pooled counts."""
    from common.detection.matching import precision_recall_f1

    out = {}
    for low, high in GT_BUCKETS:
        idx = [i for i, g in enumerate(counts.n_gt) if g >= low and (high is None or g <= high)]
        if idx:
            m, p, g = (sum(getattr(counts, k)[i] for i in idx) for k in ("n_matched", "n_pred", "n_gt"))
            prec, rec, f1 = precision_recall_f1(m, p, g)
            out[bucket_name(low, high)] = {"n_images": len(idx), "precision": prec, "recall": rec, "f1": f1}
    return out


def t_interval(values: Sequence[float]) -> dict[str, Any]:
    """Mean and 95 % Student-t interval of per-seed values; ``low``/``high`` None below two values."""
    from scipy import stats

    xs = np.asarray([v for v in values if v is not None], float)
    if xs.size == 0:
        return {"n": 0, "mean": None, "low": None, "high": None}
    mean = float(xs.mean())
    if xs.size < 2:
        return {"n": 1, "mean": mean, "low": None, "high": None}
    if np.ptp(xs) == 0:  # every seed gave the same number: scipy would return nan for a zero scale
        return {"n": int(xs.size), "mean": mean, "low": mean, "high": mean}
    sem = float(stats.sem(xs))
    low, high = stats.t.interval(CONFIDENCE, df=xs.size - 1, loc=mean, scale=sem)
    return {"n": int(xs.size), "mean": mean, "low": float(low), "high": float(high)}


def paired_t_difference(base: dict[int, float], other: dict[int, float]) -> dict[str, Any]:
    """``other − base`` over the seeds both have (``{seed: value}``): mean and 95 % t-interval of the
    per-seed differences, ``outside_noise`` when the interval excludes 0 (None below two seeds)."""
    seeds = sorted(s for s in base if s in other and base[s] is not None and other[s] is not None)
    out = {"seeds": seeds, **t_interval([other[s] - base[s] for s in seeds])}
    out["outside_noise"] = None if out["low"] is None else not out["low"] <= 0.0 <= out["high"]
    return out
