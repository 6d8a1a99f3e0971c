"""The pure part of bench/bench_weight_sync.py: the push plan, the digest check, the statistics, the table.

Nothing here starts a process or touches a GPU, so tests/test_bench_scripts.py runs all of it on CPU
against fakes; bench_weight_sync.py supplies the real pushes, digests and server log.

    sync_order ─► run_pushes (per push: perturb, push; warm-ups repeated up to WARMUP_TRIES until the
                  path really ran) ─► digest_check (both paths on the same weights must give equal digests)
    records ─► mode_stats (medians per load path, GB/s, share of raw NCCL) ─► table / run_ok (exit code)

What this module does not know: HTTP, NCCL, vLLM, or how the server's log is read.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

LOAD_PATHS = ("fast", "native")
PHASES = ("prep_s", "fence_s", "wire_s", "commit_s", "total_s", "server_update_s", "rpc_s", "worker_s", "gpu_s")
#: Warm-up pushes per path at most, until the server reports that path ran (bench_weight_sync.py's docstring).
WARMUP_TRIES = 3


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
