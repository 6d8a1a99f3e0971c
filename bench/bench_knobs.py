"""The seeds' tuning questions, measured: run the demo topology once per knob setting, side by side.

Each point is a full ``python -m launcher`` run of ``--config`` with its overrides, on its own ports
and run directory, pinned to ``--cores`` CPU cores (``taskset``) so several points run at once
without sharing cores; ``--parallel`` of them at a time. Rows (bench/knobs_lib.py) go to
``<out>/rows.jsonl``, a markdown table to ``<out>/table.md`` and one plot per swept key.

    python bench/bench_knobs.py --sweep b_ratio --out runs/sweep-b
    python bench/bench_knobs.py --sweep sync_window --set stage2_ab.schedule.b_ratio=0.1 --out runs/sweep-sw
    python bench/bench_knobs.py --point a:training.max_steps=20 --point b:training.max_steps=30   # any overrides

Sweeps: ``b_ratio`` = stage2_ab.schedule.b_ratio ∈ {0.05, 0.1, 0.2, 0.3, 0.4}; ``sync_window`` =
weight_sync.every_steps {1, 2, 4} × stage2_ab.channel_b.async.version_window {1, 2, 4}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from knobs_lib import markdown_table, plot, run_row  # noqa: E402

A = "stage2_ab.channel_b.async."
SWEEPS = {
    "b_ratio": [(f"b{r}", [f"stage2_ab.schedule.b_ratio={r}"], {"b_ratio": r}) for r in (0.05, 0.1, 0.2, 0.3, 0.4)],
    "sync_window": [(f"s{s}w{w}", [f"weight_sync.every_steps={s}", f"{A}version_window={w}"],
                     {"sync_every_steps": s, "version_window": w}) for s, w in itertools.product((1, 2, 4), (1, 2, 4))],
}


def point_argv(config: str, out: Path, i: int, overrides: list[str], port0: int) -> list[str]:
    """The launcher's command line for point ``i``: its own output dir, server port and transport ports."""
    port, base = port0 + 10 * i, port0 + 1000 + 40 * i
    return [sys.executable, "-m", "launcher", "--config", config, "training.overwrite=true",
            f"training.output_dir={out}", f"rollout_server.port={port}",
            f"rollout_matching.vllm.servers=[{{base_url: 'http://127.0.0.1:{port}'}}]", f"transport.base_port={base}",
            *overrides]


def run_points(points: list[tuple[str, list[str], dict]], args: argparse.Namespace) -> list[dict]:
    cores = os.cpu_count() or 1
    pending, running, rows = list(enumerate(points)), {}, []
    while pending or running:
        while pending and len(running) < args.parallel:
            i, (name, ovs, facts) = pending.pop(0)
            out = args.out / name
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            argv = point_argv(args.config, out, i, [*args.set, *ovs], args.port0)
            slot = len(running)
            if shutil.which("taskset") and args.cores * (slot + 1) <= cores:
                argv = ["taskset", "-c", f"{args.cores * slot}-{args.cores * (slot + 1) - 1}", *argv]
            log = (args.out / f"{name}.log").open("w")
            running[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), time.monotonic(), facts, log)
            print(f"started {name}: {' '.join(argv[-len(ovs) - len(args.set):])}", flush=True)
        time.sleep(1.0)
        for name, (proc, t0, facts, log) in list(running.items()):
            late = time.monotonic() - t0 > args.timeout_s
            if proc.poll() is None and not late:
                continue
            if late:
                proc.kill()
            proc.wait()
            log.close()
            row = {**facts, **run_row(args.out / name), "exit": proc.returncode, "timed_out": late}
            rows.append(row)
            with (args.out / "rows.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
            del running[name]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/bench_knobs.py")
    ap.add_argument("--config", default="configs/demo_cpu.yaml")
    ap.add_argument("--sweep", choices=list(SWEEPS), action="append", default=[])
    ap.add_argument("--point", action="append", default=[], help="NAME:key=value,key=value (any overrides)")
    ap.add_argument("--set", action="append", default=[], help="override applied to every point")
    ap.add_argument("--out", type=Path, default=Path("runs/sweep"))
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--cores", type=int, default=2, help="cores per point (taskset), default %(default)s")
    ap.add_argument("--port0", type=int, default=8400)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    args = ap.parse_args(argv)
    points = [p for s in args.sweep for p in SWEEPS[s]]
    for spec in args.point:
        name, _, ovs = spec.partition(":")
        points.append((name, [o for o in ovs.split(",") if o], {}))
    if not points:
        ap.error("nothing to run: give --sweep or --point")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_points(points, args)
    rows.sort(key=lambda r: [p[0] for p in points].index(r["run"]))
    (args.out / "table.md").write_text(markdown_table(rows) + "\n")
    for key in ("b_ratio", "sync_every_steps"):
        if any(key in r for r in rows):
            plot(rows, key, args.out / f"sweep_{key}.png")
    print(markdown_table(rows))
    return 0 if all(r.get("exit") == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
