"""The run plot (`launcher/plot.py`): step panels read step records only; evaluation records get their panel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.plot import EVAL_TITLE, ROLLOUT_TITLE, build_figure, plot_run
from launcher.summary import K

pytest.importorskip("matplotlib", reason="the plot needs matplotlib (`pip install matplotlib`)")


def _run(tmp_path: Path, with_evals: bool) -> Path:
    recs = []
    for s in range(12):
        r = {"step": s, K + "step_kind_b": s % 2, "loss/total": 5.0 - 0.1 * s, "packing/fill": 0.7}
        if s % 2:
            r.update({"rollout/n_pred": s, "rollout/n_gt": 6, "rollout/n_matched": s // 2})
        recs.append(r)
        if with_evals and s % 5 == 0:  # interleaved, as the learner's evaluation thread appends them
            recs.append({"record": "eval", "step": s, "eval/f1": 0.1 * s / 2, "eval/map": 0.05 * s / 2,
                         "eval/map_50": None, "eval/parse_failure_rate": 0.0, "eval/score_source": "coord_logprob"})
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_a_run_with_eval_records_renders_with_a_validation_panel(tmp_path):
    run = _run(tmp_path, with_evals=True)
    fig = build_figure(run)
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert {EVAL_TITLE, ROLLOUT_TITLE, "losses"} <= set(panels)
    val = panels[EVAL_TITLE]
    lines = {line.get_label(): line for line in val.get_lines()}
    assert set(lines) == {"F1@0.5", "mAP", "parse failure rate"}  # mAP@.5 was None throughout: no line
    assert list(lines["F1@0.5"].get_xdata()) == [0, 5, 10] and val.get_ylim() == (0, 1.05)
    loss = {line.get_label(): list(line.get_xdata()) for line in panels["losses"].get_lines()}
    # the step panels never see an eval record; each channel's curve holds its own steps only
    assert loss["total (A)"] == list(range(0, 12, 2)) and loss["total (B)"] == list(range(1, 12, 2))
    rollout = {line.get_label(): line for line in panels[ROLLOUT_TITLE].get_lines()}
    assert list(rollout["F1"].get_xdata()) == [1, 3, 5, 7, 9, 11]  # B steps only
    assert rollout["precision"].get_ydata()[1] == 1 / 3  # step 3: 1 matched of 3 predicted

    (png,) = plot_run(run)
    assert png == run / "run.png" and png.stat().st_size > 10_000


def test_a_run_without_eval_records_still_plots_and_says_so(tmp_path):
    run = _run(tmp_path, with_evals=False)
    fig = build_figure(run)
    val = next(ax for ax in fig.axes if ax.get_title() == EVAL_TITLE)
    assert not val.get_lines() and "no evaluation records" in val.texts[0].get_text()
    assert plot_run(run)[0].exists()


def test_the_versions_panel_ends_at_the_final_ver_the_summary_reports(tmp_path):
    # the final push lands after the last step record (its checkpoint's trainer state holds it): the ver_current
    # line ends one below what the summary calls "final ver"; the star says where the run ended
    run = _run(tmp_path, with_evals=False)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        r[K + "ver_current"] = 1 + r["step"] // 4
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "checkpoints" / "12").mkdir(parents=True)
    (run / "checkpoints" / "12" / "trainer_state.json").write_text(json.dumps({"step": 12, "ver": 4}))
    panel = next(ax for ax in build_figure(run).axes if ax.get_title() == "versions")
    lines = {line.get_label(): line for line in panel.get_lines()}
    assert max(lines["ver_current"].get_ydata()) == 3
    star = lines["final ver 4 (after the last step)"]
    assert list(star.get_xdata()) == [12] and list(star.get_ydata()) == [4]
