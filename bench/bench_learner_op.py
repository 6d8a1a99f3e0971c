"""The learner at the users' operating point: one JSON line per row with tokens/s, MFU, peak memory, kernel
launches and where the step goes (issue 31).

    python bench/bench_learner_op.py [--preset 3b] [--vocab 151936] [--side 1024] [--max-objects 40]
        [--packing-length 12000] [--warmup 1] [--steps 3] [--rows sdpa,varlen-vision,varlen,varlen+chunked]
        [--out bench/results/x.json]
    python bench/bench_learner_op.py --quick    # the same code on the tiny preset, CPU, 112 px (tests/)
    python -m torch.distributed.run --nproc_per_node 2 bench/bench_learner_op.py --preset 7b [--parallel fsdp] ...

Everything is generated (bench/op_inputs.py; ``--work DIR`` keeps the rendered images for the next call): the
preset's config with ``--vocab`` rows, the tokenizer and a processor capped at ``--side``² pixels, random bf16
weights made on the device, synthetic ``--side`` px images with 1..``--max-objects`` shapes. The step is the
project's own: ``Encoder`` segments (untimed, the actors' work) → ``Packer`` packs of up to ``--packing-length``
tokens → timed: ``pack_inputs`` → ``forward_rows`` → ``pack_loss`` (or ``forward_loss`` with
``training.loss_head``) → backward → ``clip_and_step`` (fused AdamW), gradient checkpointing on, one pack per
step. Every row trains on the same packs on the same model.

Rows (``--rows``, comma-separated): ``sdpa`` (vision: one sdpa call per window; LM: sdpa with the [T, T]
mask), ``varlen-vision`` (vision varlen, LM as sdpa), ``varlen`` (both: ``model.attn_implementation: varlen``),
then ``+chunked`` for ``training.loss_head: chunked`` and ``+compile`` for ``torch.compile`` of every vision
block and decoder layer (``training.compile: blocks``; it stays on, so put such rows last).

Under torchrun (``WORLD_SIZE`` > 1) every rank trains its own packs (pack k goes to rank k mod world) on the model
wrapped as the learner wraps it (``--parallel``: ``fsdp``, FSDP2 over the ranks, or ``ddp``; learner/parallel.py
with the config's defaults), compiled before the wrap as the learner does, so there every row shares one
``+compile`` setting. A step's tokens/s is all ranks' tokens over the slowest rank's step; MFU divides by
world × the peak; ``peak_gib`` is the largest rank's; the split and the profile are rank 0's.

Fields: ``tokens_per_s`` (median over the ``--steps`` in which no rank compiled a graph: ``steps_measured``),
``mfu`` = 6 × non-embedding LM parameters × tokens/s ÷ ``peak_tflops``, the bf16 (CPU: model dtype) matmul rate
measured here on an 8192³ product; ``peak_gib`` (max allocated over the timed steps); the split ``inputs_s /
vision_s / lm_s / loss_s / optimizer_s`` (medians; forward + backward each, read from device events at the vision tower's forward hooks, the
gradient hooks on its output and on the logits: so the LM's share includes the head's projection, and
``loss_s`` is null with the chunked head, which runs inside the LM's forward); from one more step under
``torch.profiler``: ``kernel_launches_per_step`` (CUDA launch API calls; null on the CPU), ``gpu_busy_s``
(kernel time), ``top_ops`` (the 8 ops with most device time, or CPU time on the CPU); per rank: ``rank_step_s`` (every
timed step) and ``graphs_compiled_in_timed_steps`` (dynamo's count: > 0 means the timed steps paid compilation, and
on several ranks the others waited for it at the next collective: give compiled rows a warmup of more steps than
each rank has packs, as every new pack shape can recompile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from op_inputs import build_model, make_packs, model_dir, render_records  # noqa: E402  (bench/: the script's folder)

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel")


def set_attention(model, row: str) -> str:
    """Point the vision tower and the LM at the row's kernels; returns the name ``pack_inputs`` takes."""
    from learner import attention

    attention.register()
    vision, lm = {"sdpa": ("sdpa", "sdpa"), "varlen-vision": (attention.HF_NAME, "sdpa"),
                  "varlen": (attention.HF_NAME, attention.HF_NAME)}[row]
    model.config.vision_config._attn_implementation = vision
    model.config.text_config._attn_implementation = lm
    return attention.VARLEN if lm == attention.HF_NAME else "sdpa"


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------- the step


class Marks:
    """Named points on the device's timeline (CUDA events) or the host's clock (CPU)."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.at: dict[str, object] = {}

    def __call__(self, name: str) -> None:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.at[name] = event
        else:
            self.at[name] = time.perf_counter()

    def s(self, a: str, b: str) -> float:
        if self.cuda:
            return self.at[a].elapsed_time(self.at[b]) / 1000  # type: ignore[union-attr]
        return self.at[b] - self.at[a]  # type: ignore[operator]


def hook_vision(model, marks: list[Marks]) -> None:
    """Marks the vision tower's forward start/end and the moment its output's gradient arrives (its backward starts)."""
    from learner.model import vision_tower

    vis = vision_tower(model)

    def after(_module, _args, out) -> None:
        marks[0]("vis_f1")
        t = getattr(out, "pooler_output", None)
        t = t if t is not None else (out if hasattr(out, "register_hook") else out[0])
        if t.requires_grad:
            t.register_hook(lambda _g: marks[0]("vis_b0"))

    vis.register_forward_pre_hook(lambda *_: marks[0]("vis_f0"))
    vis.register_forward_hook(after)


def step(model, pack, attn: str, loss_head: str, optimizer, scheduler, coord_ids, dtype, device, marks: Marks) -> dict:
    """One timed optimizer step on one pack; returns its wall time, tokens and the split. ``model``: what the
    learner calls (the DDP wrapper, the FSDP2 root, or the model itself)."""
    from learner.loss import LossWeights, Normaliser, pack_loss
    from learner.model import clip_and_step, forward_rows, pack_inputs

    sync(device)
    t0 = time.perf_counter()
    marks("start")
    inputs = pack_inputs(pack.tensors(), attn, dtype, device)
    marks("inputs")
    norm = Normaliser(ce_tokens=inputs.rows.n_ce, boxes=inputs.rows.n_boxes)
    if loss_head == "plain":
        logits = forward_rows(model, inputs)
        marks("lm_f1")
        logits.register_hook(lambda _g: marks("loss_b1"))
        terms = pack_loss(logits, inputs.rows, coord_ids, norm, LossWeights())
    else:
        from learner.model import forward_loss

        terms = forward_loss(model, inputs, coord_ids, norm, LossWeights(), loss_head)
        marks("lm_f1")
    marks("loss_f1")
    terms.backward.backward()
    marks("bwd")
    clip_and_step(model, optimizer, scheduler, 1.0)
    marks("end")
    sync(device)
    wall = time.perf_counter() - t0
    m = marks.s
    lm_bwd_from = "loss_b1" if loss_head == "plain" else "loss_f1"
    vis_b0 = "vis_b0" if "vis_b0" in marks.at else "bwd"  # a frozen vision tower has no backward
    return {
        "step_s": wall, "tokens": inputs.n_tokens, "loss": terms.total,
        "inputs_s": m("start", "inputs"),
        "vision_s": m("vis_f0", "vis_f1") + m(vis_b0, "bwd"),
        "lm_s": m("inputs", "vis_f0") + m("vis_f1", "lm_f1") + m(lm_bwd_from, vis_b0),
        "loss_s": m("lm_f1", "loss_f1") + m("loss_f1", "loss_b1") if loss_head == "plain" else None,
        "optimizer_s": m("bwd", "end"),
    }


def profile_step(run, device, table: Path | None = None) -> dict:
    """Two more steps under torch.profiler, the second recorded (the first can compile: on 2 ranks at 7b it
    traced 9 frames, docs/benchmarks.md section 20): launches, kernel time, the ops with most device
    time (and the profiler's op tables in ``table``, if given: by device time, by host time, by host time with
    the 6 innermost Python frames of each op)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1), with_stack=table is not None,
                 acc_events=True) as prof:
        for _ in range(2):
            run()
            prof.step()
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    ops = sorted((a for a in prof.key_averages() if ".py(" not in a.key and not a.key.startswith("<built-in")),
                 key=lambda a: getattr(a, key, 0) or 0, reverse=True)  # torch ops, not the Python frames of with_stack
    if table is not None:  # what a GPU-bound step spends, then what a host-bound one does, and from where
        tables = [prof.key_averages().table(sort_by=k, row_limit=40, max_name_column_width=70)
                  for k in dict.fromkeys((key, "self_cpu_time_total"))]
        tables.append(prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=25))
        table.write_text("\n".join(tables) + "\n")
    return {
        "kernel_launches_per_step": sum(e.name in LAUNCH_CALLS for e in events) if device.type == "cuda" else None,
        "gpu_kernels_per_step": len(kernels) if device.type == "cuda" else None,
        "gpu_busy_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6 if device.type == "cuda" else None,
        "top_ops": [[a.key[:70], round((getattr(a, key, 0) or 0) / 1e3, 1), a.count] for a in ops[:8]],
    }


def run_row(row: str, model, trained, packs, args, optimizer, scheduler, coord_ids, dtype, device, marks: list[Marks],
            peak_tflops: float, lm_params: int, world: int = 1) -> dict:
    """``model``: the Hugging Face model (its attention, checkpointing, compile); ``trained``: what steps call."""
    import torch
    from torch._dynamo.utils import counters

    from learner.blocks import compile_blocks, set_checkpointing
    from learner.throughput import mfu

    attn_row, *flags = row.split("+")
    loss_head = "chunked" if "chunked" in flags else "plain"
    attn = set_attention(model, attn_row)
    every = next((int(f.removeprefix("ckpt")) for f in flags if f.startswith("ckpt")), 1)
    set_checkpointing(model, every)
    if "compile" in flags and world == 1:  # under torchrun: before the wrap (run)
        compile_blocks(model)

    def one(i: int) -> dict:
        marks[0] = Marks(device)
        before = counters["stats"]["unique_graphs"]
        out = step(trained, packs[i % len(packs)], attn, loss_head, optimizer, scheduler, coord_ids, dtype, device,
                   marks[0])
        return {**out, "compiled": counters["stats"]["unique_graphs"] - before}  # graphs this step compiled

    for i in range(args.warmup):
        one(i)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = [one(args.warmup + i) for i in range(args.steps)]
    compiled = sum(r["compiled"] for r in timed)  # > 0: the timed steps paid compilation (recompiles)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    table = (Path(f"{args.out.removesuffix('.json')}-{row.replace('+', '-')}.txt")
             if args.out and is_main_rank() else None)
    prof = profile_step(lambda: one(args.warmup + args.steps), device, table)  # the same pack twice
    ranks = [(timed, peak, compiled)]
    if world > 1:
        import torch.distributed as dist

        ranks = [None] * world
        dist.all_gather_object(ranks, (timed, peak, compiled))
        peak = max((p for _, p, _ in ranks if p is not None), default=None)
    steady = steady_steps([t for t, *_ in ranks])
    # step i: every rank's tokens over the slowest rank's time (they meet at the gradient reduction)
    tokens_per_s = statistics.median(sum(t[i]["tokens"] for t, *_ in ranks) / max(t[i]["step_s"] for t, *_ in ranks)
                                     for i in steady)
    med = lambda k: statistics.median(timed[i][k] for i in steady)  # noqa: E731
    return {
        "row": row, "attn": attn_row, "loss_head": loss_head, "checkpoint_every": every, "device": device_name(device),
        "ranks": world, "parallel": args.parallel if world > 1 else None,
        "tokens_per_s": round(tokens_per_s, 1), "mfu": round(mfu(tokens_per_s / world, lm_params, peak_tflops), 4),
        "peak_gib": round(peak, 2) if peak is not None else None,
        "kernel_launches_per_step": prof.pop("kernel_launches_per_step"),
        "step_s": round(med("step_s"), 3), "tokens_per_step": med("tokens"),
        "rank_step_s": [[round(r["step_s"], 3) for r in t] for t, *_ in ranks],  # every timed step of every rank
        **{k: (round(med(k), 3) if timed[0][k] is not None else None)
           for k in ("inputs_s", "vision_s", "lm_s", "loss_s", "optimizer_s")},
        "graphs_compiled_in_timed_steps": [c for *_, c in ranks],  # per rank: one rank compiling stalls all
        "steps_measured": len(steady),  # the timed steps no rank compiled in (all of them if every one did)
        "losses": [round(r["loss"], 4) for r in timed],  # NaN would show a broken row, not a slow one
        **prof,
    }


def steady_steps(ranks: list[list[dict]]) -> list[int]:
    """Indices of the timed steps in which no rank compiled a graph (a new pack length recompiles each kind of
    layer: 9-24 s at 3b and 7b, docs/benchmarks.md section 20); every index if no step was free of it."""
    clean = [i for i in range(len(ranks[0])) if not any(t[i].get("compiled") for t in ranks)]
    return clean or list(range(len(ranks[0])))


def apply_bench_recipe(model, recipe: str) -> dict[str, int]:
    """The learner's own recipe code (learner/recipe.py) on the bench's model; trainable parameters per group."""
    from common.config.recipe import AdapterConfig
    from learner.recipe import apply_recipe

    freeze, adapter = RECIPES[recipe]
    adapter = AdapterConfig(type=adapter, rank=16, alpha=32.0) if adapter else None
    return apply_recipe(model, argparse.Namespace(freeze=freeze, adapter=adapter))


def is_main_rank() -> bool:
    """Rank 0 (or no torchrun): the one that prints, writes --out and the profiler's tables."""
    return os.environ.get("RANK", "0") == "0"


def device_name(device) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")


# --------------------------------------------------------------------------------------------- main


ATTN_ROWS = ("sdpa", "varlen-vision", "varlen")
#: --recipe -> (model.freeze, model.adapter type): the model is built once a call, so one recipe a call
RECIPES = {"full": ([], None), "freeze-vision": (["vision"], None), "lora": ([], "lora"), "dora": ([], "dora")}
ROW_FLAGS = ("chunked", "compile", "ckpt0", "ckpt2", "ckpt3", "ckpt4")  # ckptN: recompute every Nth layer (0: none)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny preset on the CPU, 112 px, 1 step per row (tests)")
    ap.add_argument("--preset", default="3b")
    ap.add_argument("--vocab", type=int, default=151936, help="embedding rows (0 = the tokenizer's, rounded)")
    ap.add_argument("--side", type=int, default=1024, help="image side in pixels (the processor's cap: side²)")
    ap.add_argument("--max-objects", type=int, default=40)
    ap.add_argument("--packing-length", type=int, default=12000)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", default=None, help="default: sdpa,varlen-vision,varlen (--quick: sdpa,varlen)")
    ap.add_argument("--out", default=None, help="also write every row (and the setup) to this JSON file")
    ap.add_argument("--work", default=None,
                    help="keep the rendered records here for the next call (default: a temp dir)")
    ap.add_argument("--recipe", choices=tuple(RECIPES), default="full",
                    help="what trains: full (every weight), freeze-vision (model.freeze: [vision]), lora / dora "
                         "(model.adapter rank 16, alpha 32, all-linear: the users' adapter recipe)")
    ap.add_argument("--parallel", choices=("fsdp", "ddp"), default="fsdp", help="the wrap under torchrun (default fsdp)")
    ap.add_argument("--keep-unsharded", action="store_true",
                    help="FSDP2: learner.fsdp.reshard_after_forward false (blocks stay gathered until their backward)")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.vocab, args.side, args.max_objects, args.packing_length = "tiny", 0, 112, 4, 1024
        args.steps = 1
    args.rows = args.rows or ("sdpa,varlen" if args.quick else "sdpa,varlen-vision,varlen")
    for row in args.rows.split(","):
        attn, *flags = row.split("+")
        if attn not in ATTN_ROWS or not set(flags) <= set(ROW_FLAGS):
            ap.error(f"--rows: {row!r} is not <{'|'.join(ATTN_ROWS)}>[+{'][+'.join(ROW_FLAGS)}]")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and len({"+compile" in r for r in args.rows.split(",")}) > 1:
        ap.error(f"--rows {args.rows}: under torchrun the blocks are compiled before the wrap, for every row. Fix: "
                 "give +compile on every row or on none")
    if args.work:
        work = Path(args.work, f"rank{os.environ.get('RANK', '0')}")
        work.mkdir(parents=True, exist_ok=True)
        return run(args, work)
    with tempfile.TemporaryDirectory(prefix="bench-learner-op-") as tmp:
        return run(args, Path(tmp))


def run(args: argparse.Namespace, work: Path) -> int:
    t0 = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_record = args.side * args.side // 784 + 10 * args.max_objects + 200  # image + answer + prompt tokens, roughly
    n_records = world * (-(-args.packing_length * (args.warmup + args.steps + 1) // per_record) + 4)
    records = render_records(work, n_records, args.side, args.max_objects, world)
    path = model_dir(work, args.preset, args.vocab, args.side)
    packs = make_packs(path, records, args.packing_length)
    prep_s = time.perf_counter() - t0
    if len(packs) < world:
        print(f"error: {len(packs)} pack(s) reached 90 % of {args.packing_length} tokens from {len(records)} records, "
              f"fewer than the {world} ranks", file=sys.stderr)
        return 1

    import torch
    from transformers import AutoTokenizer

    from common.detection.coord_tokens import require_coord_tokens
    from learner.blocks import compile_blocks
    from learner.model import build_optimizer
    from learner.throughput import matmul_tflops, non_embedding_lm_params

    dist = None
    if world > 1:
        from learner.distributed import Dist

        dist = Dist("gloo" if args.quick else "auto", timeout_s=1800.0)
        device = dist.device if not args.quick else torch.device("cpu")
        packs = packs[dist.rank::world]
    else:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(path, device, dtype)
    lm_params = non_embedding_lm_params(model)  # before the adapter: the MFU's base is the model, not its adapter
    trainable = apply_bench_recipe(model, args.recipe)
    trained = model
    if dist is not None:
        from common.config.learner import FsdpConfig
        from learner import parallel

        if "+compile" in args.rows:
            compile_blocks(model)
        fsdp = FsdpConfig(reshard_after_forward=not args.keep_unsharded)
        trained = parallel.wrap(model, argparse.Namespace(parallel=args.parallel, fsdp=fsdp), device, world,
                                dist.local_rank)
    training = argparse.Namespace(lr=1e-5, weight_decay=0.0, adamw_impl="fused", warmup_steps=0, max_steps=1000,
                                  min_lr_ratio=0.1)
    optimizer, scheduler = build_optimizer(model, training)
    coord_ids = torch.tensor(require_coord_tokens(AutoTokenizer.from_pretrained(path), str(path)), device=device)
    peak_tflops = matmul_tflops(device, dtype)
    marks: list[Marks] = [Marks(device)]
    hook_vision(model, marks)
    main_rank = is_main_rank()
    setup = {"preset": args.preset, "embedding_rows": model.get_input_embeddings().weight.shape[0],
             "lm_params_non_embedding": lm_params, "side": args.side, "max_objects": args.max_objects,
             "packing_length": args.packing_length, "packs": len(packs), "pack_tokens": [p.n_tokens for p in packs],
             "pack_images": [sum(len(s.image_grid_thw) for s in p.segments) for p in packs],
             "peak_tflops": round(peak_tflops, 3), "dtype": str(dtype).removeprefix("torch."),
             "torch": torch.__version__, "prep_s": round(prep_s, 1), "gradient_checkpointing": True,
             "ranks": world, "parallel": args.parallel if world > 1 else None, "keep_unsharded": args.keep_unsharded,
             "recipe": args.recipe, "trainable_params": trainable}
    if main_rank:
        print(json.dumps({"setup": setup}), flush=True)
    rows = []
    for row in args.rows.split(","):
        rows.append(run_row(row, model, trained, packs, args, optimizer, scheduler, coord_ids, dtype, device, marks,
                            peak_tflops, lm_params, world))
        if main_rank:
            print(json.dumps(rows[-1]), flush=True)
    if args.out and main_rank:
        Path(args.out).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1) + "\n")
    if dist is not None:
        dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
