"""bench/plot_results.py: each kind of plot from the files the benches write, and the docs' plots from the
committed results (so the script cannot rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_proc import REPO

pytest.importorskip("matplotlib", reason="the plots need matplotlib (`pip install matplotlib`)")
PNG = b"\x89PNG\r\n\x1a\n"


def _plot(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/plot_results.py", *args, "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_each_kind_is_drawn_from_a_new_runs_results(tmp_path):
    curve = [{"step": s, "learner_s": 10.0 * s, "f1": 0.3 + 0.01 * s, "map": 0.05} for s in range(4)]
    summary = {"peak_memory_gb_by_rank": {"allocated": [20.0, 21.0]}, "step_time_median_s": 1.2}
    res = {"date": "2027-01-02",
           "ddp_vs_fsdp": {f"bench-{p}-{s}": summary for p in ("ddp", "fsdp") for s in ("1.5b", "7b")},
           "eval_curves": {"a_only": curve, "b0.2": curve, "b0.4": curve},
           "sweep_rows": [{"run": f"b{b}", "b_realised": 0.9, "stale_rate": 0.1, "fill_b": 0.9, "val_f1_last": 0.4}
                          for b in (0.2, 0.4)]}
    (tmp_path / "r.json").write_text(json.dumps(res))
    # bench/bench_stage_b.py --out, as the stage-b-scaling scenario writes it
    (tmp_path / "stage_b.json").write_text(json.dumps({"bench": "stage_b", "rows": [
        {"world_size": 1, "tickets_per_s": 2.0}, {"world_size": 2, "tickets_per_s": 3.5}]}))
    proc = _plot(tmp_path, str(tmp_path / "r.json"), str(tmp_path / "stage_b.json"), "--label", "2 x GPU")
    assert proc.returncode == 0, proc.stderr
    for kind in ("ddp_vs_fsdp", "quality_arms", "sweep_b_ratio", "stage_b_scaling"):
        assert _is_png(tmp_path / f"{kind}.png"), kind


def test_a_file_without_plottable_data_is_an_error(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"date": "x"}))
    proc = _plot(tmp_path, str(tmp_path / "r.json"))
    assert proc.returncode == 1 and "holds data" in proc.stdout


def test_the_docs_plots_are_drawn_from_the_committed_results(tmp_path):
    """The commands docs/benchmarks.md names for its 4 x H200 plots."""
    first = _plot(tmp_path, "bench/results/h200x4_2026-11-26.json", "--kinds", "ddp_vs_fsdp,stage_b_scaling",
                  "--suffix", "_h200", "--label", "4 x H200")
    second = _plot(tmp_path, "bench/results/h200x4_2026-11-27.json", "--kinds", "quality_arms,sweep_b_ratio",
                   "--suffix", "_h200", "--label", "4 x H200")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    for name in ("ddp_vs_fsdp_h200.png", "stage_b_scaling_h200.png", "quality_arms_h200.png", "sweep_b_ratio_h200.png"):
        assert _is_png(tmp_path / name), name
