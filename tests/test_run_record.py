"""The run directory keeps what produced it (`learner/run_record.py`): run_config.yaml and run_info.json."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from common.config.load import load_config
from learner.run_record import start_run, write_run_record


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    """A model dir with its build record and a data dir with its generator manifest."""
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir(exist_ok=True)
    data.mkdir(exist_ok=True)
    (model / "tandem_build.json").write_text(json.dumps({"params": {"preset": "tiny", "seed": 0}}))
    (data / "manifest.json").write_text(json.dumps({"params": {"generator": "common.data.synthetic", "n_train": 8},
                                                    "files": ["train.jsonl"]}))
    (data / "train.jsonl").write_text("")  # start_run checks its first records (data.on_bad_record): none here
    return model, data


def _cfg(tmp_path: Path, *extra: str, world_size: int = 2):
    model, data = _inputs(tmp_path)
    overrides = [f"model.path={model}", f"data.train_jsonl={data / 'train.jsonl'}", "stage2_ab.schedule.b_ratio=0.25",
                 f"training.output_dir={tmp_path / 'run'}", "training.gradient_accumulation_steps=2",
                 "rollout_matching.decoding.temperature=0.7", "rollout_matching.decoding.max_new_tokens=96", *extra]
    return load_config(None, overrides, world_size=world_size)


def test_a_fresh_start_writes_the_resolved_config_and_what_produced_the_run(tmp_path):
    cfg = _cfg(tmp_path, "training.lr=0.5", "training.seed=7")
    run = tmp_path / "run"
    write_run_record(cfg, run, world_size=2, resumed_from_step=None)

    text = (run / "run_config.yaml").read_text()
    written = yaml.safe_load(text)
    assert written["training"]["lr"] == 0.5  # the override
    assert written["training"]["warmup_steps"] == 0  # a default nobody wrote
    assert written["stage2_ab"]["channel_b"]["async"]["queue_limit"] == 8  # YAML key names, not attribute names
    assert "derived" not in written and "#   effective_batch_size: 4" in text  # derived values: header comment

    info = json.loads((run / "run_info.json").read_text())
    assert info["seeds"]["training.seed"] == 7 and set(info["seeds"]["rules"]) >= {"learner", "rollout_sampling"}
    assert info["decoding"]["rollout"]["temperature"] == 0.7
    assert info["decoding"]["eval"] == {"greedy": True, "temperature": 0.0, "max_new_tokens": 96, "enabled": False}
    assert info["world_size"] == 2 and info["derived"]["effective_batch_size"] == 4
    assert info["model"]["tandem_build"] == {"params": {"preset": "tiny", "seed": 0}}
    assert info["data"]["manifests"] == {str(tmp_path / "data"): {"generator": "common.data.synthetic", "n_train": 8}}
    assert set(info["versions"]) == {"python", "torch", "transformers", "tandem"}
    assert info["git"] is None or len(info["git"]["commit"]) == 40
    assert info["started_utc"].endswith("+00:00") and info["resumes"] == []
    assert len(info["run_id"]) == 32  # uuid4 hex, made at the fresh start


def test_run_config_yaml_loads_back_into_the_same_config(tmp_path):
    cfg = _cfg(tmp_path, "training.lr=0.5", "training.effective_batch_size=8",
               "training.gradient_accumulation_steps=null", "rollout_matching.vllm.servers=[{base_url: 'http://h:1'}]")
    write_run_record(cfg, tmp_path / "run", world_size=2, resumed_from_step=None)
    assert load_config(tmp_path / "run" / "run_config.yaml", world_size=2) == cfg


def test_a_resume_appends_to_run_info_and_never_rewrites_the_first_start(tmp_path):
    run = tmp_path / "run"
    write_run_record(_cfg(tmp_path), run, world_size=2, resumed_from_step=None)
    first_config, first_info = (run / "run_config.yaml").read_text(), json.loads((run / "run_info.json").read_text())

    write_run_record(_cfg(tmp_path, "training.max_steps=200"), run, world_size=2, resumed_from_step=50)
    write_run_record(_cfg(tmp_path, "training.max_steps=300"), run, world_size=2, resumed_from_step=200)

    assert (run / "run_config.yaml").read_text() == first_config
    info = json.loads((run / "run_info.json").read_text())
    assert {k: v for k, v in info.items() if k != "resumes"} == {k: v for k, v in first_info.items() if k != "resumes"}
    assert [r["resumed_from_step"] for r in info["resumes"]] == [50, 200]
    assert info["resumes"][1]["config_changes"] == {"training.max_steps": {"first": 100, "now": 300}}


def test_a_fresh_start_in_a_used_directory_keeps_the_earlier_record_aside(tmp_path):
    run = tmp_path / "run"
    write_run_record(_cfg(tmp_path, "training.lr=0.5"), run, world_size=2, resumed_from_step=None)
    write_run_record(_cfg(tmp_path, "training.lr=0.25"), run, world_size=2, resumed_from_step=None)
    assert yaml.safe_load((run / "run_config.yaml").read_text())["training"]["lr"] == 0.25
    (aside,) = run.glob("run_config.replaced-*.yaml")
    assert yaml.safe_load(aside.read_text())["training"]["lr"] == 0.5
    assert len(list(run.glob("run_info.replaced-*.json"))) == 1


def test_the_server_token_never_reaches_the_run_directory(tmp_path):
    write_run_record(_cfg(tmp_path, "rollout_server.auth_token=s3cret"), tmp_path / "run", world_size=2,
                     resumed_from_step=None)
    for f in (tmp_path / "run").iterdir():
        assert "s3cret" not in f.read_text(), f.name
    assert json.loads((tmp_path / "run" / "run_info.json").read_text())["redacted"] == ["rollout_server.auth_token"]


def test_the_entry_point_finds_the_resume_step_from_the_checkpoint_it_resumes(tmp_path):
    run = tmp_path / "run"
    assert start_run(_cfg(tmp_path), 2) is None
    run_id = json.loads((run / "run_info.json").read_text())["run_id"]
    (run / "checkpoints" / "30").mkdir(parents=True)
    (run / "checkpoints" / "30" / "trainer_state.json").write_text(
        json.dumps({"run_id": run_id, "global_step": 30, "ver": 15}))
    assert start_run(_cfg(tmp_path, "training.resume=auto"), 2) is None
    refused = start_run(_cfg(tmp_path, f"training.resume={tmp_path / 'missing'}"), 2)  # not a checkpoint: exit 2
    assert "is not a checkpoint directory" in refused
    info = json.loads((run / "run_info.json").read_text())
    assert info["run_id"] == run_id  # kept by the resume
    assert [r["resumed_from_step"] for r in info["resumes"]] == [30]
    assert info["resumes"][0]["config_changes"] == {"training.resume": {"first": None, "now": "auto"}}
