"""bench/plot_h200x4.py draws the 4 x H200 plots from the committed results (so the script cannot rot)."""

from __future__ import annotations

import subprocess
import sys

from tests.server_proc import REPO


def test_the_session_plots_are_drawn_from_the_committed_results(tmp_path):
    proc = subprocess.run([sys.executable, "bench/plot_h200x4.py", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("ddp_vs_fsdp_h200.png", "stage_b_scaling_h200.png", "quality_arms_h200.png", "sweep_b_ratio_h200.png"):
        png = tmp_path / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 10_000, f"{name}: {png.stat().st_size} bytes, an empty figure?"
