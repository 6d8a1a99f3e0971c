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
:data:`WARMUP_TRIES`) until that path really ran (the server defers the fast path while vLLM's
layerwise-reload wrappers are on its loaders), so the timed pushes never include a plan recording.
Results: one JSON object per preset in ``--out`` and a markdown table on stdout, one row per preset
and load path (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PYPATH = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # keep what vLLM was installed under

LOAD_PATHS = ("fast", "native")
PHASES = ("prep_s", "fence_s", "wire_s", "commit_s", "total_s", "server_update_s", "rpc_s", "worker_s", "gpu_s")
#: Warm-up pushes per path at most, until the server reports that path ran (see the module docstring).
WARMUP_TRIES = 3
# Server log lines kept in the result: one per update (which path ran, its own timing) and a refusal.
LOG_MARKERS = ("fast update:", "nccl update:", "fast weight load refused")


# ------------------------------------------------------------------------------------ pure helpers


def parse_modes(text: str) -> list[str]:
    """``fast,native`` -> ['fast', 'native']; unknown or repeated names are an error."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in LOAD_PATHS]
    if not modes or bad or len(set(modes)) != len(modes):
        raise ValueError(f"--weight-load {text!r}: a comma list of distinct {'|'.join(LOAD_PATHS)}")
    return modes


def parse_gpus(text: str) -> list[int]:
    """``0,1`` -> [0, 1]."""
    gpus = [int(g) for g in str(text).split(",") if g.strip()]
    if not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise ValueError(f"GPU list {text!r}: distinct non-negative ids, e.g. 0,1")
    return gpus


def check_topology(server_gpus: list[int], tp: int, learner_gpu: int) -> None:
    if tp < 1 or len(server_gpus) % tp:
        raise ValueError(f"--tp {tp} must divide the number of --server-gpus {server_gpus}")
    if learner_gpu in server_gpus:
        raise ValueError(f"--learner-gpu {learner_gpu} is one of --server-gpus {server_gpus}")


def sync_order(modes: list[str], syncs: int) -> list[tuple[str, bool]]:
    """(mode, warm-up) per push: per mode a block, its warm-up then ``syncs`` timed pushes.

    Blocks, not alternation: a training run pushes through one path every sync, and the fast path's
    steady state (one worker call per sync, the plan held) starts only from its second push in a row.
    """
    return [(m, w) for m in modes for w in [True] + [False] * syncs]


def server_overrides(model_dir: str | Path, port: int, gpu_mem: float, server_gpus: list[int], tp: int,
                     learner_gpu: int, load_format: str = "dummy") -> list[str]:
    """Dotted overrides of configs/gpu/split_1p1.yaml for the bench server (OmegaConf list syntax)."""
    return [f"model.path={model_dir}", f"rollout_server.port={port}", f"rollout_server.load_format={load_format}",
            f"rollout_server.gpu_memory_utilization={gpu_mem}",
            f"rollout_server.gpus=[{','.join(str(g) for g in server_gpus)}]",
            f"rollout_server.tensor_parallel_size={tp}", f"learner.gpus=[{learner_gpu}]"]


def raw_ranks(learner_gpu: int, server_gpus: list[int]) -> list[tuple[int, int]]:
    """(rank, physical GPU) of the raw broadcast: rank 0 on the learner's GPU, then one per server GPU."""
    return [(0, learner_gpu)] + [(k + 1, g) for k, g in enumerate(server_gpus)]


def raw_summary(res: dict[str, list[float]], nbytes: int) -> dict:
    return {k: {"median_s": statistics.median(v), "best_s": min(v), "gb_s": nbytes / statistics.median(v) / 1e9}
            for k, v in res.items()}


def mode_stats(records: list[dict], nbytes: int, raw: dict | None) -> dict[str, dict]:
    """Per load path: medians of the timed pushes (warm-ups apart), GB/s over the wire, share of raw."""
    out: dict[str, dict] = {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        mine = [r for r in records if r["mode"] == mode]
        timed = [r for r in mine if not r["warmup"]]
        if not timed:
            continue
        med = {k: statistics.median(r[k] for r in timed) for k in PHASES if all(r.get(k) is not None for r in timed)}
        s: dict = {"n": len(timed), "median": med, "warmup": next((r for r in mine if r["warmup"]), None),
                   "sync_gb_s": nbytes / med["wire_s"] / 1e9}
        if med.get("gpu_s"):
            s["data_gb_s"] = nbytes / med["gpu_s"] / 1e9
        if raw:
            s["vs_raw_single"] = s["sync_gb_s"] / raw["single_s"]["gb_s"]
            s["vs_raw_chunked"] = s["sync_gb_s"] / raw["chunked_s"]["gb_s"]
            if "data_gb_s" in s:
                s["data_vs_raw_chunked"] = s["data_gb_s"] / raw["chunked_s"]["gb_s"]
        out[mode] = s
    return out


def server_log_lines(text: str) -> list[str]:
    return [line.split("vllm: ", 1)[-1] for line in text.splitlines() if any(m in line for m in LOG_MARKERS)]


def log_counts(lines: list[str]) -> dict[str, int]:
    return {"fast": sum("fast update:" in x for x in lines), "native": sum("nccl update:" in x for x in lines),
            "fast_refused": sum("fast weight load refused" in x for x in lines)}


def count_fast_pushes(records: list[dict], digest: dict | None) -> int:
    """Pushes that asked for the fast path: the timed/warm-up ones and those of the digest check."""
    return (sum(r["mode"] == "fast" for r in records)
            + sum(s["mode"] == "fast" for s in (digest or {}).get("steps", [])))


def fast_effective(records: list[dict], digest: dict | None, counts: dict[str, int]) -> bool:
    """Every timed fast push (and every fast push of the digest check) ran the fast path, by the server's
    own reply, and the server never refused the fast path for good."""
    fast = ([r for r in records if r["mode"] == "fast" and not r["warmup"]]
            + [s for s in (digest or {}).get("steps", []) if s["mode"] == "fast"])
    return bool(fast) and all(r.get("load_path") == "fast" for r in fast) and not counts["fast_refused"]


def digest_check(push: Callable[[str], dict], perturb: Callable[[], None], digest: Callable[[], dict]) -> dict:
    """Pairs of pushes of the SAME weights through both paths must leave equal served digests.

    perturb (all weights) -> fast -> digest A -> native (same weights) -> digest B: A == B means the fast
    path loaded everything native loads (a tensor it skipped would still hold the previous weights in A);
    perturb -> native -> digest C -> fast (same weights) -> digest D: C == D means fast wrote nothing wrong
    on top of a native load. B != C: a weight change changes the digest (on every worker).
    """
    steps = []

    def step(mode: str) -> list[str]:
        r = push(mode)
        d = digest()
        if d.get("ver") != r["ver"]:
            raise RuntimeError(f"/sync/digest reports ver {d.get('ver')} after the {mode} push committed "
                               f"ver {r['ver']}")
        steps.append({"mode": mode, "ver": r["ver"], "digests": d["digests"], "load_path": r.get("load_path")})
        return list(d["digests"])

    perturb()
    a = step("fast")
    b = step("native")
    perturb()
    c = step("native")
    d = step("fast")
    res = {"steps": steps,
           "fast_then_native_equal": a == b,
           "native_then_fast_equal": c == d,
           "changes_with_weights": b != c,
           "changes_on_every_worker": len(b) == len(c) and all(x != y for x, y in zip(b, c))}
    res["digest_equal"] = res["fast_then_native_equal"] and res["native_then_fast_equal"]
    res["ok"] = res["digest_equal"] and res["changes_on_every_worker"]
    return res


def run_pushes(push: Callable[[str], dict], perturb: Callable[[], None], digest: Callable[[], dict] | None,
               modes: list[str], syncs: int) -> dict:
    """The learner's whole sequence: warm-ups and timed pushes (sync_order), then the digest check."""
    records: list[dict] = []
    for mode, warm in sync_order(modes, syncs):
        for _ in range(WARMUP_TRIES if warm else 1):
            perturb()  # a "step": the weights change between pushes
            r = push(mode)
            records.append({**r, "mode": mode, "warmup": warm, "first": not records})
            if r.get("load_path") in (None, mode):  # this path ran (or the server does not say)
                break
    out: dict = {"records": records, "digest": None}
    if digest is not None and set(LOAD_PATHS) <= set(modes):
        try:
            out["digest"] = digest_check(push, perturb, digest)
        except Exception as exc:  # noqa: BLE001 - reported (and fails the run) by the orchestrator
            out["digest"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return out


def digest_verdict(d: dict | None) -> str:
    if d is None:
        return "n/a"
    if "error" in d:
        return "ERROR"
    if not d["digest_equal"]:
        return "MISMATCH"
    return "equal" if d["changes_on_every_worker"] else "equal, NOT CHANGED by a weight change"


def table(results: list[dict]) -> str:
    rows = ["| model | TP | GB | chunks | load | prep s | fence s | wire s | commit s | stall s (total) "
            "| server update s | worker GPU s | sync GB/s | data GB/s | raw GB/s (1 buffer / chunked) | sync / raw (1 buffer / chunked) "
            "| data / raw chunked | warm-up push s | digest |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        raw = r.get("raw")
        raw_txt = f"{raw['single_s']['gb_s']:.1f} / {raw['chunked_s']['gb_s']:.1f}" if raw else "-"
        for mode, s in r["modes"].items():
            m = s["median"]
            share = (f"{100 * s['vs_raw_single']:.0f}% / {100 * s['vs_raw_chunked']:.0f}%" if "vs_raw_single" in s
                     else "-")
            label = mode if not (mode == "fast" and r.get("fast_effective") is False) else "fast (REFUSED: native ran)"
            warm = s["warmup"]["total_s"] if s.get("warmup") else float("nan")
            data = f"{s['data_gb_s']:.1f}" if "data_gb_s" in s else "-"
            data_share = f"{100 * s['data_vs_raw_chunked']:.0f}%" if "data_vs_raw_chunked" in s else "-"
            rows.append(f"| {r['preset']} | {r.get('tp', 1)} | {r['bytes'] / 1e9:.2f} | {r['chunks']} | {label} | "
                        f"{m.get('prep_s', float('nan')):.3f} | {m['fence_s']:.3f} | {m['wire_s']:.3f} | "
                        f"{m['commit_s']:.3f} | {m['total_s']:.3f} | "
                        f"{m.get('server_update_s', float('nan')):.3f} | {m.get('gpu_s', float('nan')):.4f} | "
                        f"{s['sync_gb_s']:.1f} | {data} | {raw_txt} | {share} | {data_share} | "
                        f"{warm:.2f} | {digest_verdict(r.get('digest'))} |")
    return "\n".join(rows)


def run_ok(result: dict, modes: list[str]) -> list[str]:
    """Problems that make the exit code non-zero (empty list: fine)."""
    problems = []
    d = result.get("digest")
    if set(LOAD_PATHS) <= set(modes):
        if d is None:
            problems.append("no digest check ran")
        elif not d.get("ok"):
            problems.append(f"digest check failed: {digest_verdict(d)} {d.get('error', '')}".rstrip())
    if result.get("fast_effective") is False:
        problems.append("the fast path was refused or never logged: the 'fast' rows measured native")
    return problems


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

    from learner.sync.nccl import NcclWeightSender

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

    from common.tensors import weights as W
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
