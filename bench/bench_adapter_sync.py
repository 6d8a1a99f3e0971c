"""Adapter sync against merged sync: bytes, seconds per sync and the server's decode speed, per mode.

    python bench/bench_adapter_sync.py [--preset 3b] [--family qwen2.5-vl] [--syncs 3] [--json out.json]
    python bench/bench_adapter_sync.py --quick          # CPU: the hf engine and the tiny model (< 1 min)

A rollout server (GPU: vLLM on ``--server-gpu``, ``configs/gpu/split_1p1.yaml`` with CUDA graphs on; quick: the
hf engine on CPU, ``configs/demo_cpu.yaml``) serves a random-weight checkpoint of ``tools/make_tiny_model.py
--preset`` (built where missing, ``--init pool``). This process is the learner (GPU: ``--learner-gpu``, bf16;
quick: CPU, float32) with a DoRA adapter of rank ``--rank`` on every linear layer (random non-zero B). Per mode,
``--syncs`` pushes, each after the adapter changed (as after a training step), each printed as one JSON line:

* ``adapter`` (over http): the adapter's tensors alone, frozen names declared; the server merges on CPU
  (``merge_s`` and the workers' ``load_s`` read from the server's log line, vLLM only) inside ``commit_s``;
* ``merged`` (over ``--merged-transport``, nccl by default; quick: nccl over gloo): the learner's merged weights,
  frozen names declared as a training run declares them (vLLM sends them over nccl anyway).

Adapter first: a merged push writes every weight, after which a server no longer takes the frozen names.
Decode speed: the same greedy batch (``--decode-batch`` prompts, ``--decode-tokens`` tokens each, eos ignored)
before any sync and after each mode, in generated tokens per second: merged weights are plain weights, so the
server decodes at base speed whichever way they came. Last line: one JSON object (also ``--json``) with the
medians per mode. On 2 GPUs with the 3b preset it ends in under 5 minutes (building the preset aside).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

PHASES = ("total_s", "fence_s", "wire_s", "commit_s", "merge_s", "load_s")
MERGE_LOG = re.compile(r"adapter sync: \d+ layer\(s\) merged on CPU in ([\d.]+)s; \d+ tensors loaded by the workers "
                       r"in ([\d.]+)s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, hf engine, tiny model (a smoke run, not a benchmark)")
    ap.add_argument("--preset", default="3b", help="tools/make_tiny_model.py preset (3b; 7b for the bigger one)")
    ap.add_argument("--family", default="qwen2.5-vl", choices=["qwen2.5-vl", "qwen3-vl"])
    ap.add_argument("--models", default="/tmp/tandem-models", help="where presets are built / found")
    ap.add_argument("--modes", default="adapter,merged")
    ap.add_argument("--merged-transport", default="nccl", choices=["nccl", "http"])
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--server-gpu", type=int, default=0)
    ap.add_argument("--learner-gpu", type=int, default=1)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--json", default=None, help="write the final JSON object here too")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("adapter", "merged") for m in modes):
        ap.error(f"--modes {args.modes!r}: a comma list of adapter, merged")
    args.modes = sorted(modes, key=["adapter", "merged"].index)  # adapter first (module docstring)
    if args.quick:
        args.preset, args.decode_batch, args.decode_tokens = "tiny", 4, 16
        args.syncs = min(args.syncs, 2)
    return args


def learner_policy(model_dir: Path, device: str, dtype: torch.dtype, rank: int) -> torch.nn.Module:
    """The checkpoint with a DoRA adapter on every linear layer (learner/recipe.py, as a training run injects it)."""
    from transformers import AutoModelForImageTextToText

    from learner.recipe import inject_adapter

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(device)
    cfg = SimpleNamespace(type="dora", rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules="all-linear",
                          modules_to_save=[], sync="adapter")
    inject_adapter(model, cfg, set())
    return model


@torch.no_grad()
def train_step_like(model: torch.nn.Module, seed: int) -> None:
    """What a training step does to an adapter run's weights: every B and magnitude moves a little."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if ".lora_B." in name or ".lora_magnitude_vector." in name:
            p.add_(0.01 * torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype))


def decode_tokens_per_s(url: str, prompt_ids: list[int], batch: int, tokens: int) -> float:
    """Generated tokens per second of one greedy batch (eos ignored: every row decodes ``tokens``)."""
    body = {"items": [{"prompt_token_ids": prompt_ids}] * batch,
            "sampling": {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}}
    httpx.post(url + "/infer", json=body, timeout=300).raise_for_status()  # warm-up (graphs, caches)
    t0 = time.monotonic()
    r = httpx.post(url + "/infer", json=body, timeout=300)
    r.raise_for_status()
    n = sum(len(o["token_ids"]) for o in r.json()["outputs"])
    return n / (time.monotonic() - t0)


def run_mode(mode: str, args: argparse.Namespace, srv, model: torch.nn.Module, seed0: int) -> list[dict]:
    """``--syncs`` pushes of one mode, one JSON line each."""
    from learner.recipe import adapter_push, frozen_names
    from learner.weight_sync.served import named_weights
    from learner.weight_sync.transport import make_sender

    transport = "http" if mode == "adapter" else args.merged_transport
    frozen = frozen_names(model)
    rows = []
    with make_sender(srv.url, transport, timeout_s=300) as sender:
        for k in range(args.syncs):
            train_step_like(model, seed0 + k)
            merged = list(named_weights(model))
            push = adapter_push(model) if mode == "adapter" else None
            report = sender.push(merged, bucket_bytes=args.bucket_mb << 20, skip=frozen, adapter=push)
            found = MERGE_LOG.findall(srv.log_tail(200)) if mode == "adapter" else []
            row = {"mode": mode, "transport": transport, "sync": k, "ver": report.ver, "bytes": report.bytes,
                   "skipped_bytes": report.skipped_bytes, "total_s": report.total_s, "fence_s": report.fence_s,
                   "wire_s": report.wire_s, "commit_s": report.commit_s,
                   "merge_s": float(found[-1][0]) if found else None, "load_s": float(found[-1][1]) if found else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in rows) for k in PHASES if all(r[k] is not None for r in rows)}
    return {"syncs": len(rows), "transport": rows[0]["transport"], "bytes": rows[-1]["bytes"],
            "skipped_bytes": rows[-1]["skipped_bytes"], "median": med}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from learner.weight_sync.served import named_weights
    from tests.server_proc import REPO as _REPO, rollout_server_process
    from tools.make_tiny_model import ensure_tiny_model

    if args.quick:
        tiny = "tiny-model" if args.family == "qwen2.5-vl" else "tiny-qwen3-model"  # tests/conftest.py's dirs
        model_dir = ensure_tiny_model(REPO / "artifacts" / tiny, family=args.family)
        device, dtype = "cpu", torch.float32
        server = dict(config=_REPO / "configs" / "demo_cpu.yaml", deadline_s=120)
    else:
        name = args.preset if args.family == "qwen2.5-vl" else f"{args.family}-{args.preset}"
        model_dir = ensure_tiny_model(Path(args.models) / name, preset=args.preset, family=args.family, init="pool")
        device, dtype = f"cuda:{args.learner_gpu}", torch.bfloat16
        server = dict(config=_REPO / "configs" / "gpu" / "split_1p1.yaml", log_level=None, deadline_s=400,
                      env={"CUDA_VISIBLE_DEVICES": str(args.server_gpu)})
        torch.cuda.set_device(args.learner_gpu)
    model = learner_policy(model_dir, device, dtype, args.rank)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tok(tok.apply_chat_template([{"role": "user", "content": "Detect all objects."}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    overrides = [] if args.quick else [f"rollout_server.gpu_memory_utilization={args.gpu_mem}",
                                       "rollout_server.sync_idle_timeout_s=120"]
    results: dict = {"preset": args.preset, "family": args.family, "quick": args.quick, "rank": args.rank,
                     "adapter": "dora all-linear", "modes": {}}
    with rollout_server_process(model_dir, overrides, **server) as srv:
        results["decode_tok_s_base"] = decode_tokens_per_s(srv.url, prompt_ids, args.decode_batch, args.decode_tokens)
        for i, mode in enumerate(args.modes):
            rows = run_mode(mode, args, srv, model, seed0=100 * i)
            results["modes"][mode] = {**summary(rows), "decode_tok_s_after": decode_tokens_per_s(
                srv.url, prompt_ids, args.decode_batch, args.decode_tokens)}
            print(json.dumps({"mode": mode, **results["modes"][mode]}), flush=True)
    results["full_bytes"] = sum(t.numel() * t.element_size() for _, t in named_weights(model))
    results["device"] = torch.cuda.get_device_name(args.learner_gpu) if not args.quick else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
