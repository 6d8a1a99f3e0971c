"""How long pinning the FSDP2 overlap snapshot's host memory takes (issue 31), per pinned-allocator setting.

    python bench/bench_pinned_alloc.py [--preset 7b] [--vocab 151936] [--repeats 2] [--threads 8] [--out OUT.json]
    python bench/bench_pinned_alloc.py --quick      # the tiny preset; without CUDA nothing is pinned (the code path)

At 7b the start-up sync spent 20.2 s allocating the 16.6 GB host snapshot rank 0 keeps
(learner/weight_sync/shard_snapshot.py: one pinned tensor per served weight; docs/benchmarks.md section 22).
torch's pinned allocator takes each tensor from ``cudaHostAlloc`` by default; with
``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:N`` it maps the pages
with N threads and registers them with ``cudaHostRegister`` (torch's CUDA semantics notes). Each setting runs in
a fresh process (the allocator reads the variable once), ``--repeats`` times, allocating the preset's served
weights (shapes of the model built on the ``meta`` device, bfloat16) as the snapshot does (a pinned page is
resident once allocated: nothing to touch). One JSON line: per setting, the seconds (median and each run), GB,
tensors.

What this bench does not do: copy into the buffers (the device-to-host copies run beside training).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = {"default": "", "register": "pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"}


def served_shapes(preset: str, vocab: int | None) -> list[tuple[int, ...]]:
    """The preset's parameter shapes (its embedding widened to ``vocab`` rows), from a model on ``meta``."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tools.make_tiny_model import build_config, build_tokenizer

    config = build_config(preset, build_tokenizer())
    if vocab:
        config.text_config.vocab_size = vocab
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return [tuple(p.shape) for _, p in model.named_parameters()]


def child(shapes_file: str) -> dict:
    """One allocation of every served weight, pinned where CUDA is (what ShardSnapshot.prepare does on rank 0)."""
    import torch

    shapes = [tuple(s) for s in json.loads(Path(shapes_file).read_text())]
    pin = torch.cuda.is_available()
    if pin:
        torch.cuda.init()  # CUDA's own start-up is not the allocation's
    t0 = time.perf_counter()
    buffers = [torch.empty(s, dtype=torch.bfloat16, pin_memory=pin) for s in shapes]
    seconds = time.perf_counter() - t0
    nbytes = sum(b.numel() * b.element_size() for b in buffers)
    return {"seconds": seconds, "gb": nbytes / 1e9, "tensors": len(buffers), "pinned": pin}


def setting(name: str, conf: str, shapes_file: Path, repeats: int) -> dict:
    """``repeats`` fresh processes allocating with ``PYTORCH_CUDA_ALLOC_CONF=conf`` (empty: torch's default)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    runs = []
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, __file__, "--child", str(shapes_file)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"setting {name}: the child exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {"conf": conf, "seconds_median": statistics.median(r["seconds"] for r in runs),
            "seconds": [round(r["seconds"], 3) for r in runs], "gb": runs[0]["gb"], "tensors": runs[0]["tensors"],
            "pinned": runs[0]["pinned"]}


def run(args: argparse.Namespace) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pinned-alloc-") as tmp:
        shapes_file = Path(tmp) / "shapes.json"
        shapes_file.write_text(json.dumps(served_shapes(args.preset, args.vocab or None)))  # once, not per child
        rows = {name: setting(name, conf.format(threads=args.threads), shapes_file, args.repeats)
                for name, conf in SETTINGS.items()}
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"bench": "pinned_alloc", "preset": args.preset, "vocab": args.vocab, "threads": args.threads,
            "repeats": args.repeats, "device": device, "settings": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="7b", help="tools/make_tiny_model.py preset (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=151936, help="embedding rows (0: the tokenizer's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=8, help="pinned_num_register_threads")
    ap.add_argument("--out", default=None, help="also write the line here")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, one repeat (what tests run)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the shapes file: one allocation, then exit
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    if args.quick:
        args.preset, args.vocab, args.repeats = "tiny", 0, 1
    line = run(args)
    print(json.dumps(line))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
