"""bench/bench_knobs.py: every point's command line is a valid config on its own ports, and a run's row
is computed from that run's own records (summary, rank 0's steps, the actors' counters)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench")]

import bench_knobs  # noqa: E402
import knobs_lib  # noqa: E402

from common.config.load import ConfigError, load_config  # noqa: E402


def test_every_sweep_point_is_a_valid_config_on_ports_no_other_point_uses(tmp_path):
    points = [p for s in bench_knobs.SWEEPS.values() for p in s]
    assert len(points) == 14
    seen: set[int] = set()
    for i, (name, ovs, facts) in enumerate(points):
        argv = bench_knobs.point_argv("configs/demo_cpu.yaml", tmp_path / name, i, ovs, port0=8400)
        overrides = argv[argv.index("--config") + 2:]
        cfg = load_config(REPO / "configs" / "demo_cpu.yaml", overrides)
        ports = {cfg.rollout_server.port, *range(cfg.transport.base_port, cfg.transport.base_port + 4)}
        assert not ports & seen, f"{name} shares a port with an earlier point"
        seen |= ports
        assert cfg.rollout_matching.vllm.servers[0].base_url.endswith(f":{cfg.rollout_server.port}")
        assert cfg.training.output_dir == str(tmp_path / name)
        for key, value in facts.items():
            got = {"b_ratio": cfg.stage2_ab.schedule.b_ratio, "sync_every_steps": cfg.weight_sync.every_steps,
                   "version_window": cfg.stage2_ab.channel_b.async_.version_window}[key]
            assert got == value


def test_a_bad_override_of_a_point_is_refused_by_the_config_loader(tmp_path):
    argv = bench_knobs.point_argv("configs/demo_cpu.yaml", tmp_path, 0, ["stage2_ab.schedule.b_ratio=2"], port0=8400)
    with pytest.raises(ConfigError, match="b_ratio"):
        load_config(REPO / "configs" / "demo_cpu.yaml", argv[argv.index("--config") + 2:])


def _write_run(run: Path) -> None:
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({
        "steps": 4, "steps_b": 1, "policy_wanted_b": 2, "b_skipped_due_to_queue": 1, "busy_fraction": 0.9,
        "mean_fill_a": 0.95, "mean_fill_b": 0.8, "drop_stale_total": 1, "sync_stall_share": 0.01,
        "eval": {"first": {"f1": 0.3}, "best": {"f1": 0.4}, "last": {"f1": 0.35, "map": 0.05}}, "wall_s": 10.0,
        "b_bound": {"bound": "rollout-server"}}))
    k = knobs_lib.K
    steps = [{"step": i, "time/step": 0.5, "packing/tokens": 1000, k + "step_kind_b": int(i == 2),
              k + "ver_lag_mean": 1.5 if i == 2 else 0.0, k + "ver_lag_max": 2 if i == 2 else 0,
              "time/sync_total": 0.2 if i % 2 == 0 else 0.0, "queue/rank0/received": 4} for i in range(4)]
    steps.append({"record": "eval", "eval/f1": 0.35})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in steps) + "\n")
    actor = [{"rank": 0, "actor": 0, "ts": 100.0, "rollout/samples": 3, "actor/tokens_sent": 300},
             {"rank": 0, "actor": 0, "ts": 104.0, "rollout/samples": 5, "actor/tokens_sent": 800},
             {"rank": 0, "actor": 0, "event": "final", "ts": 105.0, "actor/tokens_sent": 800}]
    (run / "actor_rank0_0.jsonl").write_text("\n".join(json.dumps(r) for r in actor) + "\n")


def test_a_runs_row_is_computed_from_its_own_records(tmp_path):
    _write_run(tmp_path / "p")
    row = knobs_lib.run_row(tmp_path / "p")
    assert row["b_realised"] == 0.5 and row["skip_rate"] == 0.5
    assert row["ver_lag_mean"] == 1.5 and row["ver_lag_max"] == 2
    assert row["stale_rate"] == 0.25  # 1 stale of 4 received
    assert row["steps_per_s"] == pytest.approx(2.0)  # 4 steps in 2 s of training
    assert row["learner_tokens_per_s"] == pytest.approx(2000.0)
    assert row["rollouts_per_s"] == pytest.approx(8 / 4.0)  # interval records, final left out
    assert row["rollout_tokens_per_s"] == pytest.approx(800 / 4.0)  # the counter's last value
    assert row["sync_total_median_s"] == pytest.approx(0.2)
    assert (row["val_f1_first"], row["val_f1_last"], row["val_f1_best"]) == (0.3, 0.35, 0.4)
    table = knobs_lib.markdown_table([row, knobs_lib.run_row(tmp_path / "missing")])
    assert "| p | 0.900 | 2 | 1 | 0.50 |" in table
    assert table.count("\n") == 3 and "| missing | - |" in table


def test_the_plots_are_written(tmp_path):
    rows = [{"b_ratio": b, "b_realised": 1 - b, "busy": 0.9, "fill_b": 0.8, "val_f1_last": 0.3} for b in (0.1, 0.2)]
    knobs_lib.plot(rows, "b_ratio", tmp_path / "b.png")
    grid = [{"sync_every_steps": s, "version_window": w, "b_realised": 0.5, "stale_rate": 0.1} for s in (1, 2) for w in (1, 2)]
    knobs_lib.plot_grid(grid, tmp_path / "g.png")
    assert (tmp_path / "b.png").stat().st_size > 1000 and (tmp_path / "g.png").stat().st_size > 1000
