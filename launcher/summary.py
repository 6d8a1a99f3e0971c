"""Turn a run directory into the few numbers a user reads first (``make demo`` prints them).

Reads ``{run}/metrics.jsonl`` (rank 0: one step record per optimizer step, with evaluation records
``{"record": "eval", ...}`` interleaved), the final checkpoint's ``trainer_state.json`` where the run
wrote one, ``run_config.yaml`` (to say why there is no evaluation, and ``training.keep_best``), the
checkpoint directories (the best one still on disk) and the launcher's exit codes.
Knows nothing about how the numbers were produced.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from common.runs import cli
from common.detection.matching import precision_recall_f1
from launcher.bounds import b_bound, format_bound
from launcher.summary_eval import eval_lines, summarize_evals

K = "stage2_ab/async/"


def record_kind(record: dict[str, Any]) -> str:
    """``"step"`` (no ``record`` key: one optimizer step) or what the record says (``"eval"``)."""
    return str(record.get("record", "step"))


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of ``metrics.jsonl`` in file order, step and evaluation records alike."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a killed run
            if isinstance(record, dict):
                out.append(record)
    return out


def read_split(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, evaluation records) from ONE read of ``metrics.jsonl`` (for callers that need both)."""
    records = read_records(run_dir)
    return [r for r in records if record_kind(r) == "step"], [r for r in records if record_kind(r) == "eval"]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The step records (one per optimizer step); evaluation records are left out (:func:`read_eval_records`)."""
    return [r for r in read_records(run_dir) if record_kind(r) == "step"]


def read_actor_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every actor's interval records (``actor_rank*_*.jsonl``; ledgers excluded); unreadable lines skipped."""
    out = []
    for path in sorted(Path(run_dir).glob("actor_rank*_*.jsonl")):
        if path.name.endswith(".ledger.jsonl"):
            continue
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def read_eval_records(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluation records, in file order (``step`` = optimizer steps done when the weights were taken)."""
    return [r for r in read_records(run_dir) if record_kind(r) == "eval"]


def read_final_state(run_dir: Path, records: list[dict[str, Any]],
                     ends: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The trainer state of the checkpoint written after the last recorded step, if there is one, else the
    run's ``"record": "end"`` line of that step (``training.save_final: false``).

    Why: that checkpoint first settles the push in flight (overlap mode) and the final push for the
    evaluation, so the ver it saves (the server's) can be past the last metrics record's; "final ver"
    must say what the server holds. A checkpoint of an earlier step (a run that died later) is not the
    end of the run: ignored. ``ends``: the run's ``end`` records when the caller has read them (else read here).
    """
    if not records or "step" not in records[-1]:
        return None
    done = int(records[-1]["step"]) + 1
    path = Path(run_dir) / "checkpoints" / str(done) / "trainer_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        if ends is None:
            ends = [r for r in read_records(run_dir) if record_kind(r) == "end"]
        mine = [r for r in ends if r.get("step") == done]
        state = mine[-1] if mine else None
    return state if isinstance(state, dict) and isinstance(state.get("ver"), int) else None


def _loss_ends(records: list[dict], b_recs: list[dict]) -> dict:
    """First and last ``loss/total`` of the A steps and of the B steps (None where a channel has no step)."""
    a_recs = [r for r in records if not r.get(K + "step_kind_b")]
    out = {}
    for ch, recs in (("a", a_recs), ("b", b_recs)):
        losses = [r["loss/total"] for r in recs if r.get("loss/total") is not None]
        out[f"loss_first_{ch}"], out[f"loss_last_{ch}"] = (losses[0], losses[-1]) if losses else (None, None)
    return out


def _loss_line(s: dict, f: Any) -> str:
    parts = [f"{ch.upper()} {f(s.get(f'loss_first_{ch}'))} → {f(s.get(f'loss_last_{ch}'))}"
             for ch in ("a", "b") if s.get(f"loss_first_{ch}") is not None]
    return "loss first → last      " + ("; ".join(parts) if parts else f"{f(s['loss_first'])} → {f(s['loss_last'])}")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _busy(records: list[dict[str, Any]]) -> float:
    """Σ busy time / Σ step time over the run, a step's busy time being ``learner/busy_fraction`` × ``time/step``:
    forward/backward (mean over ranks) as the record counts it, so a GPU learner's device time counts here as
    in the record (``learner.metrics.busy_seconds``). The per-step mean of ``learner/busy_fraction`` where a
    record lacks ``time/step``."""
    if all("learner/busy_fraction" in r and "time/step" in r for r in records):
        total = sum(r["time/step"] for r in records)
        return sum(r["learner/busy_fraction"] * r["time/step"] for r in records) / total if total > 0 else float("nan")
    return _mean([r.get("learner/busy_fraction", 0.0) for r in records])


def summarize(records: list[dict[str, Any]], final: dict[str, Any] | None = None,
              evals: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The run summary as a dict (also written to ``summary.json``); ``final`` = ``read_final_state``,
    ``evals`` = ``read_eval_records`` (the ``eval`` section; None when there were none)."""
    if not records:
        return {"steps": 0}
    b_recs = [r for r in records if r.get(K + "step_kind_b")]
    last = records[-1]
    trained_b = sum(len(v) for r in b_recs for v in r.get(K + "trained_pack_vers", []))
    return {
        "steps": len(records),
        "steps_a": len(records) - len(b_recs),
        "steps_b": len(b_recs),
        "policy_wanted_b": int(sum(bool(r.get(K + "policy_wants_b")) for r in records)),
        "b_skipped_due_to_queue": int(sum(bool(r.get(K + "b_step_skipped_due_to_queue")) for r in records)),
        "b_ratio_realized": len(b_recs) / len(records),
        "drop_stale_total": int(last.get(K + "drop_stale_total", 0)),
        "drop_oldest_total": int(last.get(K + "drop_oldest_total", 0)),
        "rejected_total": int(last.get(K + "rejected_total", 0)),
        "nonfinite_skipped": int(last.get("learner/nonfinite_skipped_total", 0)),
        "ver_final": int(final["ver"]) if final else int(last.get(K + "ver_current", 0)),
        "syncs": _syncs(records, final),
        # what the pushes moved and what they left on the servers (frozen weights; an adapter sync's merged layers)
        "sync_bytes": sum(float(r.get("sync/bytes", 0.0)) for r in records),
        "sync_skipped_bytes": sum(float(r.get("sync/skipped_bytes", 0.0)) for r in records),
        "packs_trained_b": trained_b,
        "mean_fill_b": _mean([r.get("packing/fill", 0.0) for r in b_recs]),
        "mean_fill_a": _mean([r.get("packing/fill", 0.0) for r in records if not r.get(K + "step_kind_b")]),
        # time-weighted: the share of the learner's step time spent in forward/backward (a per-step mean would
        # count a sync step's stall once, however long it was)
        "busy_fraction": _busy(records),
        "wait_for_packs_s": sum(r.get("time/wait_for_packs", 0.0) for r in records),
        "wait_for_a_window_s": sum(r.get("time/wait_for_a_window", 0.0) for r in records),
        "optimizer_step_s": sum(r.get("time/optimizer_step", 0.0) for r in records),
        "prepare_inputs_s": sum(r.get("time/prepare_inputs", 0.0) for r in records),
        "other_s": sum(r.get("time/other", 0.0) for r in records),
        **rollout_totals(b_recs),
        "loss_first": records[0].get("loss/total"),
        "loss_last": last.get("loss/total"),
        # per channel: A and B steps weigh different terms (A: CE + geometry (+ coord CE), B: its rollout targets),
        # so a first-to-last across channels says nothing about learning
        **_loss_ends(records, b_recs),
        **_sync_stall(records),
        **learner_resources(records),
        "eval": summarize_evals(evals or []),
    }


#: The ``mem/peak_<name>_gb_by_rank`` record keys, in print order (``allocated``, ``reserved``: GPU learners only).
MEMORY_NAMES = ("allocated", "reserved", "rss")


def learner_resources(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The learner's engine (``learner.parallel``; runs before the key existed were DDP), its median step time
    (``time/step``, every step) and each rank's peak memory in GiB: per rank, the max over the run's records of
    ``mem/peak_<name>_gb_by_rank`` (None for a name no record carries; a run of older records has none)."""
    times = [float(r["time/step"]) for r in records if isinstance(r.get("time/step"), (int, float))]
    peaks: dict[str, list[float] | None] = {}
    for name in MEMORY_NAMES:
        key = f"mem/peak_{name}_gb_by_rank"
        rows = [r[key] for r in records if isinstance(r.get(key), list)]
        width = max((len(row) for row in rows), default=0)
        peaks[name] = [max(row[i] for row in rows if i < len(row)) for i in range(width)] if rows else None
    def median_of(key: str) -> float | None:  # the first record (start-up sync, CUDA init) left out where there are more
        xs = [float(r[key]) for r in records[1:] or records if isinstance(r.get(key), (int, float))]
        return statistics.median(xs) if xs else None

    return {"parallel": str(records[-1].get("learner/parallel", "ddp")),
            "step_time_median_s": statistics.median(times) if times else None, "peak_memory_gb_by_rank": peaks,
            "tokens_per_s_median": median_of("throughput/tokens_per_s"), "mfu_median": median_of("throughput/mfu"),
            "peak_tflops": records[-1].get("throughput/peak_tflops"),
            "peak_source": records[-1].get("throughput/peak_source")}


def rollout_totals(b_records: list[dict[str, Any]]) -> dict[str, Any]:
    """Rollout quality over the run: the B records' counts summed, then P/R/F1 once.

    Averaging per-step F1 would weight a step with one box like a step with fifty. P/R/F1 are None
    when the trained B packs held no GT and no prediction at all (or no B step ran).
    """
    n = {k: int(sum(r.get(f"rollout/{k}", 0) for r in b_records)) for k in ("n_matched", "n_pred", "n_gt")}
    p = rc = f1 = None
    if n["n_pred"] + n["n_gt"] > 0:
        p, rc, f1 = precision_recall_f1(n["n_matched"], n["n_pred"], n["n_gt"])
    # Every trained B segment is one rollout; invalid_rollout counts those that parsed to no complete object.
    rollouts = int(sum(r.get("packing/segments", 0) for r in b_records))
    invalid = int(sum(r.get("rollout/invalid_rollout", 0) for r in b_records))
    return {"rollout_precision": p, "rollout_recall": rc, "rollout_f1": f1,
            **{f"rollout_{k}": v for k, v in n.items()}, "rollouts_trained": rollouts,
            "rollouts_valid_share": (rollouts - invalid) / rollouts if rollouts else None}


#: The evaluation keys the summary keeps (``eval/<name>`` in the record, ``<name>`` in summary.json).
def _sync_stall(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What weight syncs cost the learner: the stall per sync (median, the start-up sync left out: it
    also builds the transfer group) and the share of training time (sum of ``time/step``) spent stalled.

    A sync step is one whose record has ``time/sync_total`` in blocking mode (the whole push stalls it)
    and ``sync/started`` = 1 in overlap mode (the snapshot is its stall; the push runs on)."""
    overlap = any("sync/started" in r for r in records)
    steps = [r for r in records if (r.get("sync/started") == 1 if overlap else "time/sync_total" in r)]
    stalls = [float(r.get("time/sync_stall", 0.0)) for r in steps[1:]]
    train_s = sum(float(r.get("time/step", 0.0)) for r in records)
    stalled = sum(float(r.get("time/sync_stall", 0.0)) for r in records)
    # after the start-up sync (it builds the transfer group, a first overlap snapshot allocates its buffer, and the
    # first step compiles): what the syncs cost per unit of training in the steady state, which a short run's
    # share hides behind its start
    after = records[next((i for i, r in enumerate(records) if r is steps[0]), -1) + 1:] if steps else records
    after_s = sum(float(r.get("time/step", 0.0)) for r in after)
    return {
        "sync_mode": "overlap" if overlap else "blocking",
        "sync_stall_median_s": statistics.median(stalls) if stalls else None,
        "sync_stall_n": len(stalls),
        "sync_stall_share": stalled / train_s if train_s else None,
        "sync_stall_share_after_start": sum(float(r.get("time/sync_stall", 0.0)) for r in after) / after_s
        if after_s else None,
    }


def _sync_bytes(s: dict[str, Any]) -> str:
    """``; 1.2 MB sent, 14.0 MB left on the servers`` when the records carry the pushes' bytes (else nothing); a run
    that left nothing there (a full fine-tune) says only what it sent."""
    sent, skipped = s.get("sync_bytes") or 0.0, s.get("sync_skipped_bytes") or 0.0
    if not sent and not skipped:
        return ""
    left = f", {skipped / 1e6:.1f} MB left on the servers (frozen or merged there)" if skipped else ""
    return f"; {sent / 1e6:.1f} MB sent{left}"


def _syncs(records: list[dict[str, Any]], final: dict[str, Any] | None) -> int:
    """Committed pushes: the final checkpoint's count (it includes a push settled after the last record),
    else the sum of the per-step adoptions."""
    counted = (final or {}).get("sync_counts", {}).get("sync/successes")
    if isinstance(counted, int):
        return counted
    return int(sum(int(r.get("sync/count", 0)) for r in records))


def format_summary(s: dict[str, Any], wall_s: float | None = None, exit_codes: dict[str, Any] | None = None,
                   run_dir: Path | None = None) -> str:
    if not s.get("steps"):
        where = Path(run_dir) / "logs" if run_dir is not None else "the run's logs/ directory"
        return f"no optimizer steps recorded (see {where})"
    f = lambda x: "n/a" if x is None or x != x else f"{x:.3f}"  # noqa: E731
    lines = [
        "──────── tandem run summary ────────",
        f"optimizer steps        {s['steps']}  (A {s['steps_a']}, B {s['steps_b']})",
        f"B wanted by policy     {s['policy_wanted_b']}  (skipped for short queues: {s['b_skipped_due_to_queue']})",
        *([line] if (line := format_bound(s.get("b_bound"))) else []),
        f"b_ratio realised       {f(s['b_ratio_realized'])}",
        f"packs trained (B)      {s['packs_trained_b']}",
        f"drops: stale / oldest  {s['drop_stale_total']} / {s['drop_oldest_total']}  (packs rejected at admission: "
        f"{s.get('rejected_total', 0)}; steps skipped for a non-finite loss: {s.get('nonfinite_skipped', 0)})",
        f"final ver              {s['ver_final']}  (syncs: {s['syncs']}{_sync_bytes(s)})",
        f"sync stall per sync    {f(s.get('sync_stall_median_s'))} s  ({s.get('sync_mode', 'blocking')}, median of "
        f"{s.get('sync_stall_n', 0)} after the first; {_pct(s.get('sync_stall_share'))} of training time, "
        f"{_pct(s.get('sync_stall_share_after_start'))} after the start-up sync)",
        f"mean pack fill         B {f(s['mean_fill_b'])}  A {f(s['mean_fill_a'])}",
        f"learner busy fraction  {f(s['busy_fraction'])}  (waited for packs {s['wait_for_packs_s']:.2f} s, "
        f"for A windows {s.get('wait_for_a_window_s', 0.0):.2f} s; inputs {s.get('prepare_inputs_s', 0.0):.2f} s, "
        f"other {s.get('other_s', 0.0):.2f} s; optimizer steps {s.get('optimizer_step_s', 0.0):.2f} s)",
        _rollout_line(s, f),
        _loss_line(s, f),
        _learner_line(s, f),
        *eval_lines(s.get("eval"), s.get("val_jsonl"), f),
        *([f"best checkpoint        step {b['step']} ({b['metric']} {f(b['value'])}, the best of those kept): {b['path']}"]
          if (b := s.get("best_checkpoint")) else []),
    ]
    if wall_s is not None:
        lines.append(f"wall time              {wall_s:.1f} s")
    if exit_codes:
        lines.append("exit codes             " + ", ".join(f"{k}={v}" for k, v in exit_codes.items()))
    return "\n".join(lines)


def _learner_line(s: dict[str, Any], f: Any) -> str:
    """``learner  fsdp, step 1.234 s median; peak per rank: GPU allocated 10.1 / 10.2 GiB, host RSS 30.2 / 30.5 GiB``."""
    labels = {"allocated": "GPU allocated", "reserved": "GPU reserved", "rss": "host RSS"}
    peaks = s.get("peak_memory_gb_by_rank") or {}
    mem = [f"{labels[k]} {' / '.join(f'{g:.2f}' for g in peaks[k])} GiB" for k in MEMORY_NAMES if peaks.get(k)]
    rate = ""
    if s.get("tokens_per_s_median") is not None:
        rate = f", {s['tokens_per_s_median']:,.0f} tokens/s median"
        if s.get("mfu_median") is not None:
            peak = s["peak_tflops"]  # a CPU's is ~0.1: three significant digits there, whole numbers on GPUs
            shown = f"{peak:,.0f}" if peak >= 10 else f"{peak:.3g}"
            rate += (f", MFU {100 * s['mfu_median']:.1f} % (of {shown} TFLOP/s, "
                     f"{s.get('peak_source') or 'measured'})")
    return (f"learner                {s.get('parallel', 'ddp')}, step {f(s.get('step_time_median_s'))} s median{rate}"
            + (f"; peak per rank: {', '.join(mem)}" if mem else ""))


def _rollout_line(s: dict[str, Any], f: Any) -> str:
    if s.get("rollout_f1") is None:
        return "rollout P / R / F1     n/a (no B rollouts)"
    line = (f"rollout P / R / F1     {f(s['rollout_precision'])} / {f(s['rollout_recall'])} / {f(s['rollout_f1'])}  "
            f"(B packs: {s.get('rollout_n_matched', 0)} matched of {s.get('rollout_n_pred', 0)} predicted, "
            f"{s.get('rollout_n_gt', 0)} GT)")
    if s.get("rollouts_valid_share") is not None:
        line += (f"\nB rollouts parsed      {100 * s['rollouts_valid_share']:.0f} % of {s['rollouts_trained']} "
                 "to ≥ 1 valid object")
    return line


def _run_config_section(run_dir: Path, section: str) -> dict[str, Any] | None:
    """One section of the run's ``run_config.yaml`` as written; None when the file or the section is unreadable."""
    import yaml  # omegaconf's own dependency

    try:
        cfg = yaml.safe_load((Path(run_dir) / "run_config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    data = cfg.get(section) if isinstance(cfg, dict) else None
    return data if isinstance(data, dict) else None


def _val_jsonl(run_dir: Path) -> Any:
    """``data.val_jsonl`` from the run's ``run_config.yaml``: the path, False when unset, None when unknown."""
    data = _run_config_section(run_dir, "data")
    return (data.get("val_jsonl") or False) if data is not None else None


def best_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The run's best checkpoint still on disk by ``training.keep_best`` (eval/f1 when unset): step, metric,
    value, path (common/runs/retention.py: an evaluation counts for the checkpoint of its step); None without one."""
    from common.runs.retention import find_best

    keep_best = (_run_config_section(run_dir, "training") or {}).get("keep_best") or "eval/f1"
    try:
        best = find_best(run_dir, keep_best)
    except ValueError:  # a run_config.yaml of another version naming a metric this one does not know
        return None
    return best.as_dict() if best is not None else None


def _pct(x: float | None) -> str:
    """A share as a percentage: one decimal below 10 % (a 0.2 % stall is not "0 %")."""
    return "n/a" if x is None else f"{100 * x:.1f} %" if 100 * x < 10 else f"{100 * x:.0f} %"


def print_summary(run_dir: Path, wall_s: float | None = None, exit_codes: dict[str, Any] | None = None) -> dict:
    by_kind: dict[str, list[dict[str, Any]]] = {"step": [], "eval": [], "end": []}
    for r in read_records(run_dir):  # one read: step, eval and end records
        by_kind.setdefault(record_kind(r), []).append(r)
    records, evals = by_kind["step"], by_kind["eval"]
    s = summarize(records, read_final_state(run_dir, records, by_kind["end"]), evals)
    if s.get("steps"):
        s["val_jsonl"] = _val_jsonl(run_dir)
        s["best_checkpoint"] = best_checkpoint(run_dir)
    if wall_s is not None:
        s["wall_s"] = wall_s
    if exit_codes is not None:
        s["exit_codes"] = exit_codes
    if s.get("steps"):  # over the learner's own time: the steps' wall clock, start-up excluded
        s["b_bound"] = b_bound(records, read_actor_records(run_dir), sum(r.get("time/step", 0.0) for r in records))
    (Path(run_dir) / "summary.json").write_text(json.dumps(s, indent=2, default=str))
    print(format_summary(s, wall_s, exit_codes, run_dir))
    return s


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser("python -m launcher.summary", __doc__)
    ap.add_argument("run_dir", nargs="?", default="runs/demo", help="a run's output_dir (default: %(default)s)")
    print_summary(Path(ap.parse_args(argv).run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
