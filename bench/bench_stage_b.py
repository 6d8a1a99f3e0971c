"""Stage-B throughput vs world size: one real ``stage_b.launch`` run per world size, rank-0-only artifacts checked.

    python3 bench/bench_stage_b.py --world-sizes 1,2,4 --config configs/stage_b/demo_cpu.yaml \\
        model.path=/tmp/tandem-models/0.5b model.dtype=bfloat16 tickets.demo.num_groups=64 --out /tmp/x.json
    python3 bench/bench_stage_b.py --gpus-list 0 0,1 0,1,2,3 --config configs/stage_b/demo_cpu.yaml [key=value ...]
    python3 bench/bench_stage_b.py --quick --out /tmp/q.json     # world sizes 1 and 2 on CPU, tiny model, ~25 s

Each world size W runs ``python -m stage_b.launch --gpus <ids> --config C <overrides> output.root=<work>/ws<W>/out``
(``--world-sizes`` maps W to GPU ids 0..W-1; one GPU: plain python, several: torchrun) from the repo root, one
after the other, each in its own process group under a deadline (``--deadline-s``, default 150 s: past it the
group is terminated and the row says ``timeout``). The bench sets ``output.root`` last, so it wins over an
override; relative paths in overrides are relative to the repo root (the launcher's working directory). On a
machine without CUDA the ranks run on CPU (gloo). ``OMP_NUM_THREADS`` defaults to 1 for every run, as torchrun
sets it for W > 1, so W = 1 is not given more threads per rank than the others. ``--quick`` adds
``model.path=<artifacts/tiny-model> model.device_map=cpu`` before the overrides (CPU even on a GPU machine).

Per world size, from rank 0's ``run_summary.json`` (``timing``: ``stage_b.runner.RunTiming``):

  wall_s          launcher start -> exit: torchrun, the model load on every rank, the loop, the close barrier
  loop_s          first global batch -> last epoch end: the throughput window (start-up excluded)
  rollout_s       sum over global batches of the slowest rank's rollout
  reflection_s    rank 0's reflection cycles (serial: it does not shrink with W)
  tickets_per_s   tickets / loop_s;  speedup = tickets_per_s / that of W = 1 (null without a W = 1 run)
  rank0_only      every file under the run's output.root is one that rank 0 lists in run_summary.json ``files``
                  (so no other rank, and nothing else, wrote there), the summary says world_size W and
                  status ok, and trajectories.jsonl carries candidates from every rank 0..W-1 (their work
                  reached the disk through rank 0 only)

Prints a markdown table; ``--out`` gets the JSON. Exit 0 when every run finished with rank0_only true, else 1.
Launcher logs: ``<work>/ws<W>/launch.log`` (outside the output root).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stage_b.launch import parse_gpus  # noqa: E402 - after the path fix; standard library only
DEFAULT_CONFIG = "configs/stage_b/demo_cpu.yaml"
DEFAULT_DEADLINE_S = 150.0
TERM_GRACE_S = 10.0  # after SIGTERM to a run past its deadline, before SIGKILL


def gpu_lists(world_sizes: str | None, gpus_list: list[str] | None) -> list[str]:
    """``--world-sizes 1,2,4`` -> ["0", "0,1", "0,1,2,3"]; ``--gpus-list`` is taken as given."""
    if gpus_list:
        for gpus in gpus_list:
            parse_gpus(gpus)  # the launcher's own check: distinct digits, e.g. 0,1
        sizes = [len(g.split(",")) for g in gpus_list]
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"--gpus-list {' '.join(gpus_list)}: one run per world size (each writes ws<W>/)")
        return gpus_list
    parts = [x.strip() for x in (world_sizes or "").split(",") if x.strip()]
    sizes = [int(x) for x in parts if x.isdigit()]
    if not sizes or len(sizes) != len(parts) or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ValueError(f"--world-sizes {world_sizes!r}: expected distinct positive integers, e.g. 1,2,4")
    return [",".join(str(g) for g in range(n)) for n in sizes]


def run_one(gpus: str, config: str, overrides: list[str], work: Path, deadline_s: float) -> dict[str, Any]:
    """One launcher run into ``work/ws<W>/``; the row of the table (timing, check) as a dict."""
    world = len(gpus.split(","))
    ws_dir = work / f"ws{world}"
    shutil.rmtree(ws_dir, ignore_errors=True)
    out_root = ws_dir / "out"
    out_root.mkdir(parents=True)
    log_path = ws_dir / "launch.log"
    cmd = [sys.executable, "-m", "stage_b.launch", "--gpus", gpus, "--config", config, *overrides,
           f"output.root={out_root}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    row: dict[str, Any] = {"world_size": world, "gpus": gpus, "log": str(log_path)}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        # own session: on a timeout the launcher, torchrun and every rank go down together, by this group's id
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=deadline_s)
            row["status"] = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            rc, row["status"] = proc.returncode, "timeout"
    row["wall_s"] = round(time.monotonic() - t0, 2)
    row["exit_code"] = rc
    row.update(read_run(out_root, world))
    if row["status"] != "ok":
        tail = log_path.read_text(errors="replace")[-1500:]
        print(f"world size {world} ({row['status']}, exit {rc}, deadline {deadline_s:.0f}s); "
              f"log {log_path} ends:\n{tail}", file=sys.stderr)
    return row


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def read_run(out_root: Path, world: int) -> dict[str, Any]:
    """Rank 0's timing and the rank-0-only check of what lies under ``out_root``."""
    problems: list[str] = []
    summaries = sorted(out_root.glob("*/*/run_summary.json"))  # {run_name}/{mission_slug}/
    if len(summaries) != 1:
        return {"rank0_only": False, "rank0_problems": [f"{len(summaries)} run_summary.json under {out_root}"]}
    run_dir = summaries[0].parent
    summary = json.loads(summaries[0].read_text())
    if summary.get("status") != "ok":
        problems.append(f"status {summary.get('status')}: {summary.get('error')}")
    if summary.get("world_size") != world:
        problems.append(f"world_size {summary.get('world_size')} != {world}")
    listed = {run_dir / f for f in summary.get("files", [])}
    stray = sorted(str(p.relative_to(out_root)) for p in out_root.rglob("*") if p.is_file() and p not in listed)
    if stray:
        problems.append(f"files rank 0 did not write: {stray[:10]}")
    ranks: set[int] = set()
    traj = run_dir / "trajectories.jsonl"
    if traj.is_file():
        with open(traj, encoding="utf-8") as f:
            ranks = {json.loads(line)["rank"] for line in f if line.strip()}
    if ranks != set(range(world)):
        problems.append(f"trajectories come from ranks {sorted(ranks)}, expected 0..{world - 1}")
    return {"run_dir": str(run_dir), "files": len(summary.get("files", [])), **(summary.get("timing") or {}),
            "rank0_only": not problems, "rank0_problems": problems}


def add_speedup(rows: list[dict[str, Any]]) -> None:
    base = next((r.get("tickets_per_s") for r in rows if r["world_size"] == 1), None)
    for r in rows:
        tps = r.get("tickets_per_s")
        r["speedup"] = round(tps / base, 2) if tps and base else None


def table(rows: list[dict[str, Any]]) -> str:
    cols = [("world size", "world_size"), ("GPUs", "gpus"), ("status", "status"), ("wall s", "wall_s"),
            ("setup s", "setup_s"), ("loop s", "loop_s"), ("rollout s", "rollout_s"), ("reflection s", "reflection_s"),
            ("batches", "global_batches"), ("tickets", "tickets"), ("tickets/s", "tickets_per_s"),
            ("speed-up", "speedup"), ("rank-0 only", "rank0_only")]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(k) is None else str(r[k]) for _, k in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/bench_stage_b.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = ap.add_mutually_exclusive_group()
    sizes.add_argument("--world-sizes", help="comma-separated world sizes, each on GPUs 0..W-1 (default 1,2)")
    sizes.add_argument("--gpus-list", nargs="+", metavar="IDS", help="one launcher --gpus value per run, e.g. 0 0,1 0,1,2,3")
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"Stage-B YAML (default {DEFAULT_CONFIG})")
    ap.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S, help="per run, launch -> exit (default 150)")
    ap.add_argument("--work-dir", default="runs/bench_stage_b", help="ws<W>/out (output.root) and ws<W>/launch.log; "
                    "each ws<W> is cleared first")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--quick", action="store_true", help="CPU (model.device_map=cpu) with the tiny model; world sizes 1,2 unless given")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="Stage-B config overrides, e.g. model.dtype=bfloat16")
    args = ap.parse_intermixed_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        ap.error(f"overrides must be key=value, got {bad}")
    overrides = list(args.overrides)
    if args.quick:
        from tools.make_tiny_model import ensure_tiny_model

        overrides = [f"model.path={ensure_tiny_model(REPO / 'artifacts' / 'tiny-model')}", "model.device_map=cpu",
                     *overrides]
    if args.deadline_s <= 0:
        ap.error("--deadline-s must be positive")
    try:
        runs = gpu_lists(args.world_sizes or "1,2", args.gpus_list)
    except ValueError as exc:
        ap.error(str(exc))
    config = str(Path(args.config).resolve())
    work = Path(args.work_dir).resolve()
    rows = []
    for gpus in runs:
        print(f"world size {len(gpus.split(','))} (--gpus {gpus}) ...", flush=True)
        rows.append(run_one(gpus, config, overrides, work, args.deadline_s))
    add_speedup(rows)
    result = {"bench": "stage_b", "config": config, "overrides": overrides, "deadline_s": args.deadline_s,
              "quick": args.quick, "rows": rows}
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all(r["status"] == "ok" and r["rank0_only"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
