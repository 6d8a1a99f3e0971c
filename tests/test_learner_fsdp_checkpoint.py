"""Sharded (``learner.parallel: fsdp``) checkpoints with 2 real gloo ranks: resume, resume into DDP, export.

The runs, each a 2-rank torchrun learner fed by fake actors (the harness of test_learner_resume.py:
no rollout server, every sync fails fast; restarted actors re-send B samples the ledger must drop)::

    whole      fsdp, N + M steps, fresh                     the reference
    parts      fsdp, N steps, then resumed to N + M         checkpoints/N is the one under test
    into_ddp   ddp,  resumed from parts' checkpoints/N to N + M (another output_dir)
    from_ddp   fsdp, resumed from into_ddp's (DDP) checkpoints/N+M for one step (its optimizer.pt sharded on load)

Weights and AdamW state are read back from ``dcp/`` with torch's own ``dcp_to_torch_save`` (one
process, no process group), not with the code under test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from common.runs.checkpoints import NotACheckpoint, checkpoint_parallel
from common.packing.schedule import wants_b
from tests.test_learner_harness import REPO, SegmentPool, private_copy, read_metrics, write_config
from tests.test_learner_resume import train

pytestmark = pytest.mark.slow

N, M = 2, 2
#: The LR is then (step + 1) / WARMUP × lr for every step here: whatever max_steps a part ran with (a cosine decay
#: would end at part 1's max_steps = N), and a scheduler restarted at 0 would show in the losses.
WARMUP = 10
TOL = dict(rtol=0, atol=1e-5)  # DDP vs FSDP2 arithmetic; an AdamW restarted from zero state moves weights ~lr = 1e-3


def full_state(ckpt) -> dict:
    """{"model": {name: tensor}, "optim": {"state": {name: {...}}, ...}} of a ``dcp/`` checkpoint, unsharded."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = ckpt.parent / f"{ckpt.name}-full.pt"
    if not flat.exists():
        dcp_to_torch_save(ckpt / "dcp", flat)
    return torch.load(flat, weights_only=False)


def hf_weights(model_dir) -> dict:
    """The state dict of an HF directory as ``from_pretrained`` reads it (its files may use legacy key names)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir).state_dict()


def assert_close_weights(got: dict, want: dict, **tol) -> None:
    shared = set(got) & set(want)
    assert len(shared) >= len(want) - 1, f"names differ: {sorted(set(want) ^ set(got))[:5]}"  # lm_head once if tied
    for name in sorted(shared):
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}", **(tol or dict(rtol=0, atol=0)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir, synth_data_dir):
    tmp = tmp_path_factory.mktemp("fsdp_ckpt")
    model, data = private_copy(tiny_model_dir, tmp / "model"), private_copy(synth_data_dir, tmp / "data")

    def config(name: str, parallel: str):
        return write_config(tmp / f"{name}.yaml", output_dir=tmp / name, model_dir=model, data_dir=data,
                            training={"gradient_accumulation_steps": 1, "save_every_steps": N, "warmup_steps": WARMUP},
                            stage2_ab={"channel_b": {"async": {"version_window": 2, "queue_limit": 4,
                                                               "prefetch_target_packs": 2}}},
                            learner={"pack_wait_s": 20.0, "parallel": parallel})

    return tmp, SegmentPool(model, data), config


@pytest.fixture(scope="module")
def runs(setup):
    tmp, pool, config = setup
    whole, parts = config("whole", "fsdp"), config("parts", "fsdp")
    train(whole, tmp / "whole.log", pool, N + M, resume=False)
    train(parts, tmp / "part1.log", pool, N, resume=False)
    train(parts, tmp / "part2.log", pool, N + M, resume=True)
    return {"tmp": tmp, "ckpt_n": tmp / "parts" / "checkpoints" / str(N),
            "whole": read_metrics(tmp / "whole"), "parts": read_metrics(tmp / "parts")}


@pytest.fixture(scope="module")
def into_ddp(setup, runs):
    tmp, pool, config = setup
    train(config("into_ddp", "ddp"), tmp / "into_ddp.log", pool, N + M, resume=str(runs["ckpt_n"]))
    return read_metrics(tmp / "into_ddp")


@pytest.fixture(scope="module")
def from_ddp(setup, runs, into_ddp):
    """into_ddp's last (DDP) checkpoint resumed as fsdp for one step: (that checkpoint, the fsdp one after the step)."""
    tmp, pool, config = setup
    ddp_ckpt = tmp / "into_ddp" / "checkpoints" / str(N + M)
    train(config("from_ddp", "fsdp"), tmp / "from_ddp.log", pool, N + M + 1, resume=str(ddp_ckpt))
    return ddp_ckpt, tmp / "from_ddp" / "checkpoints" / str(N + M + 1)


def kinds(metrics):
    return [(m["step"], m["stage2_ab/async/step_kind_b"]) for m in metrics]


def losses(metrics):
    return {m["step"]: m["loss/total"] for m in metrics}


def test_an_fsdp_checkpoint_is_sharded_and_records_how_it_was_written(runs):
    ckpt = runs["ckpt_n"]
    assert checkpoint_parallel(ckpt) == "fsdp"
    assert not (ckpt / "model").exists() and not (ckpt / "optimizer.pt").exists(), "no gathered copy of the model"
    assert sorted(p.name for p in (ckpt / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (state["parallel"], state["world_size"], state["global_step"]) == ("fsdp", 2, N)
    assert (ckpt / "model_config" / "config.json").is_file() and (ckpt / "model_config" / "tokenizer.json").is_file()
    assert {f"rank{r}.json" for r in (0, 1)} | {f"b_ledger_rank{r}.json" for r in (0, 1)} <= {p.name for p in ckpt.iterdir()}


def test_an_fsdp_resume_continues_the_same_steps_losses_and_weights_as_an_uninterrupted_run(runs):
    whole, parts = runs["whole"], runs["parts"]
    assert [m["step"] for m in parts] == list(range(N + M)), "part 2 continues at step N; no step twice or missing"
    assert kinds(parts) == kinds(whole) == [(s, int(wants_b(s, 0.5))) for s in range(N + M)]
    assert losses(parts) == losses(whole), "same weights, same data, same arithmetic: bit-identical losses"
    tmp = runs["tmp"]
    resumed, uninterrupted = full_state(tmp / "parts/checkpoints/4"), full_state(tmp / "whole/checkpoints/4")
    assert_close_weights(resumed["model"], uninterrupted["model"])
    for name, st in uninterrupted["optim"]["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed["optim"]["state"][name][key], st[key]), f"AdamW {key} of {name} differs"


def test_an_fsdp_checkpoint_resumes_in_a_ddp_run_with_the_saved_weights_and_optimizer_state(runs, into_ddp):
    whole = runs["whole"]
    assert [m["step"] for m in into_ddp] == list(range(N, N + M)), "the DDP run starts at the checkpoint's step"
    assert kinds(into_ddp) == kinds(whole)[N:]
    assert losses(into_ddp)[N] == pytest.approx(losses(whole)[N], rel=1e-6), (
        "the first step after the resume is a forward of the saved weights: its loss must be the fsdp run's")
    ddp_final = runs["tmp"] / "into_ddp" / "checkpoints" / str(N + M)
    assert checkpoint_parallel(ddp_final) == "ddp", "a DDP run writes today's layout, whatever it resumed from"
    assert_close_weights(hf_weights(ddp_final / "model"), full_state(runs["tmp"] / "whole/checkpoints/4")["model"], **TOL)


def test_a_ddp_checkpoint_resumes_in_an_fsdp_run_with_its_adamw_state_sharded_on_load(from_ddp):
    ddp_ckpt, after = from_ddp
    before = torch.load(ddp_ckpt / "optimizer.pt", weights_only=False)  # keyed by parameter index
    names = [n for n, p in hf_weights(ddp_ckpt / "model").items() if n != "lm_head.weight"]  # tied: trained once
    state = full_state(after)["optim"]["state"]
    assert sorted(state) == sorted(names)
    (b1, b2), = {tuple(g["betas"]) for g in before["param_groups"]}
    for i, name in enumerate(names):
        m0, v0 = before["state"][i]["exp_avg"], before["state"][i]["exp_avg_sq"]
        m1, v1 = state[name]["exp_avg"], state[name]["exp_avg_sq"]
        assert float(state[name]["step"]) == float(before["state"][i]["step"]) + 1 == N + M + 1, name
        # one AdamW step from (m0, v0) with some gradient g: m1 = b1 m0 + (1 - b1) g, v1 = b2 v0 + (1 - b2) g^2.
        # From a zero state (the optimizer.pt not restored, or given to the wrong parameters) the pair would not fit.
        g = (m1 - b1 * m0) / (1 - b1)
        torch.testing.assert_close(v1, b2 * v0 + (1 - b2) * g * g, rtol=1e-3, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_export_of_an_fsdp_checkpoint_is_an_hf_directory_with_its_full_weights(runs, tmp_path):
    from transformers import AutoTokenizer

    from common.data.processor import load_processor

    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "learner.export", "--checkpoint", str(runs["ckpt_n"]), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert_close_weights(hf_weights(out), full_state(runs["ckpt_n"])["model"])
    served, trained = load_processor(out), AutoTokenizer.from_pretrained(runs["tmp"] / "model")  # as the server loads it
    assert served.tokenizer.get_vocab() == trained.get_vocab(), "the coord tokens and the rest of the vocabulary"
    assert not list(tmp_path.glob(".exported.tmp-*")), "the temporary directory was renamed or removed"


def test_export_refuses_a_directory_that_is_not_a_checkpoint_naming_the_fix(tmp_path):
    run_dir = tmp_path / "run"
    for step in (3, 12):
        (run_dir / "checkpoints" / str(step)).mkdir(parents=True)
        (run_dir / "checkpoints" / str(step) / "trainer_state.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "learner.export", "--checkpoint", str(run_dir), "--out",
                           str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is a run's output directory, not a checkpoint" in proc.stderr
    assert f"Fix: pass one of its checkpoints, e.g. the latest: {run_dir / 'checkpoints' / '12'}" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_a_half_copied_or_foreign_directory_is_named_for_what_it_is(tmp_path):
    with pytest.raises(NotACheckpoint, match="not a checkpoint directory .no trainer_state.json.. Fix: pass"):
        checkpoint_parallel(tmp_path)
    (tmp_path / "trainer_state.json").write_text("{}")
    (tmp_path / "dcp").mkdir()
    with pytest.raises(NotACheckpoint, match="has no .metadata: the sharded checkpoint is incomplete"):
        checkpoint_parallel(tmp_path)
    (tmp_path / "dcp").rmdir()
    with pytest.raises(NotACheckpoint, match="neither model/ .a ddp checkpoint. nor dcp/"):
        checkpoint_parallel(tmp_path)
    (tmp_path / ".tmp-4").mkdir()
    with pytest.raises(NotACheckpoint, match="half-written by a crash"):
        checkpoint_parallel(tmp_path / ".tmp-4")


def test_export_of_a_ddp_checkpoint_copies_its_model_dir_and_never_writes_into_a_used_out(tmp_path):
    from learner.export import ExportError, export

    ckpt = tmp_path / "checkpoints" / "3"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "model" / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    assert (export(ckpt, tmp_path / "out") / "config.json").read_text() == '{"model_type": "qwen2_5_vl"}'
    with pytest.raises(ExportError, match="exists and is not an empty directory. Fix: choose a new directory"):
        export(ckpt, tmp_path / "out")
