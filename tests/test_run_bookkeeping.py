"""A short real learner run's bookkeeping: checkpoint retention and the trackers of ``training.report_to``.

    torchrun learner/main.py (2 gloo ranks, async mode, A steps only: b_ratio 0, so no actor is needed; no
    rollout server: its syncs fail fast and it trains on) ── save every step, save_total_limit 2 ──►
    checkpoints/3, checkpoints/4
                ── report_to [tensorboard, wandb, mlflow] ──► tensorboard/, wandb/ (WANDB_MODE=offline), mlruns/

Then a resume of the same run for 2 more steps: the rule holds across it (the newest two, and the
checkpoint that process resumed from) and the W&B / MLflow runs continue.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.ports import free_port_block
from tests.test_learner_harness import launch_learner, private_copy, write_config

pytestmark = pytest.mark.slow

STEPS = 4
RANKS = 2  # real gloo ranks: every rank writes each checkpoint, rank 0 alone deletes and tracks
REPORT_TO = ["tensorboard", "wandb", "mlflow"]


def _missing_trackers() -> list[str]:
    import importlib.util

    return [m for m in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir, synth_data_dir):
    if missing := _missing_trackers():
        pytest.skip(f"{', '.join(missing)} not installed: the dev extra installs them (pip install -e '.[dev]')")
    tmp = tmp_path_factory.mktemp("bookkeeping")
    model, data = private_copy(tiny_model_dir, tmp / "model"), private_copy(synth_data_dir, tmp / "data")
    cfg = write_config(
        tmp / "cfg.yaml", model_dir=model, data_dir=data, output_dir=tmp / "run", nproc=RANKS,
        training={"max_steps": STEPS, "save_every_steps": 1, "save_total_limit": 2, "report_to": REPORT_TO,
                  "gradient_accumulation_steps": 1},
        stage2_ab={"schedule": {"b_ratio": 0}, "coord_ce_weight": 1.0},
        weight_sync={"timeout_s": 5}, rollout_matching={"vllm": {"timeout_s": 5}},
    )
    out = {}
    for name, steps, extra in (("first", STEPS, []), ("resumed", STEPS + 2, ["training.resume=auto"])):
        with pytest.MonkeyPatch.context() as env:  # the learner inherits them: no network, no login, no server
            env.setenv("WANDB_MODE", "offline")
            env.delenv("MLFLOW_TRACKING_URI", raising=False)
            # a fresh port block for each part: the one picked when the config was written may be another test's
            # by the time the resumed part binds (it was once: "Address already in use" in the full suite)
            proc = launch_learner(cfg, tmp / f"{name}.log", nproc=RANKS,
                                  overrides=[f"training.max_steps={steps}", *extra,
                                             f"transport.base_port={free_port_block(2 * RANKS)}"])
        try:
            rc = proc.wait(300, f"the {RANKS}-rank learner ({name} part)")
        finally:
            proc.stop()
        assert rc == 0, f"learner ({name}) exited with {rc}:\n{proc.tail()}"
        out[name] = sorted(int(p.name) for p in (tmp / "run" / "checkpoints").iterdir())
    out["dir"] = tmp / "run"
    return out


def test_retention_keeps_the_newest_n_checkpoints_and_deletes_the_rest(run):
    assert run["first"] == [STEPS - 1, STEPS]  # steps 1 and 2 deleted, no .deleting-* left behind


def test_a_resumed_run_keeps_the_rule_and_the_checkpoint_it_resumed_from(run):
    # 4 is where the resume started (a restarted actor would read its B ledger); the next start may delete it
    assert run["resumed"] == [STEPS, STEPS + 1, STEPS + 2]


def test_tensorboard_gets_every_step_of_both_parts(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["dir"] / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/total")] == list(range(STEPS + 2))


def test_wandb_offline_writes_one_run_that_the_resume_continues(run):
    runs = sorted((run["dir"] / "wandb").glob("offline-run-*"))
    assert runs, f"no offline W&B run under {run['dir'] / 'wandb'}"
    run_info = json.loads((run["dir"] / "run_info.json").read_text())
    assert all(p.name.endswith(run_info["run_id"]) for p in runs)  # one W&B run id: the tandem run id
    assert all(list(p.glob("run-*.wandb")) for p in runs)  # the data file `wandb sync` uploads


def test_mlflow_file_store_holds_the_steps_of_both_parts_in_one_run(run):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as the learner does (learner/trackers.py)
    client = MlflowClient(tracking_uri=(run["dir"] / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    history = client.get_metric_history(runs[0].info.run_id, "loss/total")
    assert sorted(m.step for m in history) == list(range(STEPS + 2))
