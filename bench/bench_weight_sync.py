"""Weight-sync throughput: learner rank 0 -> vLLM rollout server over NCCL, per load path, vs raw NCCL.

    python bench/bench_weight_sync.py --presets 0.5b,1.5b,7b --syncs 5 --out /tmp/bench_weight_sync.json
    python bench/bench_weight_sync.py --presets 1.5b --tp 2 --server-gpus 0,1 --learner-gpu 2   # 4 GPUs

For each preset (Qwen2.5-VL architecture, ``tools/make_tiny_model.py`` sizes):

1. a model directory with the config, tokenizer and processor; ``--weights random`` (default) also
   writes random weights into it (generated on the learner's GPU, saved as safetensors) and the server
   loads them as any checkpoint; ``--weights dummy`` writes none and the server starts with
   ``load_format=dummy`` (vLLM's own random init: quicker to set up, but a different load state);
2. raw NCCL in the same run on the same GPUs: one process per GPU (rank 0 on the learner's GPU, one
   receiver per server GPU, world size 1 + len(server GPUs), as in a sync) ``torch.distributed.broadcast``
   the same number of bytes, once as one buffer and once cut into the sync's packed chunks back to back;
3. ONE vLLM server (``python -m rollout_server``, ``configs/gpu/split_1p1.yaml`` with the GPU / TP
   overrides) and a learner process that pushes its weights with ``NcclWeightSender``, the load path
   (``--weight-load``: ``fast`` = the server's persistent buffers + copy plan, ``native`` = vLLM's
   ``update_weights``) chosen per push, path by path on the same server: one warm-up push (the first
   also builds the group, the first ``fast`` one records the copy plan), then ``--syncs`` timed pushes;
4. with both paths: the correctness check through ``GET /sync/digest`` (an exact digest of every served
   weight, one per server worker): perturb every weight, push ``fast``, digest, push the SAME weights
   ``native``, digest (equal: fast left nothing stale that native loads), perturb again, push
   ``native``, digest, push the same weights ``fast``, digest (equal), and the digests before and after
   a perturbation must differ (so "equal" means something). A mismatch is printed loudly and the
   exit code is 2.

Per sync: prep (``/sync/init``, the plan, the fingerprint), fence (``/sync/begin``), wire (the one
``/sync/update`` while rank 0 broadcasts, until every chunk is loaded: HTTP, the engine's worker RPC
and the transfer), commit (cache resets + ver),
total = the learner's stall in blocking mode; sync GB/s = bytes / wire. From the update's reply
(``SyncBucketResponse.load``): which load path really ran, the worker RPC's time, and the slowest
worker's receive+copy time on the host (``worker_s``) and on the GPU by CUDA events (``gpu_s``: first
broadcast enqueued to last copy done); data GB/s = bytes / gpu_s, the data plane alone, compared with
the raw chunked broadcast of the same bytes. A warm-up push of a path is repeated (up to
``weight_sync_lib.WARMUP_TRIES``) until that path really ran (the server defers the fast path while vLLM's
layerwise-reload wrappers are on its loaders), so the timed pushes never include a plan recording.
Results: one JSON object per preset in ``--out`` and a markdown table on stdout, one row per preset
and load path (docs/benchmarks.md).

This script holds the processes (server, raw NCCL ranks, the pushing learner) and their orchestration;
the push plan, digest check, statistics and table are bench/weight_sync_lib.py (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from weight_sync_lib import (  # bench/ is on sys.path: the script's own folder, or put there by the caller
    check_topology,
    count_fast_pushes,
    digest_verdict,
    fast_effective,
    mode_stats,
    parse_gpus,
    parse_modes,
    raw_ranks,
    raw_summary,
    run_ok,
    run_pushes,
    server_overrides,
    table,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PYPATH = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # keep what vLLM was installed under

# ------------------------------------------------------------------------------------ server log

# Server log lines kept in the result: one per update (which path ran, its own timing) and a refusal.
LOG_MARKERS = ("fast update:", "nccl update:", "fast weight load refused")


def server_log_lines(text: str) -> list[str]:
    """The server's weight-load messages, each from its marker on (whatever the log prefix and logger name)."""
    lines = []
    for line in text.splitlines():
        starts = [i for i in (line.find(m) for m in LOG_MARKERS) if i >= 0]
        if starts:
            lines.append(line[min(starts):])
    return lines


def log_counts(lines: list[str]) -> dict[str, int]:
    return {"fast": sum("fast update:" in x for x in lines), "native": sum("nccl update:" in x for x in lines),
            "fast_refused": sum("fast weight load refused" in x for x in lines)}


# ------------------------------------------------------------------------------------ setup


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


def write_random_weights(config_dir: str, out: str) -> None:
    """``out``: ``config_dir``'s files plus random bf16 weights, generated on this process's GPU."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.cuda.set_device(0)
    shutil.copytree(config_dir, out, dirs_exist_ok=True)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="4GB")
    (Path(out) / "random_weights.done").write_text("ok\n")


def weights_dir(preset: str, config_dir: Path, gpu: int) -> Path:
    """``{preset}-random``: the config dir with random weights (written once, by a process on ``gpu``)."""
    out = config_dir.parent / f"{preset}-random"
    if (out / "random_weights.done").is_file():
        return out
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONPATH": PYPATH}
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_weight_sync as b; "
            f"b.write_random_weights({str(config_dir)!r}, {str(out)!r})")
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True, timeout=600)
    return out


# ------------------------------------------------------------------------------------ raw NCCL


def raw_peer(rank: int, port: int, nbytes: int, chunks: list[int], reps: int, out: str, world: int = 2) -> None:
    """One of ``world`` ranks; rank 0 (learner's GPU) sends. Times a single buffer and the chunked stream."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
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


def run_raw(nbytes: int, chunks: list[int], reps: int, tmp: Path, learner_gpu: int = 1,
            server_gpus: list[int] | None = None) -> dict:
    from tests.ports import free_port_block

    ranks = raw_ranks(learner_gpu, server_gpus if server_gpus is not None else [0])
    port = free_port_block(1)
    out = tmp / "raw.json"
    procs = []
    for rank, gpu in ranks:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONPATH": PYPATH}
        code = (f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_weight_sync as b; "
                f"b.raw_peer({rank}, {port}, {nbytes}, {chunks!r}, {reps}, {str(out)!r}, {len(ranks)})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
    try:
        for p in procs:
            if p.wait(timeout=300) != 0:
                raise RuntimeError(f"raw broadcast rank exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return raw_summary(json.loads(out.read_text()), nbytes)


# ------------------------------------------------------------------------------------ learner side


def fetch_digest(url: str, timeout_s: float = 120.0, auth_token: str | None = None) -> dict:
    """``GET /sync/digest`` (retried while a session is still open: 409)."""
    import httpx

    headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(url + "/sync/digest", headers=headers, timeout=timeout_s)
        if r.status_code == 409 and time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        if r.status_code != 200:
            raise RuntimeError(f"GET /sync/digest -> {r.status_code}: {r.text[:300]}")
        return r.json()


def learner(url: str, model_dir: str, syncs: int, bucket_mb: int, out: str, modes: list[str] | None = None) -> None:
    """Builds the architecture on this process's GPU; pushes it per ``run_pushes`` (warm-ups, timed, digest)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from learner.weight_sync.nccl import NcclWeightSender

    modes = modes or ["native"]
    torch.cuda.set_device(0)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    sender = NcclWeightSender(url, timeout_s=300)
    bump = [0]

    def perturb() -> None:  # every weight changes (bf16 step near 0.02 is ~1e-4): an exact digest must notice
        bump[0] += 1
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 if bump[0] % 2 else -2e-3)
        torch.cuda.synchronize()

    def push(mode: str) -> dict:
        r = sender.push(model.named_parameters(), bucket_bytes=bucket_mb << 20, fence="drain", weight_load=mode)
        load = r.server_load or {}
        # prep: /sync/init, the plan and the fingerprint, before the fence (total = prep+fence+wire+commit)
        return {"ver": r.ver, "prep_s": r.total_s - r.fence_s - r.wire_s - r.commit_s, "fence_s": r.fence_s,
                "wire_s": r.wire_s, "commit_s": r.commit_s, "total_s": r.total_s,
                "bytes": r.bytes, "chunks": r.n_buckets, "server_update_s": r.server_update_s,
                "load_path": load.get("path"), "one_call": load.get("one_call"),
                **{k: load.get(k) for k in ("rpc_s", "worker_s", "gpu_s")}}

    try:
        res = run_pushes(push, perturb, lambda: fetch_digest(url), modes, syncs)
    finally:
        sender.close()
    Path(out).write_text(json.dumps(res))


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
    import httpx
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from common.weight_sync import weights as W
    from tests.ports import free_port_block

    modes, server_gpus, tp, learner_gpu = args.modes, args.server_gpu_list, args.tp, args.learner_gpu
    tag = f"{preset} tp{tp}"
    model_dir = build_config_dir(preset, Path(args.models))
    if args.weights == "random":
        t0 = time.monotonic()
        model_dir = weights_dir(preset, model_dir, learner_gpu)
        print(f"[{tag}] random weights in {model_dir} ({time.monotonic() - t0:.0f}s)", flush=True)
    with torch.device("meta"):
        meta = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    spec, _ = W.manifest_of(meta)
    sizes = [(e - b) for b, e in W.packed_offsets([(s.dtype, s.shape) for s in spec])]
    chunks = [sum(sizes[i] for i in idx) for idx in W.packed_chunks(sizes, args.bucket_mb << 20)]
    nbytes = sum(sizes)
    result: dict = {"preset": preset, "tp": tp, "server_gpus": server_gpus, "learner_gpu": learner_gpu,
                    "weight_load": modes, "params": sum(n // 2 for n in sizes), "bytes": nbytes, "tensors": len(sizes),
                    "bucket_mb": args.bucket_mb, "chunks": len(chunks), "weights": args.weights}
    print(f"[{tag}] {nbytes / 1e9:.2f} GB in {len(sizes)} tensors, {len(chunks)} chunks; server GPUs {server_gpus} "
          f"(TP {tp}), learner GPU {learner_gpu}; load paths {modes}", flush=True)
    result["raw"] = run_raw(nbytes, chunks, args.reps, tmp, learner_gpu, server_gpus) if args.reps > 0 else None
    print(f"[{tag}] raw (world {1 + len(server_gpus)}): {json.dumps(result['raw'])}", flush=True)

    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"server-{preset}-tp{tp}.log"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in server_gpus), "PYTHONPATH": PYPATH}
    cmd = [sys.executable, "-m", "rollout_server", "--config", str(REPO / "configs/gpu/split_1p1.yaml"),
           *server_overrides(model_dir, port, args.gpu_mem, server_gpus, tp, learner_gpu,
                             "dummy" if args.weights == "dummy" else "auto")]
    print(f"[{tag}] server: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {' '.join(cmd[1:])}", flush=True)
    with open(log, "w") as fh:
        server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        result["server_start_s"] = wait_health(url, server, 400, log)
        out = tmp / f"learner-{preset}.json"
        lenv = {**os.environ, "CUDA_VISIBLE_DEVICES": str(learner_gpu), "PYTHONPATH": PYPATH}
        code = (f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_weight_sync as b; "
                f"b.learner({url!r}, {str(model_dir)!r}, {args.syncs}, {args.bucket_mb}, {str(out)!r}, {modes!r})")
        subprocess.run([sys.executable, "-c", code], env=lenv, cwd=REPO, check=True, timeout=600)
        pushed = json.loads(out.read_text())
        try:
            result["health"] = httpx.get(url + "/health", timeout=5).json()
        except Exception as exc:  # noqa: BLE001 - informational only
            result["health"] = {"error": str(exc)}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            shutil.copy(log, Path(args.log_dir) / log.name)
    records = pushed["records"]
    result["server_log"] = server_log_lines(log.read_text())
    counts = log_counts(result["server_log"])
    fast_pushes = count_fast_pushes(records, pushed.get("digest"))
    result["server_log_counts"] = counts
    refused_in_health = "refused" in json.dumps(result.get("health", {}).get("engine_info", {}))
    result["fast_effective"] = ((fast_effective(records, pushed.get("digest"), counts) and not refused_in_health)
                                if "fast" in modes else None)
    print("\n".join(f"[{tag}] server: {line}" for line in result["server_log"]), flush=True)
    result["modes"] = mode_stats(records, nbytes, result["raw"])
    result.update(records=records, vers=[r["ver"] for r in records], digest=pushed.get("digest"))
    for mode, s in result["modes"].items():
        share = (f" = {100 * s['vs_raw_single']:.0f}% of raw single, {100 * s['vs_raw_chunked']:.0f}% of raw chunked"
                 if "vs_raw_single" in s else "")
        if "data_vs_raw_chunked" in s:
            share += f"; data plane {s['data_gb_s']:.1f} GB/s = {100 * s['data_vs_raw_chunked']:.0f}% of raw chunked"
        print(f"[{tag}] {mode}: median of {s['n']}: {json.dumps(s['median'])}; {s['sync_gb_s']:.1f} GB/s{share}",
              flush=True)
    if result["fast_effective"] is False:
        print(f"[{tag}] !!! FAST PATH NOT EFFECTIVE: {counts} server update lines for {fast_pushes} fast pushes, "
              f"health {result.get('health', {}).get('engine_info')}: the 'fast' figures are native ones", flush=True)
    d = result["digest"]
    if d is not None:
        verdict = digest_verdict(d)
        loud = "" if d.get("ok") else "!!! DIGEST CHECK FAILED: "
        print(f"[{tag}] {loud}digest: {verdict}; " + json.dumps({k: v for k, v in d.items() if k != "steps"}),
              flush=True)
        for s in d.get("steps", []):
            print(f"[{tag}]   digest after {s['mode']:6s} push ver {s['ver']}: {s['digests']}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="0.5b,1.5b,7b")
    ap.add_argument("--weight-load", default="fast,native",
                    help="server load paths to compare, a block of pushes each on one server (fast|native)")
    ap.add_argument("--syncs", type=int, default=5,
                    help="timed syncs per load path (after one warm-up push per path; the first builds the group)")
    ap.add_argument("--reps", type=int, default=3, help="raw broadcast repetitions (0: skip the raw broadcast)")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--weights", choices=("random", "dummy"), default="random",
                    help="server start: random weights written to the model dir (a checkpoint load), or vLLM's "
                         "load_format=dummy (default: %(default)s)")
    ap.add_argument("--server-gpus", default="0", help="GPUs of the vLLM server, e.g. 0,1 (default: %(default)s)")
    ap.add_argument("--tp", type=int, default=1, help="the server's tensor_parallel_size (divides len(server GPUs))")
    ap.add_argument("--learner-gpu", type=int, default=1, help="GPU of the pushing learner (default: %(default)s)")
    ap.add_argument("--gpu-mem", type=float, default=0.35, help="vLLM gpu_memory_utilization on the server GPUs")
    ap.add_argument("--models", default="/tmp/tandem-models")
    ap.add_argument("--log-dir", default=None, help="copy each server log here (default: not kept)")
    ap.add_argument("--out", default="bench_weight_sync.json")
    args = ap.parse_args(argv)
    try:
        args.modes = parse_modes(args.weight_load)
        args.server_gpu_list = parse_gpus(args.server_gpus)
        check_topology(args.server_gpu_list, args.tp, args.learner_gpu)
    except ValueError as exc:
        ap.error(str(exc))
    results, problems = [], []
    with tempfile.TemporaryDirectory(prefix="bench-wsync-") as d:
        for preset in args.presets.split(","):
            try:
                results.append(bench_preset(preset, args, Path(d)))
                problems += [f"{preset}: {p}" for p in run_ok(results[-1], args.modes)]
            except Exception as exc:  # noqa: BLE001 - report and go on with the next size
                print(f"[{preset}] FAILED: {type(exc).__name__}: {exc}", flush=True)
                problems.append(f"{preset}: {type(exc).__name__}")
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))
    for p in problems:
        print(f"!!! {p}", flush=True)
    if not results:
        return 1
    return 2 if any("digest" in p for p in problems) else (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
