"""Every config key does something or is refused with the fix; the origin's key paths name the tandem key."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from common.config.schema import Config
from common.config.load import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
BASE = ["model.path=m", "data.train_jsonl=d.jsonl", "stage2_ab.schedule.b_ratio=0.5"]
MODES = {"async": [], "step": ["stage2_ab.channel_b.mode=step"], "micro": ["stage2_ab.channel_b.mode=micro"]}


def problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides, world_size=1)
    return exc.value.problems


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("override,fix", [("rollout_matching.rollout_backend=hf", "rollout_server.engine: hf"),
                                          ("rollout_matching.rollout_backend=vllm", "rollout_server.engine: hf"),
                                          ("rollout_matching.vllm.mode=colocate", "learner.share_gpus_with_server"),
                                          ("rollout_matching.vllm.mode=server", "learner.share_gpus_with_server")])
def test_in_learner_rollouts_are_refused_in_every_mode_with_what_is_supported(mode, override, fix):
    """The two keys that took one value only (rollouts always come from rollout servers) are retired: any value,
    the old one included, is refused with what to write instead."""
    key = override.split("=")[0]
    (msg,) = [p for p in problems(BASE + MODES[mode] + [override]) if p.startswith(key)]
    assert "not implemented" in msg and "Fix: remove it" in msg and fix in msg


MOVED_TO_WEIGHT_SYNC = {
    "rollout_matching.vllm.sync.transport=http": "weight_sync.transport",
    "rollout_matching.vllm.sync.bucket_mb=4": "weight_sync.bucket_mb",
    "rollout_matching.vllm.sync.timeout_s=30": "weight_sync.timeout_s",
    "rollout_matching.vllm.sync.fence=abort": "weight_sync.fence",
    "rollout_matching.vllm.sync.master_addr=10.0.0.1": "weight_sync.master_addr",
    "stage2_ab.channel_b.async.sync_mode=overlap": "weight_sync.mode",
    "stage2_ab.channel_b.async.sync_every_steps=4": "weight_sync.every_steps",
}


@pytest.mark.parametrize("override", sorted(MOVED_TO_WEIGHT_SYNC))
def test_each_old_weight_sync_key_is_refused_naming_its_weight_sync_key(override):
    key = override.split("=")[0]
    (msg,) = [p for p in problems(BASE + [override]) if p.startswith(key)]
    assert msg.endswith(f"Fix: move it to {MOVED_TO_WEIGHT_SYNC[override]}"), msg


def test_the_old_sync_section_gets_one_line_per_key_and_the_new_section_loads(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("model: {path: m}\ndata: {train_jsonl: d.jsonl}\nstage2_ab: {schedule: {b_ratio: 0.5}}\n"
                   "rollout_matching:\n  vllm:\n    sync: {mode: full, transport: nccl, bucket_mb: 64, extra: 1}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(old, world_size=1)
    by_key = {p.split(" = ")[0]: p for p in exc.value.problems}
    assert set(by_key) == {f"rollout_matching.vllm.sync.{k}" for k in ("mode", "transport", "bucket_mb", "extra")}
    assert by_key["rollout_matching.vllm.sync.transport"].endswith("Fix: move it to weight_sync.transport")
    assert "move it under weight_sync" in by_key["rollout_matching.vllm.sync.extra"]
    cfg = load_config(None, BASE + ["weight_sync.transport=nccl", "weight_sync.bucket_mb=64", "weight_sync.every_steps=4",
                                    "weight_sync.mode=overlap"], world_size=2)
    assert (cfg.weight_sync.transport, cfg.weight_sync.bucket_mb, cfg.weight_sync.every_steps,
            cfg.weight_sync.mode) == ("nccl", 64, 4, "overlap")


def test_the_origin_key_paths_get_the_tandem_key_each_maps_to():
    probs = problems(BASE + ["custom.trainer_variant=stage2_ab_training",
                             "custom.extra.rollout_matching.vllm.mode=server",
                             "custom.extra.rollout_matching.vllm.sync.transport=nccl",
                             "custom.extra.rollout_matching.vllm.servers=[]",
                             "custom.extra.rollout_matching.decoding.temperature=0.7",
                             "custom.extra.rollout_matching.top_p=0.9",
                             "custom.extra.stage2_ab.channel_b.rollouts_per_step=32",
                             "custom.extra.rollout_matching.rollout_buffer.enabled=true"])
    by_key = {p.split(" = ")[0]: p for p in probs}
    assert "unknown key" not in " ".join(probs)
    assert "python -m learner.warm_start" in by_key["custom.trainer_variant"]
    assert "path rollout_matching.vllm.mode is retired too: remove it" in by_key["custom.extra.rollout_matching.vllm.mode"]
    assert by_key["custom.extra.rollout_matching.vllm.sync.transport"].endswith("move it to weight_sync.transport")
    assert by_key["custom.extra.rollout_matching.vllm.servers"].endswith("Fix: write it as rollout_matching.vllm.servers")
    assert "write it as rollout_matching.decoding.temperature" in by_key["custom.extra.rollout_matching.decoding.temperature"]
    assert "rollout_matching.decoding.top_p" in by_key["custom.extra.rollout_matching.top_p"]  # retired on the way
    assert "write it as stage2_ab.channel_b.rollouts_per_step" in by_key[
        "custom.extra.stage2_ab.channel_b.rollouts_per_step"]
    assert "async prefetch" in by_key["custom.extra.rollout_matching.rollout_buffer.enabled"]


@pytest.mark.parametrize("override,mode", [("stage2_ab.channel_b.rollouts_per_step=8", "async"),
                                           ("stage2_ab.channel_b.rollouts_per_step=8", "micro"),
                                           ("learner.pack_wait_s=2", "step")])
def test_a_key_only_another_mode_reads_is_refused(override, mode):
    key = override.split("=")[0]
    (msg,) = [p for p in problems(BASE + MODES[mode] + [override]) if p.startswith(key)]
    assert f"not {mode}" in msg and "Fix: remove it" in msg


def _leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, str, typing.Any]]:
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        key, tp = f"{prefix}{f.metadata.get('key', f.name)}", hints[f.name]
        inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
        if dataclasses.is_dataclass(inner):
            out += _leaf_fields(inner, f"{key}.")
        else:
            out.append((key, f.name, tp))
    return out


def test_every_key_is_read_by_some_process_and_none_allows_one_value_only():
    """A key nothing reads is accepted and ignored; a key that takes one value only says nothing (retire it in
    common/config/migration.py instead, with the fix)."""
    import inspect

    from common.config.load import derive  # where the config itself turns keys into values (GA, effective batch)

    config_modules = {f"common/config/{name}.py" for name in ("load", "schema", "docs", "migration", "server",
                                                                       "weight_sync")}
    code = inspect.getsource(derive) + "\n".join(p.read_text(encoding="utf-8") for folder in ("common", "learner", "actor", "rollout_server",
                                                                   "launcher", "evaluator", "stage_b", "tandem")
                     for p in (REPO / folder).rglob("*.py") if p.relative_to(REPO).as_posix() not in config_modules)
    unread = [key for key, name, tp in _leaf_fields(Config) if not re.search(rf"\.{name}\b", code)]
    assert unread == [], f"keys accepted but read by nothing: {unread}"
    single = [key for key, _, tp in _leaf_fields(Config)
              if typing.get_origin(tp) is typing.Literal and len(typing.get_args(tp)) == 1]
    assert single == [], f"keys that take one value only: {single}"


def test_log_every_steps_other_than_1_refuses_a_stage2_start_and_is_the_warm_starts_alone(tmp_path):
    from common.runs.output_dir import StartRefused, prepare_start

    cfg = load_config(None, BASE + [f"training.output_dir={tmp_path / 'run'}", "training.log_every_steps=10"])
    with pytest.raises(StartRefused, match="only the warm start reads it"):
        prepare_start(cfg)
    assert not (tmp_path / "run").exists()
    assert load_config(REPO / "configs" / "warm_start_cpu.yaml").training.log_every_steps == 100  # still loads
