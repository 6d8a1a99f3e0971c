"""The evidence of finished training runs: steps, vers, sync counts and the sync stall, read from their files.

    python3 bench/run_evidence.py [--json OUT] RUN_DIR [RUN_DIR ...]

Per run directory (``python -m launcher`` writes them): ``metrics.jsonl`` gives the optimizer steps (records
with ``stage2_ab/async/step_kind_b``), B steps, the distinct vers and whether they only grew, the last step's
``sync/*`` counters and the medians / p90 / max of ``time/sync_*``; ``summary.json`` the wall time, exit
codes, step time, peak memory per rank and stall median; ``logs/`` the last syncs as the learner and the
server logged them and any error lines. A run is *overlap* when its steps carry ``sync/started`` (a push
starts at the step boundary and only the snapshot stalls), else *blocking* (the stall of a sync step is the
whole push). Every overlap run is set against every blocking run given: the stall per sync, the first sync
(start-up, compile) left out. This script knows nothing about how the runs were started (bench/scenarios/).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

K = "stage2_ab/async/"


def stats(values) -> dict[str, float] | None:
    vals = sorted(v for v in values if isinstance(v, (int, float)))
    if not vals:
        return None
    return {"n": len(vals), "median": round(statistics.median(vals), 4),
            "p90": round(vals[min(len(vals) - 1, round(0.9 * (len(vals) - 1)))], 4), "max": round(vals[-1], 4)}


def fmt(s: dict[str, float] | None) -> str:
    return "n/a" if s is None else f"median {s['median']:.4f}s p90 {s['p90']:.4f}s max {s['max']:.4f}s (n {s['n']})"


def read_records(path: Path) -> list[dict[str, Any]]:
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:
            pass  # a torn last line of a killed run
    return recs


def evidence(run: Path) -> dict[str, Any] | None:
    """The figures of one run directory (None without a ``metrics.jsonl``)."""
    f = run / "metrics.jsonl"
    if not f.is_file():
        return None
    recs = read_records(f)
    steps = [r for r in recs if K + "step_kind_b" in r]
    overlap = any("sync/started" in r for r in steps)
    sync_steps = [r for r in steps if (r.get("sync/started") == 1 if overlap else "time/sync_total" in r)]
    vers = [r.get(K + "ver_current") for r in steps]
    last = steps[-1] if steps else {}
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    fb = [(r.get("time/forward_backward"), r.get("sync/in_flight")) for r in steps]
    return {
        "mode": "overlap" if overlap else "blocking",
        "records": len(recs), "optimizer_steps": len(steps),
        "b_steps": sum(1 for r in steps if r.get(K + "step_kind_b")),
        "vers": sorted({v for v in vers if v is not None}),
        "ver_monotonic": all(a <= b for a, b in zip(vers, vers[1:]) if a is not None and b is not None),
        "sync_counts": {k: last.get(k) for k in ("sync/attempts", "sync/successes", "sync/failures", "sync/deferred")},
        "sync_stall_all_steps": stats(r.get("time/sync_stall") for r in steps),
        "sync_stall_sync_steps": stats(r.get("time/sync_stall") for r in sync_steps),
        "sync_stall_sync_steps_excl_first": stats(r.get("time/sync_stall") for r in sync_steps[1:]),
        "sync_total": stats(r.get("time/sync_total") for r in steps),
        "sync_fence": stats(r.get("time/sync_fence") for r in steps),
        "sync_wire": stats(r.get("time/sync_wire") for r in steps),
        "sync_snapshot": stats(r.get("time/sync_snapshot") for r in steps),
        "forward_backward_push_in_flight": stats(t for t, f in fb if f == 1),
        "forward_backward_no_push": stats(t for t, f in fb if not f),
        "step_time": stats(r.get("time/step") for r in steps),
        "wall_s": summary.get("wall_s"), "exit_codes": summary.get("exit_codes"),
        "step_time_median_s": summary.get("step_time_median_s"),
        "peak_memory_gb_by_rank": summary.get("peak_memory_gb_by_rank"),
    }


def report_lines(name: str, e: dict[str, Any]) -> list[str]:
    lines = [f"[{name}] {e['mode']}: records {e['records']}, optimizer steps {e['optimizer_steps']}, "
             f"B steps {e['b_steps']}, vers {e['vers'][:3]}..{e['vers'][-2:]} ({len(e['vers'])} distinct, "
             f"monotonic {e['ver_monotonic']}), {e['sync_counts']}, wall {e['wall_s']}, exit {e['exit_codes']}",
             f"[{name}]   time/sync_stall on sync steps excl. the first: {fmt(e['sync_stall_sync_steps_excl_first'])}",
             f"[{name}]   time/sync_stall on every step: {fmt(e['sync_stall_all_steps'])}",
             f"[{name}]   time/sync_total {fmt(e['sync_total'])}; fence {fmt(e['sync_fence'])}; "
             f"wire {fmt(e['sync_wire'])}"]
    if e["mode"] == "overlap":
        lines.append(f"[{name}]   time/sync_snapshot {fmt(e['sync_snapshot'])}; forward_backward with a push in flight "
                     f"{fmt(e['forward_backward_push_in_flight'])} vs without {fmt(e['forward_backward_no_push'])}")
    if e["peak_memory_gb_by_rank"] is not None:
        lines.append(f"[{name}]   step median {e['step_time_median_s']} s, peak memory by rank "
                     f"{e['peak_memory_gb_by_rank']}")
    return lines


def stall_comparisons(report: dict[str, dict[str, Any]]) -> list[str]:
    """Every overlap run against every blocking run: the median stall per sync, the first sync left out."""
    out = []
    for on, o in report.items():
        for bn, b in report.items():
            if o["mode"] == "overlap" and b["mode"] == "blocking":
                bs, os_ = b["sync_stall_sync_steps_excl_first"], o["sync_stall_sync_steps_excl_first"]
                out.append(f"sync stall per sync (median, excl. the first): blocking {bs and bs['median']}s ({bn}) vs "
                           f"overlap {os_ and os_['median']}s ({on})")
    return out


LOG_PATTERNS = (("learner.log", re.compile(r"weights synced"), 3),
                ("rollout_server.log", re.compile(r"fast update:|nccl update:|fast weight load refused"), 3))
ERROR = re.compile(r"error|traceback|deadlock|watchdog", re.IGNORECASE)


def log_lines(run: Path) -> list[str]:
    """The last syncs as the learner and the server logged them, the load-path counts, the last error lines."""
    logs = run / "logs"
    out = [f"--- {run}"]
    for name, pattern, keep in LOG_PATTERNS:
        f = logs / name
        if f.is_file():
            text = f.read_text(errors="replace").splitlines()
            out += [line for line in text if pattern.search(line)][-keep:]
            if name == "rollout_server.log":
                out.append(f"fast updates: {sum('fast update:' in x for x in text)}, "
                           f"native updates: {sum('nccl update:' in x for x in text)}")
            if name == "learner.log":
                out.append(f"find_unused warnings: {sum('find_unused' in x for x in text)}")
    errors = [x for f in sorted(logs.glob("*.log"))
              for x in f.read_text(errors="replace").splitlines() if ERROR.search(x)]
    return out + errors[-5:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the figures of every run here")
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR")
    args = ap.parse_args(argv)
    report = {}
    for d in args.runs:
        run = Path(d)
        e = evidence(run)
        if e is None:
            print(f"[{run.name}] no {run / 'metrics.jsonl'}")
            continue
        report[run.name] = e
        print("\n".join(report_lines(run.name, e)))
    for line in stall_comparisons(report):
        print(line)
    for d in args.runs:
        print("\n".join(log_lines(Path(d))))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report else 1


if __name__ == "__main__":
    raise SystemExit(main())
