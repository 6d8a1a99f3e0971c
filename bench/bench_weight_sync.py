"""Weight-sync throughput: learner rank 0 (GPU 1) -> vLLM rollout server (GPU 0) over NCCL, vs raw NCCL.

    python bench/bench_weight_sync.py --presets 0.5b,1.5b,7b --syncs 5 --out /tmp/bench_weight_sync.json

For each preset (Qwen2.5-VL architecture, ``tools/make_tiny_model.py`` sizes):

1. a model directory with the config, tokenizer and processor only (no weights: the server loads
   ``load_format=dummy`` random weights, the learner builds the same architecture on its GPU);
2. raw NCCL in the same run on the same two GPUs: two processes (one per GPU, as the server and the
   learner are) ``torch.distributed.broadcast`` the same number of bytes, once as one buffer and once
   cut into the sync's packed chunks back to back;
3. the vLLM server (``python -m rollout_server``, ``configs/gpu/split_1p1.yaml``) on GPU 0, and a
   learner process on GPU 1 that pushes its weights ``--syncs`` times with ``NcclWeightSender``
   (the first push also builds the group and is reported apart).

Per sync: fence (``/sync/begin``), wire (the one ``/sync/update`` while rank 0 broadcasts, until
every chunk is loaded), commit (``finish_weight_update`` + cache resets + ver), total = the
learner's stall in blocking mode; effective GB/s = bytes / wire. Results: one JSON object per preset
in ``--out`` and a markdown table on stdout (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PYPATH = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # keep what vLLM was installed under


def build_config_dir(preset: str, root: Path) -> Path:
    """Config + tokenizer + processor of a preset, no weights (the server uses load_format=dummy)."""
    out = root / f"{preset}-config-only"
    if (out / "config.json").is_file():
        return out
    sys.path.insert(0, str(REPO / "tools"))
    import make_tiny_model as mtm

    out.mkdir(parents=True, exist_ok=True)
    tok = mtm.build_tokenizer(True)
    config = mtm.build_config(preset, tok)
    config.save_pretrained(out)
    tok.save_pretrained(out)
    mtm.build_image_processor().save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}) + "\n")
    return out


# ------------------------------------------------------------------------------------ raw NCCL


def raw_peer(rank: int, port: int, nbytes: int, chunks: list[int], reps: int, out: str) -> None:
    """One of two ranks; rank 0 (learner's GPU) sends. Times a single buffer and the chunked stream."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", 0))
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    views, pos = [], 0
    for n in chunks:
        views.append(buf[pos:pos + n])
        pos += n
    res: dict[str, list[float]] = {"single_s": [], "chunked_s": []}
    for rep in range(reps + 1):  # the first is warm-up
        for kind, parts in (("single_s", [buf]), ("chunked_s", views)):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for p in parts:
                dist.broadcast(p, src=0)
            torch.cuda.synchronize()
            if rep:
                res[kind].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def run_raw(nbytes: int, chunks: list[int], reps: int, tmp: Path) -> dict:
    from tests.ports import free_port_block

    port = free_port_block(1)
    out = tmp / "raw.json"
    procs = []
    for rank, gpu in ((0, "1"), (1, "0")):  # rank 0 on the learner's GPU, as in a sync
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONPATH": PYPATH}
        code = (f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_weight_sync as b; "
                f"b.raw_peer({rank}, {port}, {nbytes}, {chunks!r}, {reps}, {str(out)!r})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
    for p in procs:
        if p.wait(timeout=300) != 0:
            raise RuntimeError(f"raw broadcast rank exited with {p.returncode}")
    res = json.loads(out.read_text())
    return {k: {"median_s": statistics.median(v), "best_s": min(v),
                "gb_s": nbytes / statistics.median(v) / 1e9} for k, v in res.items()}


# ------------------------------------------------------------------------------------ learner side


def learner(url: str, model_dir: str, syncs: int, bucket_mb: int, out: str) -> None:
    """Builds the architecture on this process's GPU and pushes it ``syncs`` + 1 times."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from learner.nccl_sync import NcclWeightSender

    torch.cuda.set_device(0)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    sender = NcclWeightSender(url, timeout_s=300)
    records = []
    for k in range(syncs + 1):
        with torch.no_grad():  # a "step": the weights change between pushes
            next(model.parameters()).add_(1e-3)
        torch.cuda.synchronize()
        r = sender.push(model.named_parameters(), bucket_bytes=bucket_mb << 20, fence="drain")
        records.append({"first": k == 0, "ver": r.ver, "fence_s": r.fence_s, "wire_s": r.wire_s,
                        "commit_s": r.commit_s, "total_s": r.total_s, "bytes": r.bytes, "chunks": r.n_buckets,
                        "server_update_s": r.server_update_s})
    Path(out).write_text(json.dumps(records))
    sender.close()


# ------------------------------------------------------------------------------------ orchestration


def wait_health(url: str, proc: subprocess.Popen, deadline_s: float, log: Path) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n" + log.read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {deadline_s}s:\n" + log.read_text()[-3000:])


def bench_preset(preset: str, args: argparse.Namespace, tmp: Path) -> dict:
    from transformers import AutoConfig, AutoModelForImageTextToText
    import torch

    from rollout_server import weights as W
    from tests.ports import free_port_block

    model_dir = build_config_dir(preset, Path(args.models))
    with torch.device("meta"):
        meta = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    spec, _ = W.manifest_of(meta)
    sizes = [(e - b) for b, e in W.packed_offsets([(s.dtype, s.shape) for s in spec])]
    chunks = [sum(sizes[i] for i in idx) for idx in W.packed_chunks(sizes, args.bucket_mb << 20)]
    nbytes = sum(sizes)
    result: dict = {"preset": preset, "params": sum(n // 2 for n in sizes), "bytes": nbytes, "tensors": len(sizes),
                    "bucket_mb": args.bucket_mb, "chunks": len(chunks)}
    print(f"[{preset}] {nbytes / 1e9:.2f} GB in {len(sizes)} tensors, {len(chunks)} chunks", flush=True)
    result["raw"] = run_raw(nbytes, chunks, args.reps, tmp)
    print(f"[{preset}] raw: {json.dumps(result['raw'])}", flush=True)

    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"server-{preset}.log"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": PYPATH}
    cmd = [sys.executable, "-m", "rollout_server", "--config", str(REPO / "configs/gpu/split_1p1.yaml"),
           f"model.path={model_dir}", f"rollout_server.port={port}", "rollout_server.load_format=dummy",
           f"rollout_server.gpu_memory_utilization={args.gpu_mem}"]
    with open(log, "w") as fh:
        server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        result["server_start_s"] = wait_health(url, server, 400, log)
        out = tmp / f"learner-{preset}.json"
        lenv = {**os.environ, "CUDA_VISIBLE_DEVICES": "1", "PYTHONPATH": PYPATH}
        code = (f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_weight_sync as b; "
                f"b.learner({url!r}, {str(model_dir)!r}, {args.syncs}, {args.bucket_mb}, {str(out)!r})")
        subprocess.run([sys.executable, "-c", code], env=lenv, cwd=REPO, check=True, timeout=600)
        records = json.loads(out.read_text())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    steady = [r for r in records if not r["first"]] or records
    med = {k: statistics.median(r[k] for r in steady) for k in ("fence_s", "wire_s", "commit_s", "total_s",
                                                                "server_update_s")}
    result["server_log"] = [line.split("vllm: ", 1)[-1] for line in log.read_text().splitlines() if "nccl update:" in line]
    print("\n".join(f"[{preset}] server: {line}" for line in result["server_log"]), flush=True)
    result.update(first=records[0], syncs=steady, median=med, vers=[r["ver"] for r in records],
                  sync_gb_s=nbytes / med["wire_s"] / 1e9)
    result["vs_raw_single"] = result["sync_gb_s"] / result["raw"]["single_s"]["gb_s"]
    result["vs_raw_chunked"] = result["sync_gb_s"] / result["raw"]["chunked_s"]["gb_s"]
    print(f"[{preset}] sync median: {json.dumps(med)}; {result['sync_gb_s']:.1f} GB/s = "
          f"{100 * result['vs_raw_single']:.0f}% of raw single, {100 * result['vs_raw_chunked']:.0f}% of raw chunked",
          flush=True)
    return result


def table(results: list[dict]) -> str:
    rows = ["| model | GB | chunks | fence s | wire s | commit s | stall s (total) | sync GB/s | raw GB/s (1 buffer / chunked) "
            "| sync / raw | first push s (group setup) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median"]
        rows.append(f"| {r['preset']} | {r['bytes'] / 1e9:.2f} | {r['chunks']} | {m['fence_s']:.3f} | {m['wire_s']:.3f} | "
                    f"{m['commit_s']:.3f} | {m['total_s']:.3f} | {r['sync_gb_s']:.1f} | "
                    f"{r['raw']['single_s']['gb_s']:.1f} / {r['raw']['chunked_s']['gb_s']:.1f} | "
                    f"{100 * r['vs_raw_single']:.0f}% / {100 * r['vs_raw_chunked']:.0f}% | {r['first']['total_s']:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="0.5b,1.5b,7b")
    ap.add_argument("--syncs", type=int, default=5, help="timed syncs per preset (after one that builds the group)")
    ap.add_argument("--reps", type=int, default=3, help="raw broadcast repetitions")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--gpu-mem", type=float, default=0.35, help="vLLM gpu_memory_utilization on GPU 0")
    ap.add_argument("--models", default="/tmp/tandem-models")
    ap.add_argument("--out", default="bench_weight_sync.json")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-wsync-") as d:
        for preset in args.presets.split(","):
            try:
                results.append(bench_preset(preset, args, Path(d)))
            except Exception as exc:  # noqa: BLE001 - report and go on with the next size
                print(f"[{preset}] FAILED: {type(exc).__name__}: {exc}", flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
