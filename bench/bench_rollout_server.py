"""Rollout server throughput (hf engine) and weight-sync time, over real HTTP on loopback.

    python bench/bench_rollout_server.py [--repeats 5] [--max-tokens 64] [--json out.json]

What is measured, against one ``python -m rollout_server`` process (hf engine, tiny model, CPU):
  - /infer throughput for a few shapes: batch size x concurrent clients x text-only or one image
    per item; sampling at temperature 1 (seeded) with ``max_tokens`` fixed, so nearly every item
    generates the full budget. Reported per shape: requests/s, items/s, generated tokens/s and the
    median request latency, each the median over ``--repeats`` rounds.
  - weight sync: ``HttpWeightSender.push`` of the model's full weights (fp32, tied embedding once)
    through the fence with HTTP safetensors buckets, at two bucket sizes; median total / fence /
    wire / commit seconds over ``--repeats`` pushes, while the server is idle.

The client runs in this process (httpx threads), so on a 2-core box client and server share the
cores, like actor and server would on such a box. Inputs are built on demand.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from common.wire.http import InferResponse  # noqa: E402

SHAPES = [  # (batch items, concurrent clients, images per item)
    (1, 1, 0),
    (8, 1, 0),
    (8, 2, 0),
    (8, 1, 1),
]


def start_server(model_dir: Path, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rollout_server", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
           f"rollout_server.port={port}", f"model.path={model_dir}", "rollout_server.hf_max_batch=8",
           "rollout_server.log_level=warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    end = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"rollout server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            proc.kill()
            raise SystemExit(f"rollout server not healthy after 120s (python -m rollout_server); log: {log.name}")
        time.sleep(0.2)


def items_for(batch: int, images: int, image_path: Path) -> list[dict]:
    out = []
    for k in range(batch):
        content = [{"type": "image"}] * images + [{"type": "text", "text": f"Detect all objects. ({k})"}]
        item = {"id": f"b{k}", "messages": [{"role": "user", "content": content}]}
        if images:
            item["images"] = [str(image_path)] * images
        out.append(item)
    return out


def throughput(url: str, batch: int, clients: int, images: int, image_path: Path, max_tokens: int,
               requests_per_client: int) -> dict[str, float]:
    body = {"items": items_for(batch, images, image_path),
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": max_tokens, "seed": 0}}

    def one_client(_: int) -> tuple[list[float], int]:
        lat, tokens = [], 0
        with httpx.Client(timeout=300) as c:
            for _ in range(requests_per_client):
                t0 = time.perf_counter()
                r = c.post(url + "/infer", json=body)
                r.raise_for_status()
                lat.append(time.perf_counter() - t0)
                tokens += sum(len(o.token_ids) for o in InferResponse.model_validate_json(r.content).outputs)
        return lat, tokens

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one_client, range(clients)))
    wall = time.perf_counter() - t0
    n_req = clients * requests_per_client
    return {"requests_per_s": n_req / wall, "items_per_s": n_req * batch / wall,
            "tokens_per_s": sum(t for _, t in results) / wall,
            "latency_s": statistics.median(x for lat, _ in results for x in lat)}


def sync_times(url: str, model_dir: Path, bucket_mb: float, repeats: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForImageTextToText

    from learner.weight_sync.http import HttpWeightSender

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    reports = []
    with HttpWeightSender(url, timeout_s=300) as client:
        for _ in range(repeats):
            reports.append(client.push(model.named_parameters(), bucket_bytes=int(bucket_mb * 2**20), fence="drain"))
    med = {k: statistics.median(getattr(r, k) for r in reports) for k in ("total_s", "fence_s", "wire_s", "commit_s")}
    return {**med, "mb": reports[0].bytes / 1e6, "n_buckets": reports[0].n_buckets}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from common.data.synthetic import ensure_synthetic_data
    from tests.ports import free_port_block
    from tools.make_tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model(ROOT / "artifacts" / "tiny-model")
    data_dir = ensure_synthetic_data(ROOT / "artifacts" / "data" / "synth")
    image_path = sorted((data_dir / "images").glob("*.png"))[0]
    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="bench-rollout-server-", suffix=".log", delete=False)
    proc = start_server(model_dir, port, log)
    rows, syncs = [], []
    try:
        throughput(url, 2, 1, 1, image_path, 8, 2)  # warm-up (first-call allocations)
        for batch, clients, images in SHAPES:
            rounds = [throughput(url, batch, clients, images, image_path, args.max_tokens, args.requests_per_client)
                      for _ in range(args.repeats)]
            rows.append({"batch": batch, "clients": clients, "images": images,
                         **{k: statistics.median(r[k] for r in rounds) for k in rounds[0]}})
        for bucket_mb in (4.0, 0.25):
            syncs.append({"bucket_mb": bucket_mb, **sync_times(url, model_dir, bucket_mb, args.repeats)})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()

    import torch

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
               f"({torch.get_num_threads()} threads), python {platform.python_version()}")
    print(f"rollout server bench — hf engine, tiny model ({model_dir.name}), CPU — {machine}")
    print(f"/infer, temperature 1, max_tokens {args.max_tokens}, {args.requests_per_client} requests per client, "
          f"median of {args.repeats} rounds")
    print(f"{'batch':>5} {'clients':>7} {'img/item':>8} {'req/s':>8} {'items/s':>8} {'tok/s':>8} {'p50 lat s':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['clients']:>7} {r['images']:>8} {r['requests_per_s']:>8.2f} {r['items_per_s']:>8.2f} "
              f"{r['tokens_per_s']:>8.0f} {r['latency_s']:>9.3f}")
    print(f"weight sync (HTTP safetensors buckets, fence drain, idle server), median of {args.repeats}")
    print(f"{'bucket MB':>9} {'MB':>6} {'buckets':>7} {'total s':>8} {'fence s':>8} {'wire s':>8} {'commit s':>8}")
    for s in syncs:
        print(f"{s['bucket_mb']:>9} {s['mb']:>6.2f} {s['n_buckets']:>7} {s['total_s']:>8.3f} {s['fence_s']:>8.3f} "
              f"{s['wire_s']:>8.3f} {s['commit_s']:>8.3f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "infer": rows, "sync": syncs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
