"""Quality per learner-second: A-only vs async AB vs the synchronous ``step`` mode, from one warm start.

    python bench/bench_quality.py [--config configs/demo_cpu.yaml] [--budget-s 90] [--eval-every 25]
        [--arms a_only,async_ab,step] [--seeds 5] [--val-images 512] [--out runs/bench-quality] [--quick]
        [--gpus 0,1,2] [--deadline-s S] [--json OUT] [key=value ...]

Every arm is the real topology (``python -m launcher``: rollout server, actors where the mode has them,
the torchrun learner) started from the config's ``model.path`` (the Stage-1 warm start) with the same
data, seed, batch and learning rate, and stopped by the same learner-time budget
(``training.max_train_seconds``: the sum of ``time/step`` after the process's first step, so start-up (the
first step's start-up sync and CUDA initialisation) and evaluation threads are not charged, sync stalls and
waits for rollouts are). The learner evaluates ``data.val_jsonl`` at step 0,
every ``--eval-every`` steps and at the end (learner/evaluation.py). Arms:

- ``a_only``:   ``b_ratio 0`` — supervised steps only; no actors are started.
- ``async_ab``: ``b_ratio 0.5``, mode ``async`` — tandem's actor-learner runtime.
- ``step``:     ``b_ratio 0.5``, mode ``step`` with ``enable_pipeline`` — the synchronous baseline
                (rollouts inside the learner's B steps, one learner process).

Every arm runs ONE learner rank (``step`` cannot run more). Overrides (``key=value``) apply to every arm; one that
would change what an arm is (A-only's b_ratio, a mode, the seed, ...) is refused; a B arm takes any b_ratio > 0. Output: ``<out>/<arm>/`` (run
directories), ``<out>/quality.json``, ``<out>/quality.png`` (val F1@0.5 and mAP against learner seconds) and a table.

Statistics (issue 34; docs/benchmarks.md §21): ``--seeds N`` runs every
arm with ``training.seed`` 0..N-1 (the learner's data order, the rollout sampling seeds and the actors'
streams all derive from it), so seed s of one arm and seed s of another differ only by the arm. Per arm:
the mean over seeds of the final F1 and of the mean F1 after the start, with a 95 % Student-t interval;
per arm against the first arm: the mean of the per-seed differences and its t-interval (paired by
seed). Within one run, each evaluation's own interval is the bootstrap over images
(``eval/f1_ci_low``/``high``, common/evaluation/stats.py). ``--val-images N`` evaluates N images: a
validation set of that size is generated beside the training data from its ``manifest.json``
(the same generator, seed and shapes; the records after the training ones, so the config's own val
images are its first ones), and ``training.eval_max_images`` is set to N. The plot shows per arm the
mean curve over seeds (each interpolated onto common learner seconds) with its t-band.

Parallel runs (``--gpus 0,1,2``): one slot per GPU, one run at a time each, taken in the same seed-major order.
Slot k gets its own ports, every one the launcher opens: ``rollout_server.port`` + 2k (and the learner's server
URL) and the pack + credits pair at ``transport.base_port`` + 2k (torchrun ``--standalone`` and nccl weight sync
pick free ports). Where the config places processes on GPUs (``rollout_server.gpus``, ``learner.gpus``) both
become ``[g]`` (the launcher pins each child by CUDA_VISIBLE_DEVICES); a CPU config keeps its devices. A failed
run goes to ``failed`` in the JSON and the others go on (exit 1). ``--deadline-s``: wall seconds for all runs;
a run still going then is stopped (SIGTERM to its launcher, which tears its processes down), one that would
not finish in what is left (the longest run's wall) is not started. ``quality.json`` is rewritten after every
run; ``crowded`` in it: per arm the t-intervals over seeds of the last evaluation's recall, duplicate rate,
per-class mAP, ... and F1 per GT-count bucket (``eval/f1_gt_<bucket>``).

``--quick`` (what ``make test`` runs, so the script cannot rot): a 4-second budget, one seed and one
evaluation at each end — it checks the plumbing, not the quality.
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.config.load import load_config  # noqa: E402
from common.evaluation.stats import paired_t_difference, t_interval  # noqa: E402
from launcher.summary import read_split  # noqa: E402
from quality_plot import plot  # noqa: E402

ARMS: dict[str, list[str]] = {
    "a_only": ["stage2_ab.schedule.b_ratio=0"],
    "async_ab": ["stage2_ab.schedule.b_ratio=0.5", "stage2_ab.channel_b.mode=async"],
    "step": ["stage2_ab.schedule.b_ratio=0.5", "stage2_ab.channel_b.mode=step",
             "stage2_ab.channel_b.enable_pipeline=true", "weight_sync.mode=blocking"],
}


#: Keys the benchmark sets for every run: an override of one (applied last) would silently change the arms.
BENCH_KEYS = ("training.seed", "training.output_dir", "run_name", "learner.nproc_per_node", "training.max_steps",
              "training.max_train_seconds", "training.eval_every_steps", "training.save_every_steps")
B_RATIO = "stage2_ab.schedule.b_ratio"


def refused_overrides(overrides: list[str], arms: list[str]) -> list[str]:
    """Overrides that would silently change what an arm of ``arms`` is (applied after the arm's own keys), each
    with the fix. A B arm's b_ratio may change (a positive share keeps it a B arm: a b_ratio sweep)."""
    refused = []
    for key, _, value in (o.partition("=") for o in overrides):
        if key in BENCH_KEYS:
            refused.append(f"{key}: the benchmark sets it for every run. Fix: drop it")
            continue
        for arm in arms:
            own = dict(o.split("=", 1) for o in ARMS[arm]).get(key)
            sweep = key == B_RATIO and arm != "a_only" and _positive(value)
            if own is not None and value != own and not sweep:
                refused.append(f"{key}={value}: arm {arm} is defined by {key}={own}. Fix: drop it, or leave {arm} "
                               "out of --arms (a B arm takes any b_ratio > 0)")
    return refused


def _positive(value: str) -> bool:
    try:
        return float(value) > 0
    except ValueError:
        return False


def run_name(arm: str, seed: int, n_seeds: int) -> str:
    """The arm's run folder: ``async_ab`` for one seed (as before), ``async_ab-s3`` with several."""
    return arm if n_seeds == 1 else f"{arm}-s{seed}"


def run_arm(name: str, args: argparse.Namespace, overrides: list[str], seed: int = 0, *,
            slot: dict[str, Any] | None = None, timeout_s: float | None = None) -> dict[str, Any]:
    """Start one arm through the launcher (deadline: the budget plus start-up and evaluation room, or
    ``timeout_s`` where shorter); ``slot``: the overrides of its GPU slot (:func:`slot_overrides`)."""
    folder = run_name(name, seed, args.seeds)
    out = Path(args.out) / folder
    argv = [sys.executable, "-m", "launcher", "--config", args.config, *ARMS[name], f"training.seed={seed}",
            f"training.output_dir={out}", f"run_name=bench-quality-{folder}", "learner.nproc_per_node=1",
            f"training.max_train_seconds={args.budget_s}", "training.max_steps=100000",
            f"training.eval_every_steps={args.eval_every}", "training.save_every_steps=0",
            "training.overwrite=true", *overrides,  # a re-run moves the arm's previous run aside (never deletes)
            *(slot["overrides"] if slot else [])]
    launcher_out = Path(args.out) / f"{folder}.launcher.out"  # beside the run: the run dir may be moved aside
    launcher_out.parent.mkdir(parents=True, exist_ok=True)
    deadline = args.budget_s * 3 + 300 if timeout_s is None else min(timeout_s, args.budget_s * 3 + 300)
    t0 = time.monotonic()
    with open(launcher_out, "w") as log:
        rc = launch(argv, log, deadline)
    steps, evals = read_split(out)
    if rc != 0 or not steps:
        why = f"stopped at its {deadline:.0f} s deadline" if rc is None else f"exit {rc}"
        raise RuntimeError(f"arm {name} failed ({why}, {len(steps)} step records); "
                           f"see {launcher_out} and {out / 'logs'}")
    where = {k: slot[k] for k in ("slot", "gpu", "ports")} if slot else {}
    return {**arm_figures(name, steps, evals, wall_s=time.monotonic() - t0), "seed": seed, **where}


def launch(argv: list[str], log: Any, timeout_s: float, grace_s: float = 45.0) -> int | None:
    """Run the launcher to its end; at ``timeout_s`` SIGTERM it (its teardown stops the server, actors and
    torchrun, launcher/supervisor.py), SIGKILL after ``grace_s``. The exit code, None when it was stopped."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        return proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


#: Slot k's ports are the config's + PORT_STRIDE * k: the rank's pack + credits pair needs two.
PORT_STRIDE = 2


def slot_overrides(cfg: Any, k: int, gpu: str) -> dict[str, Any]:
    """Slot ``k`` (on GPU ``gpu``): its ports and, where the config places processes on GPUs, that GPU
    (module docstring). A dict of ``slot``, ``gpu``, ``ports`` and the launcher ``overrides``."""
    srv = cfg.rollout_server
    ports = {"rollout_server": srv.port + PORT_STRIDE * k, "transport": cfg.transport.base_port + PORT_STRIDE * k}
    url = f"http://{srv.host}:{ports['rollout_server']}"
    overrides = [f"rollout_server.port={ports['rollout_server']}", f"transport.base_port={ports['transport']}",
                 f"rollout_matching.vllm.servers=[{{base_url: '{url}'}}]"]
    if srv.gpus:
        overrides.append(f"rollout_server.gpus=[{gpu}]")
    if cfg.learner.gpus:
        overrides.append(f"learner.gpus=[{gpu}]")
    return {"slot": k, "gpu": gpu, "ports": ports, "overrides": overrides}


def run_slots(jobs: list[tuple[int, str]], args: argparse.Namespace, overrides: list[str], slots: list[dict[str, Any]],
              on_run: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run ``jobs`` ((seed, arm), seed-major) on ``slots`` concurrently, each slot one run at a time, taking the
    next job in order; ``on_run(results, failed)`` after each. A failed or stopped run goes to ``failed``."""
    todo: queue.Queue = queue.Queue()
    for job in jobs:
        todo.put(job)
    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    lock = threading.Lock()
    end = None if args.deadline_s is None else time.monotonic() + args.deadline_s

    def work(slot: dict[str, Any]) -> None:
        while True:
            try:
                seed, name = todo.get_nowait()
            except queue.Empty:
                return
            left = None if end is None else end - time.monotonic()
            with lock:
                need = max((r["wall_s"] for r in results), default=0.0)
                late = left is not None and left < need
                if late:
                    failed.append({"arm": name, "seed": seed, "error": f"not started: {left:.0f} s left < {need:.0f}"})
            if late:
                continue
            print(f"arm {name}, seed {seed} on slot {slot['slot']} (GPU {slot['gpu']}, ports {slot['ports']}): "
                  f"{args.budget_s:g} learner seconds ...\n", end="", flush=True)  # one write: slots share stdout
            try:
                run = run_arm(name, args, overrides, seed, slot=slot, timeout_s=left)
            except Exception as exc:  # one run's failure must not cost the table the others
                print(f"arm {name}, seed {seed}: {exc}\n", end="", flush=True)
                with lock:
                    failed.append({"arm": name, "seed": seed, "error": str(exc), "slot": slot["slot"]})
                    on_run(results, failed)
                continue
            with lock:
                results.append(run)
                on_run(results, failed)

    threads = [threading.Thread(target=work, args=(slot,), name=f"slot-{slot['slot']}") for slot in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, failed


def larger_val_set(cfg_path: str, overrides: list[str], n_images: int) -> Path:
    """A validation JSONL of ``n_images`` from the training data's generator (module docstring): built once
    beside the training data, reused by later calls. ValueError when the training data has no synthetic manifest."""
    from common.data.synthetic import MANIFEST, generate

    train = Path(load_config(cfg_path, [o for o in overrides if "=" in o]).data.train_jsonl)
    try:
        params = json.loads((train.parent / MANIFEST).read_text())["params"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--val-images needs synthetic training data (common/data/synthetic.py's {MANIFEST} beside "
                         f"{train}): {exc}. Otherwise pass data.val_jsonl=<a JSONL with >= {n_images} records>"
                         ) from exc
    out = train.parent.with_name(f"{train.parent.name}-val{n_images}")
    shape = {k: params[k] for k in ("max_objects", "size_range", "min_objects", "near_duplicate_p") if k in params}
    generate(out, seed=params["seed"], sides=params["sides"], split=(params["n_train"], n_images), **shape)
    return out / "val.jsonl"


#: What each seed contributes to an arm's statistics: the final evaluation's F1 and the mean of those after step 0.
STAT_KEYS = ("last_f1", "mean_f1_after_start")


def per_run_values(run: dict[str, Any]) -> dict[str, float | None]:
    after = [c["f1"] for c in run["curve"][1:] if c["f1"] is not None]
    return {"last_f1": (run["last"] or {}).get("f1"), "mean_f1_after_start": sum(after) / len(after) if after else None}


def statistics_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the t-interval over seeds of :data:`STAT_KEYS`; per arm after the first: the paired
    difference to the first arm over the seeds both ran (common/evaluation/stats.py)."""
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    values = {a: {r["seed"]: per_run_values(r) for r in runs if r["arm"] == a} for a in arms}
    out: dict[str, Any] = {"per_arm": {}, "vs_" + arms[0]: {}} if arms else {"per_arm": {}}
    for a in arms:
        out["per_arm"][a] = {k: t_interval([v[k] for v in values[a].values()]) for k in STAT_KEYS}
    for a in arms[1:]:
        out["vs_" + arms[0]][a] = {k: paired_t_difference({s: v[k] for s, v in values[arms[0]].items()},
                                                         {s: v[k] for s, v in values[a].items()}) for k in STAT_KEYS}
    return out


def stats_table(stats: dict[str, Any]) -> str:
    """``arm  n  last F1 mean [low, high]  mean F1 after start [..]`` and the paired differences."""
    def iv(d: dict[str, Any], sign: str = "") -> str:
        if d.get("mean") is None:
            return "n/a"
        if d.get("low") is None:
            return f"{d['mean']:{sign}.3f} (1 seed: no interval)"
        band = f" [{d['low']:{sign}.3f}, {d['high']:{sign}.3f}]"
        return f"{d['mean']:{sign}.3f}{band}"

    lines = ["per arm over seeds (mean, 95 % t-interval):"]
    for a, d in stats["per_arm"].items():
        lines.append(f"  {a:9} n={d['last_f1']['n']}  F1 last {iv(d['last_f1'])}  F1 mean after start "
                     f"{iv(d['mean_f1_after_start'])}")
    for key, arms in ((k, v) for k, v in stats.items() if k.startswith("vs_")):
        for a, d in arms.items():
            verdict = {True: "outside the noise", False: "within the noise", None: "no interval"}
            lines.append(f"  {a} − {key[3:]} (paired over seeds {d['last_f1']['seeds']}): "
                         f"F1 last {iv(d['last_f1'], '+')} "
                         f"({verdict[d['last_f1']['outside_noise']]}), mean after start "
                         f"{iv(d['mean_f1_after_start'], '+')} ({verdict[d['mean_f1_after_start']['outside_noise']]})")
    return "\n".join(lines)


def learner_seconds_at(steps: list[dict[str, Any]], step: float) -> float:
    """Learner seconds spent before optimizer step ``step``: the sum of time/step after the run's first step,
    as ``training.max_train_seconds`` counts them (the first step is start-up: :func:`arm_figures` reports it)."""
    first = min((r.get("step", 0) for r in steps), default=0)
    return sum(r.get("time/step", 0.0) for r in steps if first < r.get("step", 0) < step)


def arm_figures(name: str, steps: list[dict[str, Any]], evals: list[dict[str, Any]], *, wall_s: float) -> dict[str, Any]:
    """The curve (learner seconds → F1, mAP) and the headline numbers of one arm."""
    curve = [{"step": e["step"], "learner_s": learner_seconds_at(steps, e["step"]), "f1": e.get("eval/f1"),
              "map": e.get("eval/map"), "map_50": e.get("eval/map_50"), "ver": e.get("eval/ver")} for e in evals]
    scored = [c for c in curve if c["f1"] is not None]
    return {
        "arm": name, "steps": len(steps), "b_steps": sum(1 for r in steps if r.get("stage2_ab/async/step_kind_b")),
        "learner_s": learner_seconds_at(steps, float("inf")),
        "startup_step_s": min(steps, key=lambda r: r.get("step", 0)).get("time/step") if steps else None,
        "wall_s": wall_s,
        "wait_for_rollouts_s": sum(r.get("time/wait_for_packs", 0.0) for r in steps),
        "curve": curve, "first": scored[0] if scored else None, "last": scored[-1] if scored else None,
        "best": max(scored, key=lambda c: c["f1"]) if scored else None,
        "last_eval": {k: v for k, v in (evals[-1] if evals else {}).items()
                      if k.startswith("eval/") and isinstance(v, (int, float)) and not isinstance(v, bool)},
    }


#: The last evaluation's numbers that matter on crowded scenes (with every ``eval/f1_gt_<bucket>`` present).
CROWDED_KEYS = ("eval/recall", "eval/precision", "eval/duplicate_rate", "eval/map_per_class", "eval/map_50_per_class",
                "eval/parse_failure_rate", "eval/truncated_rate", "eval/objects_per_image", "eval/gt_per_image")


def crowded_statistics(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm, per :data:`CROWDED_KEYS` and bucket F1 of the last evaluation: its t-interval over seeds."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        lasts = [r.get("last_eval", {}) for r in runs if r["arm"] == arm]
        buckets = sorted({k for e in lasts for k in e if k.startswith("eval/f1_gt_")},
                         key=lambda k: int(k.removeprefix("eval/f1_gt_").split("_")[0]))
        out[arm] = {k: t_interval([e.get(k) for e in lasts]) for k in (*CROWDED_KEYS, *buckets)}
    return out


def crowded_table(crowded: dict[str, dict[str, Any]]) -> str:
    """``arm  recall  dup rate  per-class mAP  F1 by GT count``: means over seeds ± the t-interval's half-width."""
    def cell(d: dict[str, Any]) -> str:
        return f"{d['mean']:.3f}" + ("" if d["low"] is None else f" ±{(d['high'] - d['low']) / 2:.3f}")

    lines = ["last evaluation per arm (mean over seeds ± 95 % t half-width):"]
    for arm, keys in crowded.items():
        parts = [f"{k.removeprefix('eval/')} {cell(d)}" for k, d in keys.items() if d["mean"] is not None]
        lines.append(f"  {arm:9} " + ", ".join(parts))
    return "\n".join(lines)


def table(results: list[dict[str, Any]]) -> str:
    """One row per run; the F1 ratio is to the A-only run of the same seed."""
    bases = {r.get("seed", 0): r for r in results if r["arm"] == "a_only" and r["last"]}
    lines = [f"{'arm':9} {'seed':>4} {'learner s':>9} {'steps':>6} {'B':>4} {'F1 first':>8} {'F1 last':>8} "
             f"{'F1 best':>8} {'mAP last':>8} {'mAP50 last':>10} {'F1 vs A-only':>12}"]
    for r in results:
        first, last, best = r["first"] or {}, r["last"] or {}, r["best"] or {}
        base = bases.get(r.get("seed", 0))
        ratio = (last["f1"] / base["last"]["f1"]) if base and last and base["last"]["f1"] else None

        def f(v: Any, w: int = 8) -> str:
            return f"{v:{w}.3f}" if isinstance(v, (int, float)) else f"{'n/a':>{w}}"

        lines.append(f"{r['arm']:9} {r.get('seed', 0):4d} {r['learner_s']:9.1f} {r['steps']:6d} {r['b_steps']:4d} "
                     f"{f(first.get('f1'))} "
                     f"{f(last.get('f1'))} {f(best.get('f1'))} {f(last.get('map'))} {f(last.get('map_50'), 10)} "
                     f"{f(ratio, 12)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/bench_quality.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo_cpu.yaml")
    ap.add_argument("--budget-s", type=float, default=90.0, help="learner seconds per arm (default %(default)s)")
    ap.add_argument("--eval-every", type=int, default=25, help="optimizer steps between evaluations")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    ap.add_argument("--out", default="runs/bench-quality")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--seeds", type=int, default=1, help="runs per arm, training.seed 0..N-1 (default %(default)s)")
    ap.add_argument("--val-images", type=int, default=None,
                    help="evaluate N images, from a validation set of that size generated beside the training data")
    ap.add_argument("--quick", action="store_true", help="4 s per arm, evaluation at the ends only: a smoke run")
    ap.add_argument("--gpus", default=None, help="GPU slots, e.g. 0,1,2: runs go concurrently, one per slot, each "
                    "with its own ports (module docstring); default: one run at a time, as the config places it")
    ap.add_argument("--deadline-s", type=float, default=None, help="with --gpus: wall seconds for all runs")
    args, overrides = ap.parse_known_args(argv)
    if args.seeds < 1 or (args.val_images is not None and args.val_images < 1):
        ap.error("--seeds and --val-images must be >= 1")
    if args.gpus is not None and not all(g.strip().isdigit() for g in args.gpus.split(",")):
        ap.error(f"--gpus must look like 0,1,2, got {args.gpus!r}")
    arms = [a for a in args.arms.split(",") if a]
    if bad := [a for a in arms if a not in ARMS]:
        ap.error(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    if refused := refused_overrides(overrides, arms):
        ap.error("\n  - ".join(["overrides that would change what an arm is:", *refused]))
    if args.quick:
        args.budget_s, args.eval_every = 4.0, 0
    if args.val_images is not None:
        try:
            val = larger_val_set(args.config, overrides, args.val_images)
        except ValueError as exc:
            ap.error(str(exc))
        overrides = [*overrides, f"data.val_jsonl={val}", f"training.eval_max_images={args.val_images}"]
    out, order = Path(args.out), {a: i for i, a in enumerate(arms)}
    out.mkdir(parents=True, exist_ok=True)

    def write(results: list[dict[str, Any]], failed: list[dict[str, Any]]) -> dict[str, Any]:
        """quality.json of the runs so far (after every run: a stopped benchmark still leaves whole seeds)."""
        results.sort(key=lambda r: (r["seed"], order[r["arm"]]))
        payload = {"config": args.config, "budget_s": args.budget_s, "seeds": args.seeds,
                   "val_images": args.val_images, "gpus": args.gpus, "overrides": overrides, "arms": results,
                   "failed": failed, "statistics": statistics_of(results), "crowded": crowded_statistics(results)}
        text = json.dumps(payload, indent=1)
        for path in (out / "quality.json", *([Path(args.json)] if args.json else [])):
            path.with_suffix(".json.tmp").write_text(text)
            path.with_suffix(".json.tmp").replace(path)
        return payload

    jobs = [(seed, name) for seed in range(args.seeds) for name in arms]  # seed-major: whole seeds first
    if args.gpus:
        cfg = load_config(args.config, [o for o in overrides if "=" in o])
        slots = [slot_overrides(cfg, k, g) for k, g in enumerate(args.gpus.split(","))]
        results, failed = run_slots(jobs, args, overrides, slots, write)
    else:
        results, failed = [], []
        for seed, name in jobs:
            print(f"arm {name}, seed {seed}: {args.budget_s:g} learner seconds ...", flush=True)
            results.append(run_arm(name, args, overrides, seed))
            write(results, failed)
    payload = write(results, failed)
    if results:
        plot(results, out / "quality.png")
        print(table(results))
        print(stats_table(payload["statistics"]))
        print(crowded_table(payload["crowded"]))
    for f in failed:
        print(f"FAILED: arm {f['arm']}, seed {f['seed']}: {f['error']}")
    print(f"curves: {out / 'quality.png'}; figures: {out / 'quality.json'}")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
