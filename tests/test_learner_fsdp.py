"""``learner.parallel: fsdp`` (FSDP2) against DDP on real gloo ranks over loopback, the tiny Qwen2.5-VL on CPU.

Five training runs of the real :class:`learner.rank.Learner` (the async mode's ``async_step``), launched
as users launch ranks (``torchrun --standalone``; plain ``python`` for one rank) with this file as the rank
script, each rank writing its own result file and rank 0 the full weights::

    ddp  × 2 ranks                      \\  same seed, same A data, the same B packs (one fake actor per rank,
    fsdp × 2 ranks (+ grad checkpointing) |  pack_wait_s long enough that B runs at steps 1 and 3 in all three)
    fsdp × 2 ranks, reduce every micro-step /
    ddp  × 1 rank (the plain model)     \\  same seed, same data
    fsdp × 1 rank, cpu_offload          /

No rollout server: the start-up push fails (not fatal), ver stays 0, so every B pack stays fresh.
``training.save_final: false``: no final checkpoint is written (learner/checkpoint.py is tested on its own;
here the key is). Every run uses ``training.adamw_impl: auto`` (fused AdamW on the CPU). Tolerances (fp32 on CPU; the engines sum gradients in a different order, AdamW
amplifies the last bits of near-zero gradients): loss rel 1e-5 per step, weights atol 1e-4.

Also: FSDP2 gradients equal DDP's when one rank's pack has no image (the zero vision term keeps the
all-gathers of every rank in the same order), and the config accepts ``fsdp`` and names a bad value's key.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

def test_adamw_impl_picks_torchs_fused_kernel_where_it_exists_and_honours_an_explicit_choice():
    import torch

    from common.config.load import ConfigError, load_config
    from learner.model import adamw_fused, build_optimizer

    repo = Path(__file__).resolve().parents[1]
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    params = list(model.parameters())
    assert adamw_fused(params, "auto") and adamw_fused(params, "fused") and not adamw_fused(params, "foreach")
    assert not adamw_fused([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))], "auto")  # no fused kernel
    for impl, fused in (("auto", True), ("foreach", None)):
        training = load_config(repo / "configs/demo_cpu.yaml", [f"training.adamw_impl={impl}"]).training
        optimizer, _ = build_optimizer(model, training)
        assert optimizer.defaults["fused"] is fused, impl
    with pytest.raises(ConfigError) as err:
        load_config(repo / "configs/demo_cpu.yaml", ["training.adamw_impl=apex"])
    assert "training.adamw_impl = 'apex'" in str(err.value) and "'fused'" in str(err.value)


if __name__ == "__main__":  # run as a rank script by torchrun: import from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest

from common.config.learner import FsdpConfig
from tests.spawned_ranks import run_ranks

STEPS, GA = 5, 2
JOIN_DEADLINE_S = 150


def _full(t: Any) -> Any:
    """A parameter or gradient as one plain CPU tensor (a DTensor shard is gathered: every rank must call it)."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().clone()


def rank_main(config: str, steps: int, out: str, overrides: list[str] = ()) -> int:
    """One learner rank: set up, ``steps`` async steps, full weights to ``out/weights.pt`` (rank 0; test-size models
    only), a result file. Also a GPU probe: ``python tests/test_learner_fsdp.py CONFIG STEPS OUT [key=value ...]``."""
    import torch

    from common.runs import cli
    from common.config.load import load_config
    from learner.distributed import Dist, env_world_size
    from learner.rank import Learner
    from learner.train import async_step

    cfg = load_config(config, list(overrides), world_size=env_world_size())
    dist = Dist(cfg.learner.backend, cfg.learner.collective_timeout_s)
    cli.setup_process("learner", dist.rank)
    result: dict[str, Any] = {"rank": dist.rank}
    learner = Learner(cfg, dist)
    try:
        learner.open_queue()
        learner.setup()
        learner.queue.start()
        result["fsdp_params"] = sum(type(p).__name__ == "DTensor" for p in learner.hf_model.parameters())
        for _ in range(steps):
            async_step(learner)
        if sum(p.numel() for p in learner.hf_model.parameters()) < 10**8:
            weights = {n: _full(p) for n, p in learner.hf_model.named_parameters()}
            if dist.is_main:
                torch.save(weights, Path(out) / "weights.pt")
        result["steps"] = learner.step
    except BaseException:  # recorded for the parent's message
        result["error"] = traceback.format_exc()[-3000:]
    finally:
        learner.close()
        Path(out, f"rank{dist.rank}.json").write_text(json.dumps(result))
        dist.close()
    return 0


# --------------------------------------------------------------------------------------------- the runs


class _Run:
    """One learner run in flight: its process, its fake actors (B packs) and where it writes."""

    def __init__(self, tmp: Path, name: str, nproc: int, model_dir: Path, data_dir: Path, pool: Any,
                 **learner: Any) -> None:
        from common.config.load import load_config
        from tests.test_learner_harness import FakeActor, Proc, keep_at_target, write_config

        self.name, self.nproc, self.out = name, nproc, tmp / name
        self.out.mkdir()
        training = {"max_steps": STEPS, "save_final": False, "gradient_accumulation_steps": GA, "save_every_steps": 0,
                    "trace_micro_steps": False, "gradient_checkpointing": learner.pop("checkpointing", False)}
        cfg_path = write_config(self.out / "cfg.yaml", model_dir=model_dir, data_dir=data_dir,
                                output_dir=self.out / "run", nproc=nproc, training=training,
                                learner={"pack_wait_s": 60.0, **learner},
                                stage2_ab={"schedule": {"b_ratio": 0.5 if pool is not None else 0.0}},
                                weight_sync={"every_steps": 1000})
        self.actors = []
        if pool is not None:
            transport = load_config(cfg_path, world_size=nproc).transport
            self.actors = [FakeActor(transport, r, pool, keep_at_target) for r in range(nproc)]
            for a in self.actors:
                a.start()
        script = [str(Path(__file__).resolve()), str(cfg_path), str(STEPS), str(self.out)]
        argv = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script]
                if nproc > 1 else [sys.executable, *script])
        self.proc = Proc(argv, self.out / "learner.log", env={"OMP_NUM_THREADS": "1"})

    def result(self, deadline: float) -> dict:
        import torch

        from tests.test_learner_harness import read_metrics

        try:
            rc = self.proc.wait(max(1.0, deadline - time.monotonic()), f"the {self.name} learner ({self.nproc} rank(s))")
        finally:
            self.proc.stop()
            for a in self.actors:
                a.stop_event.set()
        ranks = []
        for r in range(self.nproc):
            path = self.out / f"rank{r}.json"
            assert path.exists(), (f"{self.name}: rank {r} wrote no result (exit {rc}): it crashed early. "
                                   f"Log:\n{self.proc.tail()}")
            ranks.append(json.loads(path.read_text()))
            assert "error" not in ranks[r], f"{self.name} rank {r}:\n{ranks[r]['error']}"
        return {"rc": rc, "ranks": ranks, "metrics": read_metrics(self.out / "run"), "run_dir": self.out / "run",
                "weights": torch.load(self.out / "weights.pt")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, synth_data_dir) -> dict[str, dict]:
    """The five runs of the module docstring, all at once (each waits on nothing but its own ranks and actors)."""
    from tests.test_learner_harness import SegmentPool, private_copy

    tmp = tmp_path_factory.mktemp("fsdp")
    model, data = private_copy(tiny_model_dir, tmp / "model"), private_copy(synth_data_dir, tmp / "data")
    pool = SegmentPool(model, data)
    started = [
        _Run(tmp, "ddp2", 2, model, data, pool, parallel="ddp"),
        _Run(tmp, "fsdp2", 2, model, data, pool, parallel="fsdp", checkpointing=True),
        _Run(tmp, "ddp1", 1, model, data, None, parallel="ddp"),
        _Run(tmp, "fsdp1", 1, model, data, None, parallel="fsdp", fsdp={"cpu_offload": True}),
        _Run(tmp, "fsdp2r", 2, model, data, pool, parallel="fsdp", fsdp={"reduce_every_micro_step": True}),
    ]
    deadline = time.monotonic() + JOIN_DEADLINE_S
    try:
        return {run.name: run.result(deadline) for run in started}
    finally:
        for run in started:
            run.proc.stop()
            for a in run.actors:
                a.stop()


def _losses(run: dict) -> list[float]:
    return [r["loss/total"] for r in run["metrics"]]


def _max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_fsdp_on_two_ranks_follows_ddps_loss_curve_over_a_and_b_steps(runs):
    ddp, fsdp = runs["ddp2"], runs["fsdp2"]
    assert [r["fsdp_params"] > 0 for r in fsdp["ranks"]] == [True, True]  # really sharded
    assert [r["fsdp_params"] for r in ddp["ranks"]] == [0, 0]
    kinds = [[r["stage2_ab/async/step_kind_b"] for r in run["metrics"]] for run in (ddp, fsdp)]
    assert kinds[0] == kinds[1] == [0, 1, 0, 1, 0], "B must run at steps 1 and 3 in both runs (same packs)"
    assert len(_losses(fsdp)) == STEPS and _losses(ddp)[-1] < _losses(ddp)[0]  # it learns
    for step, (a, b) in enumerate(zip(_losses(ddp), _losses(fsdp))):
        assert b == pytest.approx(a, rel=1e-5), f"step {step}: ddp {a} vs fsdp {b}"
    norms = [[r["train/grad_norm"] for r in run["metrics"]] for run in (ddp, fsdp)]
    assert norms[1] == pytest.approx(norms[0], rel=2e-4)
    assert {r["learner/parallel"] for r in fsdp["metrics"]} == {"fsdp"}


@pytest.mark.slow
def test_reducing_after_every_micro_step_trains_as_reducing_once_a_step(runs):
    """learner.fsdp.reduce_every_micro_step: gradients reduce-scattered after each of the GA micro-steps and summed
    sharded give DDP's loss curve and weights (the memory it saves is counted in tests/test_gpu_budget.py)."""
    ddp, every = runs["ddp2"], runs["fsdp2r"]
    assert [r["fsdp_params"] > 0 for r in every["ranks"]] == [True, True]
    for step, (a, b) in enumerate(zip(_losses(ddp), _losses(every))):
        assert b == pytest.approx(a, rel=1e-5), f"step {step}: ddp {a} vs fsdp reducing every micro-step {b}"
    assert _max_weight_diff(ddp["weights"], every["weights"]) < 1e-4
    assert "reduce every micro-step True" in (every["run_dir"].parent / "learner.log").read_text()


@pytest.mark.slow
def test_fsdp_on_two_ranks_ends_at_ddps_weights(runs):
    ddp, fsdp = runs["ddp2"]["weights"], runs["fsdp2"]["weights"]
    assert _max_weight_diff(ddp, fsdp) < 1e-4
    assert _max_weight_diff(ddp, runs["ddp1"]["weights"]) > 1e-3  # the comparison has teeth: other data, other weights


@pytest.mark.slow
def test_a_one_rank_fsdp_run_with_cpu_offload_matches_the_plain_model(runs):
    plain, fsdp = runs["ddp1"], runs["fsdp1"]
    assert fsdp["ranks"][0]["fsdp_params"] > 0 and plain["ranks"][0]["fsdp_params"] == 0
    assert _losses(fsdp) == pytest.approx(_losses(plain), rel=1e-5)
    assert _max_weight_diff(plain["weights"], fsdp["weights"]) < 1e-4


@pytest.mark.slow
def test_every_step_record_carries_each_ranks_peak_memory_and_the_engine(runs):
    for name, run in runs.items():
        for rec in run["metrics"]:
            by_rank = rec["mem/peak_rss_gb_by_rank"]
            assert len(by_rank) == len(run["ranks"]) and all(0.05 < g < 64 for g in by_rank), (name, by_rank)
            assert rec["mem/peak_rss_gb"] == max(by_rank)
            assert "mem/peak_allocated_gb" not in rec  # a CPU learner: no CUDA allocator keys
            assert rec["learner/parallel"] == name.removesuffix("r")[:-1]  # ddp2, fsdp1, fsdp2r ...
            assert rec["time/step"] > rec["time/optimizer_step"] > 0  # the AdamW step is timed on its own


@pytest.mark.slow
def test_every_step_record_says_where_its_time_went(runs):
    from learner.metrics import STEP_TIME_KEYS  # on one rank they add up to time/step (docs/metrics.md, time/other)

    for name, run in runs.items():
        for rec in run["metrics"]:
            where = (name, rec["step"])
            assert rec["time/prepare_inputs"] > 0, where  # the step's inputs and normaliser are timed
            assert 0 <= rec["time/other"] < 0.5 * rec["time/step"], where  # most of a CPU step is in timed parts
            assert "time/forward_backward_gpu" not in rec, where  # a CPU learner: no device time, not 0
            if len(run["ranks"]) == 1:
                assert sum(rec[k] for k in STEP_TIME_KEYS) == pytest.approx(rec["time/step"], rel=1e-9, abs=1e-12), where
            # CPU: busy is the wall forward/backward, as before there was a device time
            assert rec["learner/busy_fraction"] == pytest.approx(rec["time/forward_backward_mean"] / rec["time/step"])


@pytest.mark.slow
def test_a_run_with_save_final_false_ends_at_max_steps_without_a_checkpoint(runs):
    from launcher.summary import read_final_state

    for name, run in runs.items():
        assert [r["step"] for r in run["metrics"]][-1] == STEPS - 1 and run["ranks"][0]["steps"] == STEPS, name
        assert not (run["run_dir"] / "checkpoints").exists() or not any((run["run_dir"] / "checkpoints").iterdir()), (
            f"{name}: training.save_final false wrote a checkpoint")
        # ... so the run's "end" record says what the server holds, and the summary reads it (no push: ver 0)
        final = read_final_state(run["run_dir"], run["metrics"])
        assert final is not None and final["record"] == "end" and final["step"] == STEPS and final["ver"] == 0, name
        assert final["sync_counts"]["sync/failures"] >= 1, name  # the start-up push had no server


@pytest.mark.slow
def test_the_run_summary_reports_the_engine_the_median_step_time_and_each_ranks_peak_memory(runs, capsys):
    import statistics

    from launcher.summary import print_summary

    run = runs["fsdp2"]
    print_summary(run["run_dir"])
    saved = json.loads((run["run_dir"] / "summary.json").read_text())
    assert saved["parallel"] == "fsdp"
    assert saved["step_time_median_s"] == statistics.median(r["time/step"] for r in run["metrics"])
    peaks = saved["peak_memory_gb_by_rank"]
    assert peaks["rss"] == [max(r["mem/peak_rss_gb_by_rank"][i] for r in run["metrics"]) for i in (0, 1)]
    assert peaks["allocated"] is None and peaks["reserved"] is None  # a CPU learner
    out = capsys.readouterr().out
    assert "learner                fsdp, step " in out
    # busy counts forward/backward only: the busy line says how long the optimizer steps took beside it
    steps_s = sum(r["time/optimizer_step"] for r in run["metrics"])
    assert saved["optimizer_step_s"] == pytest.approx(steps_s) and f"optimizer steps {steps_s:.2f} s)" in out
    fb, total = (sum(r[k] for r in run["metrics"]) for k in ("time/forward_backward_mean", "time/step"))
    assert saved["busy_fraction"] == pytest.approx(fb / total)  # time-weighted


# --------------------------------------------------------------------------------------------- an image-less pack


def _grad_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    """One of 2 gloo ranks: rank 0 trains a pack with an image, rank 1 one without; DDP then FSDP2 gradients."""
    import os
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from common.packing.segment import Pack
    from learner import parallel
    from learner.blocks import compile_blocks, set_checkpointing
    from learner.loss import LossWeights, Normaliser, pack_loss
    from learner.model import forward_rows, load_policy, pack_inputs
    from tests.test_loss import image_segment

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        cpu = torch.device("cpu")
        model_cfg = SimpleNamespace(path=model_dir, dtype="float32", attn_implementation="sdpa", coord_tokens=True)
        grads = {}
        for engine in ("ddp", "fsdp", "fsdp+compile"):  # the last: every layer checkpointed and compiled, as at 7b
            model, tokenizer, coord_ids = load_policy(model_cfg, cpu)
            if engine == "fsdp+compile":
                model.train()
                assert set_checkpointing(model, 1) > 0 and compile_blocks(model, backend="eager") > 0
            seg = image_segment(model, tokenizer, coord_ids, seed=rank + 1, n_images=1 - rank, n_text=20, n_boxes=1)
            fsdp_cfg = FsdpConfig(param_dtype="auto")  # the defaults but param_dtype
            wrapped = parallel.wrap(model, SimpleNamespace(parallel=engine.split("+")[0], fsdp=fsdp_cfg), cpu, 2, rank)
            inputs = pack_inputs(Pack(ver=0, channel="B", segments=[seg]).tensors(), "sdpa", torch.float32, cpu)
            terms = pack_loss(forward_rows(wrapped, inputs), inputs.rows, torch.tensor(coord_ids),
                              Normaliser(ce_tokens=40, boxes=2, scale=2.0), LossWeights())
            terms.backward.backward()
            grads[engine] = {n: _full(p.grad) for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(grads, Path(out) / "grads.pt")
        result["ok"] = True
    except BaseException:
        result["error"] = traceback.format_exc()[-3000:]
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip destroy_process_group: a failed peer may be gone


@pytest.mark.slow
def test_fsdp_gradients_compiled_or_not_equal_ddps_when_one_ranks_pack_has_no_image(tiny_model_dir, tmp_path):
    import torch

    from tests.ports import free_port_block

    port = free_port_block(1)
    run_ranks(_grad_rank, lambda r: (r, port, str(tiny_model_dir), str(tmp_path)), out_dir=tmp_path, deadline_s=120,
              hang_hint="the ranks' FSDP2 all-gathers are out of order (a rank ran the vision tower after its "
                        "language model?)",
              crash_hint="it crashed, e.g. gloo's 'collective mismatch' when the ranks' FSDP2 all-gathers run in "
                         "different orders")
    grads = torch.load(tmp_path / "grads.pt")
    ddp = grads["ddp"]
    vision = [n for n in ddp if ".visual." in f".{n}"]
    assert vision and sum(float(ddp[n].abs().sum()) for n in vision) > 0  # rank 0's image reached the tower
    for engine in ("fsdp", "fsdp+compile"):
        for n in ddp:
            tol = 1e-6 + 1e-4 * float(ddp[n].abs().max())
            assert float((ddp[n] - grads[engine][n]).abs().max()) <= tol, (engine, n)


# --------------------------------------------------------------------------------------------- config


def test_learner_parallel_fsdp_is_accepted_and_a_bad_value_is_refused_naming_the_key():
    from common.config.load import ConfigError, load_config

    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs/demo_cpu.yaml", ["learner.parallel=fsdp", "learner.fsdp.cpu_offload=true"])
    assert (cfg.learner.parallel, cfg.learner.fsdp.cpu_offload, cfg.learner.fsdp.param_dtype) == ("fsdp", True, "auto")
    with pytest.raises(ConfigError) as err:
        load_config(repo / "configs/demo_cpu.yaml", ["learner.parallel=zero3"])
    assert "learner.parallel = 'zero3'" in str(err.value) and "'fsdp'" in str(err.value)


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]))


# --------------------------------------------------------------------------------------------- block inputs' dtypes


def _block_dtypes_rank(model_dir: str, out: str) -> None:
    """One FSDP2 rank, bfloat16 compute over float32 weights, every layer checkpointed: the float dtypes each
    sharded block receives in its forward and in its recomputation."""
    import os
    from types import SimpleNamespace

    import torch

    from common.packing.segment import Pack
    from learner import parallel
    from learner.loss import LossWeights, Normaliser, pack_loss
    from learner.blocks import set_checkpointing
    from learner.model import forward_rows, load_policy, pack_inputs
    from tests.test_loss import image_segment

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": 0}
    try:
        cpu = torch.device("cpu")
        model_cfg = SimpleNamespace(path=model_dir, dtype="float32", attn_implementation="sdpa", coord_tokens=True)
        model, tokenizer, coord_ids = load_policy(model_cfg, cpu)
        model.train()  # checkpointing recomputes in training mode only
        assert set_checkpointing(model, 1) > 0
        seg = image_segment(model, tokenizer, coord_ids, seed=3, n_images=1, n_text=20, n_boxes=1)
        fsdp_cfg = FsdpConfig(param_dtype="bfloat16")  # the defaults but param_dtype
        wrapped = parallel.wrap(model, SimpleNamespace(parallel="fsdp", fsdp=fsdp_cfg), cpu, 1, 0)
        seen: dict[str, list[list[str]]] = {}

        def floats(x: Any) -> list[str]:
            if isinstance(x, torch.Tensor):
                return [str(x.dtype)] if x.is_floating_point() else []
            if isinstance(x, (tuple, list)):
                return [d for v in x for d in floats(v)]
            if isinstance(x, dict):
                return [d for k in sorted(x) for d in floats(x[k])]
            return []

        def recording(name: str, forward: Any) -> Any:  # inside the checkpoint: the recomputation calls it too
            def call(*args: Any, **kwargs: Any) -> Any:
                seen.setdefault(name, []).append(floats(args) + floats(kwargs))
                return forward(*args, **kwargs)
            return call

        for name, block in (("vision", model.model.visual.blocks[0]), ("decoder", model.model.language_model.layers[0])):
            block.forward.fn = recording(name, block.forward.fn)
        inputs = pack_inputs(Pack(ver=0, channel="A", segments=[seg]).tensors(), "sdpa", torch.float32, cpu)
        terms = pack_loss(forward_rows(wrapped, inputs).float(), inputs.rows, torch.tensor(coord_ids),
                          Normaliser(ce_tokens=20, boxes=1), LossWeights())
        terms.backward.backward()
        result.update(ok=True, seen=seen, loss=float(terms.total),
                      grads=sum(p.grad is not None for p in model.parameters()))
    except BaseException:
        result["error"] = traceback.format_exc()[-3000:]
    Path(out, "rank0.json").write_text(json.dumps(result))
    os._exit(0)


@pytest.mark.slow
def test_fsdp_blocks_get_their_inputs_uncast_as_under_ddp_so_a_recomputation_cannot_differ(tiny_model_dir, tmp_path):
    # torch 2.11's FSDP2 casts a block's float inputs to param_dtype in its forward pre-hook, but not when that
    # hook runs again for a checkpointed block's recomputation (transformers 5.17 checkpoints __call__, hooks
    # inside; 5.24 checkpoints forward, hooks outside, so the recomputation reuses the cast inputs). The vision
    # blocks' float32 rotary cos/sin were bfloat16 in one pass and float32 in the other, and a compiled block's
    # backward stopped ("Recomputed values ... different metadata"; 7b on 2 H200 ranks, docs/benchmarks.md
    # section 22). Uncast, the blocks see what they see under DDP in every pass, on any of these versions. Since
    # learner/blocks.py checkpoints each block's forward itself (hooks outside on every release), both passes
    # are recorded inside the checkpoint: the forward and its recomputation.
    import math

    res = run_ranks(_block_dtypes_rank, lambda r: (str(tiny_model_dir), str(tmp_path)), out_dir=tmp_path,
                    deadline_s=120, world=1, hang_hint="a one-rank FSDP2 forward/backward of one pack hung")[0]
    assert math.isfinite(res["loss"]) and res["grads"] > 0
    vision, decoder = res["seen"]["vision"], res["seen"]["decoder"]
    assert len(vision) == 2 and len(decoder) == 2, (vision, decoder)  # the forward and the recomputation
    assert all(c == vision[0] for c in vision) and all(c == decoder[0] for c in decoder)
    assert vision[0].count("torch.float32") == 2, vision  # the rotary cos and sin, not cast to bfloat16
    assert vision[0][0] == "torch.bfloat16" and set(decoder[0]) == {"torch.bfloat16"}  # hidden: in param_dtype
