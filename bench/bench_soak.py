"""Overload soak: actors far faster than the learner for minutes; memory, threads and sockets stay flat.

    python bench/bench_soak.py [--duration-s 180] [--learner real|queue] [--flood-hz 20] [--quick]

Processes (each its own, so each is measured alone; ZMQ on loopback, the real wire codec)::

    actor  (real ActorLoop: stream → encode → pack → credits → PUSH; its rollouts are instant
            GT-shaped answers, so it is limited by credits only)            ──packs──► learner rank 0
    flood  (a peer that ignores credits: one pack every 1/--flood-hz s)     ──packs──► (drop-oldest)
    learner: real = ``python learner/main.py`` (tiny model, one rank, no rollout server: the start-up
             sync fails fast, ver stays 0), ``training.max_train_seconds`` = --duration-s + 30 s (it
             outlasts the sampled window whatever the actors' start-up lag, then ends by itself);
             queue = the ready queue alone (``learner.pack_queue.ReadyQueue`` + its sockets), consuming
             GA packs every --step-s until told to stop: the receive and credits path without the model
    this process: every --sample-s, /proc/<pid>/status (VmRSS, Threads) and /proc/<pid>/fd (all, and
             sockets) of the learner, the actor and the flood peer

At the end the learner's last credits say done, the actor exits on them (its exit delay is reported),
and one JSON line is printed: per process first / warm (after --warmup-frac of the run) / end / max of
RSS (MB), threads, fds, sockets, and the RSS slope after warm-up (MB/min) — every sample is kept in
``<out>/samples.jsonl``; the packs offered, received,
trained and dropped by reason; and whether the conservation identities held at every record — the
learner's ``received = trained + dropped (every reason) + reserved + in_queue`` and the actor's
``actor/conservation_ok``; and ``flat`` per process (RSS grew at most max(10 MB, 5 %) after warm-up,
threads / fds / sockets varied by at most 2 after it). Figures count from the moment every process is
up and packs flow. ``--quick``: 8 s of queue-mode soak, ~16 s in all (tests/test_bench_scripts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SINKS_EXCLUDED = {"received", "malformed"}  # every other queue counter is a place a received pack went
LEARNER_MARGIN_S = 30.0  # a real learner trains this much longer than the sampled window (actors start later)


# ------------------------------------------------------------------------------------------ config


def overrides(out: Path, base_port: int, args: argparse.Namespace) -> list[str]:
    from common.data.synthetic import ensure_synthetic_data
    from tools.make_tiny_model import ensure_tiny_model

    model = ensure_tiny_model(ROOT / "artifacts" / "tiny-model")
    data = ensure_synthetic_data(ROOT / "artifacts" / "data" / "synth-test")
    return [
        f"model.path={model}", f"data.train_jsonl={data / 'train.jsonl'}", "data.val_jsonl=null",
        f"training.output_dir={out}", "training.max_steps=100000000", "training.save_every_steps=0",
        "training.progress=false", "training.gradient_accumulation_steps=2", "training.per_device_train_batch_size=1",
        "training.global_max_length=768", "training.pack_max_wait_s=0.5", "training.eval_every_steps=0",
        f"training.max_train_seconds={args.duration_s + LEARNER_MARGIN_S}", "learner.nproc_per_node=1", "learner.pack_wait_s=0",
        "rollout_matching.vllm.servers=[{base_url: 'http://127.0.0.1:9'}]",  # the discard port: syncs fail fast
        "weight_sync.every_steps=100000000", "weight_sync.mode=blocking",
        "stage2_ab.channel_b.async.queue_limit=6", "stage2_ab.channel_b.async.prefetch_target_packs=3",
        "stage2_ab.channel_b.async.version_window=2", "stage2_ab.schedule.b_ratio=0.5",
        f"transport.base_port={base_port}", "transport.hwm=16", "transport.credit_interval_s=0.1",
        "actor.metrics_every_s=2", "actor.learner_wait_timeout_s=120",
    ]


def load(argv_overrides: list[str]):
    from common.config.load import load_config

    return load_config(ROOT / "configs" / "demo_cpu.yaml", argv_overrides, world_size=1)


# ------------------------------------------------------------------------------------------ roles


class InstantClient:
    """A rollout server that answers at once: one object per sample, under the ver the actor asks for."""

    def __init__(self, tokenizer) -> None:
        from common.detection.answer import IM_END, serialize_objects
        from common.data.records import GTObject

        self.ids = tokenizer.encode(serialize_objects([GTObject("red circle", (10, 20, 300, 400))]) + IM_END,
                                    add_special_tokens=False)

    def infer(self, items, sampling, *, min_ver=None, client=None):
        out = type("Out", (), {"token_ids": self.ids, "ver": max(0, min_ver or 0), "finish_reason": "stop",
                               "prompt_token_ids": None})
        return type("Result", (), {"outputs": [out() for _ in items]})()


def role_actor(cfg) -> int:
    from actor.loop import ActorLoop
    from common.packing.encode import encoder_from_config

    encoder = encoder_from_config(cfg)
    return ActorLoop(cfg, 0, 0, encoder=encoder, client=InstantClient(encoder.tokenizer), config_path="soak").run()


def role_flood(cfg, hz: float) -> int:
    """Packs of real encoded segments at ``hz`` with fresh ids, ignoring credits (a misbehaving peer)."""
    from dataclasses import replace

    from common.detection.answer import canonical_order
    from common.data.records import load_record
    from common.packing.segment import Pack
    from common.detection.targets import channel_a_target
    from common.packing.encode import encoder_from_config
    from common.wire.transport import PackSender, pack_endpoint
    from common.wire.codec import pack_to_frames

    enc = encoder_from_config(cfg)
    pool = []
    for line in Path(cfg.data.train_jsonl).read_text().splitlines()[:4]:
        rec = load_record(json.loads(line))
        tgt = channel_a_target(canonical_order(rec.objects), enc.tokenizer, coord_ids=enc.coord_ids)
        if (seg := enc.encode(rec, tgt, sample_id="flood", channel="B", ver=0)) is not None:
            pool.append(seg)
    sender = PackSender(pack_endpoint(cfg.transport, 0), hwm=cfg.transport.hwm, linger_ms=0)
    print(json.dumps({"ready": True}), flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sent, n, next_at = 0, 0, time.monotonic()
    while not stop:
        seg = replace(pool[n % len(pool)], sample_id=f"flood{n}@0", ver=0)
        if sender.send(pack_to_frames(Pack(ver=0, channel="B", segments=[seg]), "flood-r0", n), timeout_s=0.5):
            sent += 1
            n += 1
        next_at += 1.0 / hz
        time.sleep(max(0.0, next_at - time.monotonic()))
    sender.close()
    print(json.dumps({"flood_sent": sent}), flush=True)
    return 0


def role_queue(cfg, step_s: float, result: Path) -> int:
    """The learner rank's receive path alone: ReadyQueue + sockets, GA packs consumed every ``step_s``, until SIGTERM."""
    from common.wire.transport import CreditPublisher, PackReceiver, credit_endpoint, pack_endpoint
    from learner.pack_queue import ReadyQueue

    t, a = cfg.transport, cfg.stage2_ab.channel_b.async_
    ga = cfg.derived.gradient_accumulation_steps
    receiver = PackReceiver(pack_endpoint(t, 0), hwm=t.hwm, linger_ms=t.linger_ms)
    publisher = CreditPublisher(credit_endpoint(t, 0))
    queue = ReadyQueue(rank=0, queue_limit=a.queue_limit, version_window=a.version_window,
                       target=a.prefetch_target_packs, recv=receiver.recv, publish=publisher.publish,
                       credit_interval_s=t.credit_interval_s)
    queue.start()
    steps, broken = 0, 0
    stop_flag: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop_flag.append(1))
    end = time.monotonic() + 3600
    try:
        while time.monotonic() < end and not stop_flag:
            time.sleep(step_s)
            if queue.eligible() >= ga:
                for item in queue.reserve(ga):
                    queue.mark_trained(item)
                steps += 1
            try:
                queue.check_conservation()
            except AssertionError:
                broken += 1
        queue.stop()  # the final credits say done
    finally:
        receiver.close()
        publisher.close()
    result.write_text(json.dumps({"steps": steps, "conservation_broken": broken, "queue": queue.snapshot()}))
    return 0


# ------------------------------------------------------------------------------------------ sampling


def proc_sample(pid: int) -> dict[str, float] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]), "fds": len(fds),
            "sockets": sockets}


def summarise(samples: list[tuple[float, dict]], warm_t: float) -> dict[str, Any]:
    if not samples:
        return {}
    warm = [s for s in samples if s[0] >= warm_t] or samples[-1:]
    out: dict[str, Any] = {}
    for key in ("rss_mb", "threads", "fds", "sockets"):
        out[key] = {"first": samples[0][1][key], "warm": warm[0][1][key], "end": samples[-1][1][key],
                    "max": max(s[1][key] for s in samples), "max_after_warm": max(s[1][key] for s in warm),
                    "min_after_warm": min(s[1][key] for s in warm)}
    if len(warm) >= 3:  # least-squares slope of RSS after warm-up, MB per minute
        ts, ys = [s[0] for s in warm], [s[1]["rss_mb"] for s in warm]
        tm, ym = sum(ts) / len(ts), sum(ys) / len(ys)
        den = sum((t - tm) ** 2 for t in ts)
        out["rss_slope_mb_per_min"] = round(60 * sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / den, 3) if den else 0.0
    for key in ("rss_mb",):
        for k, v in out[key].items():
            out[key][k] = round(v, 1)
    return out


# ------------------------------------------------------------------------------------------ driver


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the group we created
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(grace_s)


def learner_counters(out: Path, mode: str) -> tuple[dict[str, int], bool, int]:
    """(final queue counters, conservation held at every record, optimizer steps)."""
    if mode == "queue":
        r = json.loads((out / "queue_result.json").read_text())
        return r["queue"], r["conservation_broken"] == 0, r["steps"]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if r.get("record", "step") == "step"]
    ok = True
    for r in recs:
        q = {k.rsplit("/", 1)[1]: v for k, v in r.items() if k.startswith("queue/rank0/")}
        ok &= q["received"] == sum(v for k, v in q.items() if k not in SINKS_EXCLUDED)
    last = {k.rsplit("/", 1)[1]: v for k, v in recs[-1].items() if k.startswith("queue/rank0/")} if recs else {}
    return last, ok and bool(recs), len(recs)


def ready(out: Path, flood: bool) -> bool:
    """The actor sent a pack (its ledger has one) and the flood peer, if any, is sending."""
    ledger = out / "actor_rank0_0.ledger.jsonl"
    actor_up = ledger.exists() and '"seq"' in ledger.read_text()
    return actor_up and (not flood or '"ready"' in (out / "flood.log").read_text())


def flat(summary: dict[str, Any]) -> bool:
    """RSS grew at most max(10 MB, 5 %) after warm-up; threads, fds and sockets varied by at most 2 after it."""
    rss = summary["rss_mb"]
    return (rss["end"] - rss["warm"] <= max(10.0, 0.05 * rss["warm"])
            and all(summary[k]["max_after_warm"] - summary[k]["min_after_warm"] <= 2 for k in ("threads", "fds", "sockets")))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.ports import free_port_block

    out = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    ov = overrides(out, free_port_block(2), args)
    me = [sys.executable, str(Path(__file__).resolve())]
    if args.learner == "real":
        learner = spawn([sys.executable, "learner/main.py", "--config", "configs/demo_cpu.yaml", *ov], out / "learner.log")
    else:
        learner = spawn([*me, "--role", "queue", "--step-s", str(args.step_s), "--", *ov], out / "learner.log")
    actor = spawn([*me, "--role", "actor", "--", *ov], out / "actor.log")
    flood = spawn([*me, "--role", "flood", "--flood-hz", str(args.flood_hz), "--", *ov], out / "flood.log") \
        if args.flood_hz > 0 else None
    procs = {"learner": learner, "actor": actor, **({"flood": flood} if flood else {})}
    samples: dict[str, list] = {k: [] for k in procs}
    t0 = time.monotonic()
    deadline = t0 + args.duration_s + 180  # start-up (model, imports) and the end of the learner's last step
    learner_end = soak_start = None
    try:
        while learner.poll() is None and time.monotonic() < deadline:
            now = time.monotonic() - t0
            if soak_start is None and ready(out, flood is not None):
                soak_start = now  # every process is up and packs flow: figures count from here
            if soak_start is not None:
                if now >= soak_start + args.duration_s:
                    break
                for name, p in procs.items():
                    if (s := proc_sample(p.pid)) is not None:
                        samples[name].append((now, s))
            time.sleep(args.sample_s)
        soak_end = time.monotonic()
        if args.learner == "queue":
            os.kill(learner.pid, signal.SIGTERM)  # the queue stops: its last credits say done
        learner.wait(LEARNER_MARGIN_S + 60)
        learner_end = time.monotonic()
        try:
            actor.wait(60)
        except subprocess.TimeoutExpired:
            pass
        actor_exit_s = time.monotonic() - learner_end if actor.poll() is not None else None
    finally:
        for p in procs.values():
            stop(p)
    with (out / "samples.jsonl").open("w") as f:  # every sample, for a plot or a closer look
        for name, ss in samples.items():
            for t, smp in ss:
                f.write(json.dumps({"process": name, "t": round(t, 2), **smp}) + "\n")
    soak_s = (soak_end - t0) - soak_start if learner_end and soak_start is not None else 0.0
    soak_start = soak_start or 0.0
    warm_t = soak_start + args.warmup_frac * soak_s
    counters, learner_ok, steps = learner_counters(out, args.learner)
    actor_recs = [json.loads(x) for x in (out / "actor_rank0_0.jsonl").read_text().splitlines() if x.strip()] \
        if (out / "actor_rank0_0.jsonl").exists() else []
    actor_recs = [r for r in actor_recs if r.get("event") in ("metrics", "final")]
    final = actor_recs[-1] if actor_recs else {}
    flood_sent = None
    if flood is not None:
        lines = [x for x in (out / "flood.log").read_text().splitlines() if x.startswith("{")]
        flood_sent = json.loads(lines[-1])["flood_sent"] if lines else None
    wait_credit = sum(r.get("time/wait_credit", 0.0) for r in actor_recs)
    return {
        "bench": "soak", "learner_mode": args.learner, "duration_s": args.duration_s, "soak_s": round(soak_s, 1),
        "cores": os.cpu_count(), "flood_hz": args.flood_hz, "out": str(out),
        "processes": {name: summarise(s, warm_t) for name, s in samples.items()},
        "flat": {name: flat(summarise(s, warm_t)) for name, s in samples.items() if s},
        "learner": {"exit": learner.returncode, "steps": steps, "queue": counters},
        "actor": {"exit": actor.returncode, "exit_after_learner_s": None if actor_exit_s is None else round(actor_exit_s, 2),
                  "packs_sent": final.get("actor/packs_sent"), "samples_done": final.get("actor/samples_done"),
                  "wait_credit_share": round(wait_credit / soak_s, 3) if soak_s else None,
                  "dropped_at_stop": final.get("actor/dropped_at_stop")},
        "flood_sent": flood_sent,
        "conservation": {"learner": learner_ok, "actor": bool(actor_recs) and all(r["actor/conservation_ok"] == 1
                                                                                  for r in actor_recs)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=180.0, help="how long the learner trains (the soak)")
    ap.add_argument("--learner", choices=["real", "queue"], default="real", help="a real learner rank or its queue alone")
    ap.add_argument("--flood-hz", type=float, default=20.0, help="packs/s of the credit-ignoring peer (0: none)")
    ap.add_argument("--step-s", type=float, default=0.5, help="queue mode: one optimizer step (GA packs) per this long")
    ap.add_argument("--sample-s", type=float, default=1.0, help="sampling interval of /proc")
    ap.add_argument("--warmup-frac", type=float, default=0.25, help="share of the soak before the 'warm' figures")
    ap.add_argument("--quick", action="store_true", help="8 s of queue-mode soak, ~16 s in all (tests)")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--role", choices=["driver", "actor", "flood", "queue"], default="driver", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)  # a role's config overrides (after --)
    args = ap.parse_args(argv)
    if args.role != "driver":
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        cfg = load(args.rest)
        if args.role == "actor":
            return role_actor(cfg)
        if args.role == "flood":
            return role_flood(cfg, args.flood_hz)
        return role_queue(cfg, args.step_s, Path(cfg.training.output_dir) / "queue_result.json")
    if args.quick:
        args.duration_s, args.learner, args.sample_s = 8.0, "queue", 0.5
    result = run(args)
    line = json.dumps(result)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)
    ok = result["conservation"]["learner"] and result["conservation"]["actor"] and result["learner"]["exit"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
