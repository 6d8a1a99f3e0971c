#!/usr/bin/env bash
# GPU sessions, each part one call of at most 10 minutes (every step has its own deadline; a failed
# step is logged and the part goes on with the next one).
#
# 2-GPU machine (nvidia-h200-x2):
#   bash bench/gpu_session.sh A    # GPU tests (hf NCCL path, vLLM engine: prompts, greedy match,
#                                  # fence under load) + weight-sync bench for 0.5b and 1.5b
#   bash bench/gpu_session.sh B    # launcher: async training, >= 50 optimizer steps on the 1+1 split
#                                  # + weight-sync bench for 7b
#   bash bench/gpu_session.sh C    # re-run after fixes: GPU tests + 7b bench with 2 GB buckets
#
# 4-GPU machine (nvidia-h200-x4), ONE session, parts X1, X2, X3 as separate calls on the same warm
# machine (each re-creates what it needs only if missing; each stays under BUDGET=540 s: a step's
# deadline is cut to what is left of the budget, a step with < 15 s left is skipped):
#   bash bench/gpu_session.sh X1   # setup (models 0.5b + 1.5b, data), test_gpu_vllm + test_gpu_weight_sync,
#                                  # bench 0.5b,1.5b fast vs native, TP 1 (server GPU 0, learner GPU 1)
#   bash bench/gpu_session.sh X2   # bench 7b fast vs native TP 1; bench 1.5b TP 2 (server GPUs 0,1, learner 2)
#   bash bench/gpu_session.sh X3   # launcher 2+2 (configs/gpu/split_2p2.yaml, 50 steps) blocking, then the
#                                  # same with sync_mode=overlap; run evidence + sync stall medians
#   bash bench/gpu_session.sh Y1   # GPU tests of the fast load path + bench 0.5b, 7b TP 1 (fast block, native block)
#   bash bench/gpu_session.sh Y2   # bench 1.5b TP 2; the 2 + 2 split 200 steps, overlap, fast load, drain fence
#   bash bench/gpu_session.sh Y3   # bench on random-weight checkpoints: 0.5b, 7b TP 1, 1.5b TP 2; a dummy-load probe
#   bash bench/gpu_session.sh Y4   # GPU tests + bench 0.5b, 7b: verifies the fence/commit/fingerprint changes
#   bash bench/gpu_session.sh Y5   # 2 + 2 split 50 steps (overlap, fast load): DDP without the unused search
#   bash bench/gpu_session.sh Y6   # the same run after the actor admission change (actor metrics bundled too)
#   bash bench/gpu_session.sh Y7   # 2 GPUs: 1 + 1 split, async vs the synchronous step baseline, 40 steps each
#
# 1-GPU machine (nvidia-h100-x1 / nvidia-h200), the one-GPU topology (learner beside vLLM on one GPU):
#   bash bench/gpu_session.sh Z1   # setup + tests/test_gpu_vllm.py (CUDA graphs + ipc/http round trip)
#   bash bench/gpu_session.sh Z2   # bench/bench_one_gpu_sync.py (ipc vs http) + configs/gpu/one_gpu.yaml, 50 steps
#   bash bench/gpu_session.sh F1   # the 7b preset on one GPU beside an hf rollout server: FSDP2 + CPU offload
#                                  # (configs/gpu/fsdp_7b_1gpu.yaml, 20 steps), then learner.parallel=ddp (3 steps);
#                                  # then the sharded-learner GPU sync tests (ipc + http, one GPU)
#
# 4-GPU machine (nvidia-h100-x4), ONE session, vLLM staged part by part between G1 and G8 (each call carries one
# .vllm-pN; G1 also installs the project's wheels into /tmp/site0, G8 installs vLLM into /tmp/site):
#   bash bench/gpu_session.sh G1   # issue 20 on two GPUs: DDP vs FSDP2 learners (2 ranks, GPUs 1-2) at 1.5b and 7b,
#                                  # hf server on GPU 0 (configs/gpu/fsdp_2gpu.yaml): peak memory, step time, sync
#   bash bench/gpu_session.sh G2   # Stage-B throughput vs world size 1, 2, 4 (0.5b, hf engine in-process)
#   bash bench/gpu_session.sh G8   # quality per learner-second from the tiny detector's warm start, vLLM 1 + 1 twice:
#                                  # A-only then step on GPUs 0-1, async AB then the NCCL sync bench on GPUs 2-3
#   bash bench/gpu_session.sh G9   # make test-gpu (every GPU test, the two-GPU ones included)
#
# 4-GPU machine, the 2026-11-27 session (vLLM staged as for G: H1 carries .vllm-p1 + .whl, H8 installs vLLM):
#   bash bench/gpu_session.sh H1   # no vLLM: models (0.5b, tiny) + data, then bench/bench_stage_b.py at 1, 2, 4 ranks
#   bash bench/gpu_session.sh H8   # quality arms after the fence fix (G8's pair 1 on GPUs 0-1: A-only then step;
#                                  # pair 2 on GPUs 2-3: async AB), then the one-GPU topology (configs/gpu/one_gpu.yaml,
#                                  # 50 steps) on GPU 2: issue 19's one-GPU after-run
#   bash bench/gpu_session.sh H9   # make test-gpu on GPUs 0-1 beside the NCCL sync bench 0.5b/1.5b/7b on GPUs 2-3
#   bash bench/gpu_session.sh H10  # b_ratio sweep of the async arm (0.1, 0.3 on GPUs 0-1; 0.2, 0.4 on GPUs 2-3), 75 s each
#   bash bench/gpu_session.sh H11  # sync_every x version_window, two points side by side: (2, 1) on GPUs 0-1, (4, 4) on 2-3
#
# Anywhere (no GPU): bash bench/gpu_session.sh E RUN_DIR...   # the run evidence of finished runs
#
# Needs vLLM 0.26.0 importable (docs/gpu.md: staged under /tmp/site) and writes logs and results to
# $OUT (default /tmp/gpu-out); X parts bundle logs into one logs-<part>.tar.gz (a call brings back
# at most 8 files).
set -u
PART=${1:?usage: bench/gpu_session.sh A|B|C|X1|X2|X3|Y1|Y2|Y3|Y4|Y5|Y6|Y7|Z1|Z2|F1|G1|G2|G8|G9|H1|H8|H9|H10|H11|E [RUN_DIR...]}
shift
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-}:$PWD" PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # machine rule: no NVLink multicast
LOG="$OUT/session-$PART.log"
T0=$(date +%s)
BUDGET=${BUDGET:-}   # seconds for the whole part (X parts: 540); empty = no cap
MODELS=/tmp/tandem-models
DATA=/tmp/tandem-data/synth

step() {  # step NAME DEADLINE_S CMD...   (env: KILL_AFTER, SIGKILL this long after the deadline's SIGTERM)
  local name=$1 limit=$2 kill_after=${KILL_AFTER:-10}; shift 2
  if [ -n "$BUDGET" ]; then
    local left=$(( BUDGET - ($(date +%s) - T0) - kill_after - 5 ))
    if [ "$left" -lt 15 ]; then
      echo "=== [$(( $(date +%s) - T0 ))s] $name SKIPPED: ${left}s left of the ${BUDGET}s budget" | tee -a "$LOG"
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== [$(( $(date +%s) - T0 ))s] $name (deadline ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after="$kill_after" "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== [$(( $(date +%s) - T0 ))s] $name -> rc=$rc" | tee -a "$LOG"
  return 0
}

setup() {
  step env 60 bash -c 'nvidia-smi --query-gpu=index,name,memory.total --format=csv; nvidia-smi topo -m | head -5;
    python3 -c "import torch, transformers, vllm, fastapi, zmq, omegaconf; print(torch.__version__, torch.version.cuda,
    torch.cuda.nccl.version(), transformers.__version__, vllm.__version__, torch.cuda.device_count())"'
  mkdir -p .make && touch .make/installed   # make test-gpu: the image already has the deps (no index there)
  step models 180 bash -c 'python3 tools/make_tiny_model.py --out artifacts/tiny-model &&
    python3 tools/make_tiny_model.py --preset 0.5b --out /tmp/tandem-models/0.5b &&
    python3 -m common.data.synthetic --out /tmp/tandem-data/synth --n 96 --seed 0'
}

# ---------------------------------------------------------------------------------------- X parts

setup_x() {  # what every X part needs; models and data only where missing (a warm machine keeps /tmp)
  step env 45 bash -c 'nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv;
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; nvidia-smi topo -m | head -6;
    python3 -c "import torch, transformers, vllm; print(torch.__version__, torch.version.cuda,
    torch.cuda.nccl.version(), transformers.__version__, vllm.__version__, torch.cuda.device_count())"'
  mkdir -p .make && touch .make/installed
  if [ -f artifacts/tiny-model/tandem_build.json ] && [ -f $MODELS/0.5b/tandem_build.json ] &&
     [ -f $MODELS/1.5b/tandem_build.json ] && [ -f $DATA/train.jsonl ]; then
    echo "=== models and data present: $MODELS/0.5b $MODELS/1.5b $DATA artifacts/tiny-model" | tee -a "$LOG"
  else  # the bench builds its own config-only dirs ({preset}-config-only, 7b included): no 7b weights needed
    step models 200 bash -c "python3 tools/make_tiny_model.py --out artifacts/tiny-model &&
      python3 tools/make_tiny_model.py --preset 0.5b --out $MODELS/0.5b &&
      python3 tools/make_tiny_model.py --preset 1.5b --out $MODELS/1.5b &&
      python3 -m common.data.synthetic --out $DATA --n 96 --seed 0"
  fi
}

setup_z() {  # 1 GPU: the tiny model (GPU tests), the 0.5b preset and the data, where missing
  mkdir -p .make && touch .make/installed
  [ -f artifacts/tiny-model/tandem_build.json ] && [ -f $MODELS/0.5b/tandem_build.json ] && [ -f $DATA/train.jsonl ] ||
    step models 150 bash -c "nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv;
      python3 tools/make_tiny_model.py --out artifacts/tiny-model &&
      python3 tools/make_tiny_model.py --preset 0.5b --out $MODELS/0.5b && python3 -m common.data.synthetic --out $DATA --n 96 --seed 0"
}

quality_setup() {  # the quality parts' inputs: the tiny detector (carried in .gpu-carry: make tiny-detector) and its
  # data where missing; PAIR2 / SRV2: the overrides that put a second 1 + 1 pair on GPUs 2-3
  mkdir -p .make && touch .make/installed
  step env 30 bash -c 'nvidia-smi --query-gpu=index,memory.used --format=csv; python3 -c "import vllm, pycocotools; print(vllm.__version__)"'
  [ -f artifacts/tiny-detector/tandem_build.json ] || cp -r .gpu-carry/tiny-detector artifacts/
  [ -f artifacts/data/detect/train.jsonl ] || step data 120 python3 -m common.data.synthetic --out artifacts/data/detect \
    --split 4096/64 --seed 0 --sides 112 --max-objects 3 --size-range 0.25/0.6
  PAIR2="rollout_server.gpus=[2] learner.gpus=[3] rollout_server.port=8450 transport.base_port=5750"
  SRV2='rollout_matching.vllm.servers=[{base_url: "http://127.0.0.1:8450"}]'
}

quality_arms() {  # quality_arms TAG PAIR DEADLINE_S: bench_quality.py's A-only + step arms on GPUs 0-1 (PAIR 1) or its
  # async AB arm on GPUs 2-3 (PAIR 2), QBUDGET (75) learner-seconds an arm, into runs/TAG-pairPAIR
  local q="python3 bench/bench_quality.py --config configs/gpu/quality_split.yaml --budget-s ${QBUDGET:-75} --eval-every 100"
  # shellcheck disable=SC2086  # $q and $PAIR2 are word lists
  if [ "$2" = 1 ]; then
    step quality-pair1 "$3" $q --arms a_only,step --out "runs/$1-pair1" --json "$OUT/quality-pair1.json"
  else
    VLLM_CACHE_ROOT=/tmp/vllm-cache-pair2 step quality-pair2 "$3" $q --arms async_ab --out "runs/$1-pair2" \
      --json "$OUT/quality-pair2.json" $PAIR2 "$SRV2"
  fi
}

bundle() {  # bundle NAME PATH...: one tar.gz of what exists (log files cut to their last 3000 lines)
  local name=$1; shift
  local stage; stage=$(mktemp -d)
  for p in "$@"; do
    [ -e "$p" ] || continue
    if [ -d "$p" ]; then
      find "$p" -type f | while read -r f; do
        mkdir -p "$stage/$(dirname "$f")"
        case "$f" in
          *.log|*.txt|*.out) tail -n 3000 "$f" > "$stage/$f" ;;
          *.json|*.jsonl) [ "$(stat -c %s "$f")" -lt 4000000 ] && cp "$f" "$stage/$f" ;;
        esac
      done
    else
      mkdir -p "$stage/$(dirname "$p")" && tail -n 3000 "$p" > "$stage/$p"
    fi
  done
  tar czf "$OUT/$name" -C "$stage" . 2>>"$LOG"
  rm -rf "$stage"
  echo "=== bundled $OUT/$name ($(du -h "$OUT/$name" | cut -f1))" | tee -a "$LOG"
}

evidence() {  # evidence [--json PATH] RUN_DIR...: records, steps, vers, syncs, sync stall (blocking vs overlap)
  python3 - "$@" <<'PYEOF'
import json, statistics, sys
from pathlib import Path

args = sys.argv[1:]
out_json = None
if args[:1] == ["--json"]:
    out_json, args = args[1], args[2:]


def stats(vals):
    vals = sorted(v for v in vals if isinstance(v, (int, float)))
    if not vals:
        return None
    return {"n": len(vals), "median": round(statistics.median(vals), 4),
            "p90": round(vals[min(len(vals) - 1, round(0.9 * (len(vals) - 1)))], 4), "max": round(vals[-1], 4)}


def fmt(s):
    return "n/a" if s is None else f"median {s['median']:.4f}s p90 {s['p90']:.4f}s max {s['max']:.4f}s (n {s['n']})"


report = {}
for d in args:
    run = Path(d)
    f = run / "metrics.jsonl"
    if not f.is_file():
        print(f"[{run.name}] no {f}")
        continue
    recs = []
    for line in f.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:
            pass  # a torn last line of a killed run
    steps = [r for r in recs if "stage2_ab/async/step_kind_b" in r]
    overlap = any("sync/started" in r for r in steps)
    # blocking: the stall of a sync step is the whole push; overlap: a push starts at the boundary (snapshot)
    sync_steps = [r for r in steps if (r.get("sync/started") == 1 if overlap else "time/sync_total" in r)]
    vers = [r.get("stage2_ab/async/ver_current") for r in steps]
    last = steps[-1] if steps else {}
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    fb = [(r.get("time/forward_backward"), r.get("sync/in_flight")) for r in steps]
    e = {
        "mode": "overlap" if overlap else "blocking",
        "records": len(recs), "optimizer_steps": len(steps),
        "b_steps": sum(1 for r in steps if r.get("stage2_ab/async/step_kind_b")),
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
    }
    report[run.name] = e
    print(f"[{run.name}] {e['mode']}: records {e['records']}, optimizer steps {e['optimizer_steps']}, "
          f"B steps {e['b_steps']}, vers {e['vers'][:3]}..{e['vers'][-2:]} ({len(e['vers'])} distinct, "
          f"monotonic {e['ver_monotonic']}), {e['sync_counts']}, wall {e['wall_s']}, exit {e['exit_codes']}")
    print(f"[{run.name}]   time/sync_stall on sync steps excl. the first: {fmt(e['sync_stall_sync_steps_excl_first'])}")
    print(f"[{run.name}]   time/sync_stall on every step: {fmt(e['sync_stall_all_steps'])}")
    print(f"[{run.name}]   time/sync_total {fmt(e['sync_total'])}; fence {fmt(e['sync_fence'])}; "
          f"wire {fmt(e['sync_wire'])}")
    if overlap:
        print(f"[{run.name}]   time/sync_snapshot {fmt(e['sync_snapshot'])}; forward_backward with a push in flight "
              f"{fmt(e['forward_backward_push_in_flight'])} vs without {fmt(e['forward_backward_no_push'])}")
for on, o in report.items():  # every overlap run against every blocking run given
    for bn, b in report.items():
        if o["mode"] == "overlap" and b["mode"] == "blocking":
            bs, os_ = b["sync_stall_sync_steps_excl_first"], o["sync_stall_sync_steps_excl_first"]
            print(f"sync stall per sync (median, excl. the first): blocking {bs and bs['median']}s ({bn}) vs "
                  f"overlap {os_ and os_['median']}s ({on})")
if out_json:
    Path(out_json).write_text(json.dumps(report, indent=1))
PYEOF
}

run_logs() {  # run_logs RUN_DIR...: the last syncs as the learner and the server logged them
  for r in "$@"; do
    echo "--- $r"
    grep -h "weights synced" "$r"/logs/learner.log 2>/dev/null | tail -n 3
    grep -h -c "fast update:" "$r"/logs/rollout_server.log 2>/dev/null | sed 's/^/fast updates: /'
    grep -h -c "nccl update:" "$r"/logs/rollout_server.log 2>/dev/null | sed 's/^/native updates: /'
    grep -h -E "fast update:|nccl update:|fast weight load refused" "$r"/logs/rollout_server.log 2>/dev/null | tail -n 3
    grep -h -i -E "error|traceback|deadlock|watchdog" "$r"/logs/*.log 2>/dev/null | tail -n 5
  done
}

train_2p2() {  # train_2p2 NAME STEPS DEADLINE_S: the 2 + 2 split as configs/gpu/split_2p2.yaml now stands
  # (overlap, drain fence, 4 actors per rank, fast load), its 1.5b model and data built where missing
  local name=$1 steps=$2 limit=$3
  [ -f $MODELS/1.5b/tandem_build.json ] && [ -f $DATA/train.jsonl ] || step models 120 bash -c "
    python3 tools/make_tiny_model.py --preset 1.5b --out $MODELS/1.5b && python3 -m common.data.synthetic --out $DATA \
    --n 96 --seed 0"
  rm -rf "runs/$name"
  KILL_AFTER=40 step "launcher-$name" "$limit" python3 -m launcher --config configs/gpu/split_2p2.yaml \
    training.max_steps="$steps" rollout_server.weight_load=fast training.output_dir="runs/$name" run_name="$name" \
    --grace-s 20
}

export -f evidence run_logs   # for `step NAME S bash -c 'evidence ...'`
BENCH="python3 bench/bench_weight_sync.py"

case "$PART" in
  A)
    setup
    step gpu-tests-vllm 200 python3 -m pytest -q -m gpu -rA -s --tb=short -p no:cacheprovider tests/test_gpu_vllm.py
    step bench-small 220 python3 bench/bench_weight_sync.py --presets 0.5b,1.5b --syncs 5 --out "$OUT/bench-small.json"
    step gpu-tests-hf 120 python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider tests/test_gpu_weight_sync.py
    ;;
  B)
    [ -f /tmp/tandem-models/0.5b/tandem_build.json ] || setup
    rm -rf runs/gpu-1p1
    step launcher-1p1 330 python3 -m launcher --config configs/gpu/split_1p1.yaml training.max_steps=50
    step run-evidence 30 bash -c 'tail -n 3 runs/gpu-1p1/metrics.jsonl; python3 - <<EOF
import json
recs = [json.loads(l) for l in open("runs/gpu-1p1/metrics.jsonl") if l.strip()]
steps = [r for r in recs if "stage2_ab/async/step_kind_b" in r]
print("records", len(recs), "optimizer steps", len(steps),
      "B steps", sum(1 for r in steps if r.get("stage2_ab/async/step_kind_b")),
      "vers", sorted({r.get("stage2_ab/async/ver_current") for r in steps}))
EOF
      grep -h -i -E "weight sync|synced|sync/" runs/gpu-1p1/logs/*.log | tail -n 8'
    cp runs/gpu-1p1/metrics.jsonl "$OUT/metrics-1p1.jsonl" 2>/dev/null
    tail -n 60 runs/gpu-1p1/logs/rollout_server.log > "$OUT/rollout_server-1p1.log" 2>/dev/null
    step bench-7b 230 python3 bench/bench_weight_sync.py --presets 7b --syncs 5 --out "$OUT/bench-7b.json"
    ;;
  C)  # re-run after fixes: the two GPU test files and the 7b bench at two bucket sizes
    mkdir -p .make && touch .make/installed
    step models 120 bash -c 'python3 tools/make_tiny_model.py --out artifacts/tiny-model &&
      python3 tools/make_tiny_model.py --preset 0.5b --out /tmp/tandem-models/0.5b'
    step gpu-tests-vllm 200 python3 -m pytest -q -m gpu -rA -s --tb=short -p no:cacheprovider tests/test_gpu_vllm.py
    step gpu-tests-hf 100 python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider tests/test_gpu_weight_sync.py
    step bench-7b-2g 150 python3 bench/bench_weight_sync.py --presets 7b --syncs 4 --reps 2 --bucket-mb 2048 --out "$OUT/bench-7b-2g.json"
    ;;
  X1)  # ~7 min: env 10 s, models ~80 s (first time only), vLLM tests ~90 s, bench ~150 s, hf tests ~60 s
    BUDGET=${BUDGET:-540}
    setup_x
    step gpu-tests-vllm 170 python3 -m pytest -q -m gpu -rA -s --tb=short -p no:cacheprovider tests/test_gpu_vllm.py
    step bench-small 200 $BENCH --presets 0.5b,1.5b --weight-load fast,native --syncs 5 \
      --log-dir "$OUT/bench-logs" --out "$OUT/bench-small.json"
    # The training runs of X3 use the fast load path only if it was effective and digest-exact here.
    if python3 -c "import json, sys; r = json.load(open('$OUT/bench-small.json'))
sys.exit(0 if r and all(x.get('fast_effective') and x.get('digest', {}).get('ok') for x in r) else 1)"; then
      touch /tmp/tandem-fast-ok; echo "=== fast load path: effective and digest-exact" | tee -a "$LOG"
    else
      rm -f /tmp/tandem-fast-ok; echo "=== fast load path NOT verified: X3 trains with weight_load=native" | tee -a "$LOG"
    fi
    step gpu-tests-hf 90 python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider tests/test_gpu_weight_sync.py
    bundle logs-X1.tar.gz "$OUT/bench-logs" && rm -rf "$OUT/bench-logs"
    ;;
  X2)  # ~5 min: 7b TP 1 ~110 s, 1.5b TP 2 ~150 s (3-process raw broadcast, TP 2 server start)
    BUDGET=${BUDGET:-540}
    setup_x
    step bench-7b 230 $BENCH --presets 7b --weight-load fast,native --syncs 5 \
      --log-dir "$OUT/bench-logs" --out "$OUT/bench-7b.json"
    step bench-1.5b-tp2 250 $BENCH --presets 1.5b --weight-load fast,native --syncs 5 --tp 2 --server-gpus 0,1 \
      --learner-gpu 2 --log-dir "$OUT/bench-logs" --out "$OUT/bench-1.5b-tp2.json"
    bundle logs-X2.tar.gz "$OUT/bench-logs" && rm -rf "$OUT/bench-logs"
    ;;
  X3)  # ~8 min: the 2+2 split, blocking then overlap (same config, same machine, one after the other):
       # the overlap run also checks that DDP's all-reduce and the weight broadcast can share rank 0's GPU
    BUDGET=${BUDGET:-560}
    setup_x
    rm -rf runs/gpu-2p2 runs/gpu-2p2-overlap
    WL=rollout_server.weight_load=fast
    [ -f /tmp/tandem-fast-ok ] || WL=rollout_server.weight_load=native
    # the config as it was when X3 ran (session 2); the file now defaults to overlap + drain + 4 actors
    X3_AS_RUN="stage2_ab.channel_b.async.sync_mode=blocking rollout_matching.vllm.sync.fence=abort actor.num_actors_per_rank=2"
    KILL_AFTER=40 step launcher-2p2 260 python3 -m launcher --config configs/gpu/split_2p2.yaml training.max_steps=50 \
      $WL $X3_AS_RUN --grace-s 20
    KILL_AFTER=40 step launcher-2p2-overlap 250 python3 -m launcher --config configs/gpu/split_2p2.yaml \
      training.max_steps=50 $X3_AS_RUN stage2_ab.channel_b.async.sync_mode=overlap training.output_dir=runs/gpu-2p2-overlap \
      run_name=gpu-2p2-overlap $WL --grace-s 20
    step evidence-2p2 30 bash -c "evidence --json '$OUT/evidence-X3.json' runs/gpu-2p2 runs/gpu-2p2-overlap; \
      run_logs runs/gpu-2p2 runs/gpu-2p2-overlap"
    for r in gpu-2p2 gpu-2p2-overlap; do
      cp "runs/$r/metrics.jsonl" "$OUT/metrics-$r.jsonl" 2>/dev/null
    done
    bundle logs-X3.tar.gz runs/gpu-2p2/logs runs/gpu-2p2-overlap/logs runs/gpu-2p2/summary.json \
      runs/gpu-2p2-overlap/summary.json
    ;;
  Y1)  # ~8 min: GPU tests of the fast path (CUDA graphs, one-call receive, digest vs native), then the bench
       # 0.5b + 7b TP 1 (server GPU 0, learner GPU 1), fast block then native block
    BUDGET=${BUDGET:-560}
    step env 45 bash -c 'nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv;
      python3 -c "import torch, transformers, vllm; print(torch.__version__, torch.version.cuda,
      torch.cuda.nccl.version(), transformers.__version__, vllm.__version__, torch.cuda.device_count())"'
    mkdir -p .make && touch .make/installed
    step models 120 bash -c "python3 tools/make_tiny_model.py --out artifacts/tiny-model &&
      python3 tools/make_tiny_model.py --preset 0.5b --out $MODELS/0.5b"
    step gpu-tests 200 python3 -m pytest -q -m gpu -rA -s --tb=short -p no:cacheprovider tests/test_gpu_load_plan.py \
      tests/test_gpu_vllm.py
    step bench-y 260 $BENCH --presets 0.5b,7b --weight-load fast,native --syncs 5 \
      --log-dir "$OUT/bench-logs" --out "$OUT/bench-y.json"
    bundle logs-Y1.tar.gz "$OUT/bench-logs" && rm -rf "$OUT/bench-logs"
    ;;
  Y2)  # ~9 min: bench 1.5b TP 2 (2 workers receive), then the 2 + 2 split for 200 steps in overlap mode with
       # the fast load path and a drain fence (the push is off the learner's path, so draining costs it
       # nothing and no rollout is thrown away), 4 actors per rank
    BUDGET=${BUDGET:-570}
    mkdir -p .make && touch .make/installed
    [ -n "${SKIP_BENCH:-}" ] || step bench-y-tp2 130 $BENCH --presets 1.5b --weight-load fast,native --syncs 4 --tp 2 --server-gpus 0,1 \
      --learner-gpu 2 --log-dir "$OUT/bench-logs" --out "$OUT/bench-y-tp2.json"
    train_2p2 gpu-2p2-long 200 330
    step evidence-long 30 bash -c "evidence --json '$OUT/evidence-Y2.json' runs/gpu-2p2-long; run_logs runs/gpu-2p2-long"
    cp runs/gpu-2p2-long/metrics.jsonl "$OUT/metrics-gpu-2p2-long.jsonl" 2>/dev/null
    bundle logs-Y2.tar.gz "$OUT/bench-logs" runs/gpu-2p2-long/logs runs/gpu-2p2-long/summary.json
    rm -rf "$OUT/bench-logs"
    ;;
  Y3)  # ~7 min: bench on servers that loaded random-weight checkpoints (the load state users run): 0.5b and
       # 7b TP 1, 1.5b TP 2; then 0.5b on a load_format=dummy server (the refusal names the loader line)
    BUDGET=${BUDGET:-570}
    step bench-y3 280 $BENCH --presets 0.5b,7b --weight-load fast,native --syncs 5 --weights random \
      --log-dir "$OUT/bench-logs" --out "$OUT/bench-y3.json"
    step bench-y3-tp2 150 $BENCH --presets 1.5b --weight-load fast,native --syncs 5 --tp 2 --server-gpus 0,1 \
      --learner-gpu 2 --weights random --log-dir "$OUT/bench-logs" --out "$OUT/bench-y3-tp2.json"
    step bench-y3-dummy 100 $BENCH --presets 0.5b --weight-load fast --syncs 2 --weights dummy --reps 0 \
      --log-dir "$OUT/bench-logs-dummy" --out "$OUT/bench-y3-dummy.json"
    grep -h -E "refused|deferred|plan .* recorded" "$OUT"/bench-logs-dummy/*.log 2>/dev/null | head -n 5 | tee -a "$LOG"
    bundle logs-Y3.tar.gz "$OUT/bench-logs" "$OUT/bench-logs-dummy"
    rm -rf "$OUT/bench-logs" "$OUT/bench-logs-dummy"
    ;;
  Y4)  # ~7 min: verify session 3's last changes, never run on a GPU when written: the fence's pause without
       # vLLM's 20 ms settle sleep, the commit's gathered cache resets, the batched fingerprint (GPU tests:
       # fence under load, greedy after a sync, fast vs native digests), then the blocking stall they cut
    BUDGET=${BUDGET:-560}
    mkdir -p .make && touch .make/installed
    step models 120 bash -c "python3 tools/make_tiny_model.py --out artifacts/tiny-model &&
      python3 tools/make_tiny_model.py --preset 0.5b --out $MODELS/0.5b"
    step gpu-tests 200 python3 -m pytest -q -m gpu -rA -s --tb=short -p no:cacheprovider tests/test_gpu_vllm.py \
      tests/test_gpu_load_plan.py
    step bench-y4 230 $BENCH --presets 0.5b,7b --weight-load fast,native --syncs 5 --weights random \
      --log-dir "$OUT/bench-logs" --out "$OUT/bench-y4.json"
    bundle logs-Y4.tar.gz "$OUT/bench-logs" && rm -rf "$OUT/bench-logs"
    ;;
  Y5|Y6)  # ~5 min, 4 GPUs: the 2 + 2 split, 50 steps, overlap + fast load. Y5: DDP without the unused-parameter
          # search (NCCL, gradient checkpointing) and the session-3 fence/commit changes inside a training run;
          # Y6: the same after the actor's admission rule changed (B steps realised, pack fill; actor metrics kept)
    BUDGET=${BUDGET:-400}
    mkdir -p .make && touch .make/installed
    name=gpu-2p2-$(echo "$PART" | tr 'A-Z' 'a-z')
    train_2p2 "$name" 50 260
    step "evidence-$PART" 30 bash -c "evidence --json '$OUT/evidence-$PART.json' runs/$name; run_logs runs/$name;
      grep -c find_unused runs/$name/logs/learner.log | sed 's/^/find_unused warnings: /'"
    bundle "logs-$PART.tar.gz" "runs/$name/logs" "runs/$name/summary.json" runs/$name/actor_rank*.jsonl
    ;;
  Y7)  # ~6 min, 2 GPUs (nvidia-h200-x2): the 1 + 1 split (0.5b), async vs the synchronous `step` baseline,
       # 40 steps each, blocking sync, fast load; side by side: training time, time waiting for rollouts,
       # B steps and the B samples they trained (bench/compare_runs.py)
    BUDGET=${BUDGET:-580}   # the step run needed > 200 s for 40 steps on 2 x H200 (37 done at 200 s)
    mkdir -p .make && touch .make/installed
    [ -f $MODELS/0.5b/tandem_build.json ] && [ -f $DATA/train.jsonl ] || step models 120 bash -c "
      python3 tools/make_tiny_model.py --preset 0.5b --out $MODELS/0.5b && python3 -m common.data.synthetic --out $DATA \
      --n 96 --seed 0"
    for mode in async step; do
      rm -rf "runs/y7-$mode"
      extra=""
      [ "$mode" = step ] && extra="stage2_ab.channel_b.mode=step stage2_ab.channel_b.rollouts_per_step=8 stage2_ab.channel_b.enable_pipeline=true"
      # shellcheck disable=SC2086  # $extra is a list of overrides
      KILL_AFTER=30 step "launcher-y7-$mode" 240 python3 -m launcher --config configs/gpu/split_1p1.yaml \
        training.max_steps=40 rollout_server.weight_load=fast training.output_dir="runs/y7-$mode" run_name="y7-$mode" \
        $extra --grace-s 20
    done
    step compare-y7 30 python3 bench/compare_runs.py --json "$OUT/compare-Y7.json" runs/y7-async runs/y7-step
    grep -h "compare\|\[runs" "$LOG" | tail -3
    bundle logs-Y7.tar.gz runs/y7-async/logs runs/y7-step/logs runs/y7-async/summary.json runs/y7-step/summary.json \
      runs/y7-async/metrics.jsonl runs/y7-step/metrics.jsonl
    ;;
  Z1)  # ~7 min, 1 GPU: models + data, then the vLLM GPU tests (eager vs HF; graphs round trip over ipc and http)
    BUDGET=${BUDGET:-580}
    setup_z
    step test-gpu-vllm 480 python3 -m pytest -q -m gpu tests/test_gpu_vllm.py -rs -s -p no:cacheprovider
    grep -h "passed\|failed\|CUDA graphs, \|SKIPPED\|Error" "$LOG" | tail -12
    ;;
  Z2)  # ~8 min, 1 GPU: same-GPU sync bench (ipc vs http), then the one-GPU topology for 50 steps (sync every 2)
    BUDGET=${BUDGET:-580}
    setup_z
    step bench-one-gpu-sync 220 python3 bench/bench_one_gpu_sync.py --model $MODELS/0.5b --syncs 5 \
      --out "$OUT/one_gpu_sync.json"
    rm -rf runs/z2-one-gpu
    KILL_AFTER=30 step launcher-one-gpu 330 python3 -m launcher --config configs/gpu/one_gpu.yaml \
      training.max_steps=50 training.output_dir=runs/z2-one-gpu run_name=z2-one-gpu --grace-s 20
    evidence --json "$OUT/evidence-Z2.json" runs/z2-one-gpu >>"$LOG" 2>&1
    grep -h "| ipc\|| http\|launcher-one-gpu\|\[runs" "$LOG" | tail -8
    bundle logs-Z2.tar.gz runs/z2-one-gpu/logs runs/z2-one-gpu/summary.json runs/z2-one-gpu/metrics.jsonl
    ;;
  F1)  # ~9.5 min, 1 GPU: the 7b preset (built here, ~14 GB) trained by the real topology on ONE GPU: an hf rollout
       # server (vLLM is not staged on this part: its 0.35 share is what the launcher's memory check counts) and a
       # 1-rank learner, FSDP2 + CPU offload for 20 steps, then DDP on the same GPU (3 steps or its OOM).
       # No final checkpoint (training.save_final=false): 40 GiB of shards would not fit the machine's disk beside the model.
    BUDGET=${BUDGET:-580}
    mkdir -p .make && touch .make/installed
    step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv; nproc; free -g | head -2;
      df -h /tmp | tail -1; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"'
    # The 7b weights in RAM (/dev/shm): the first try's build to /tmp (transformers' init + a 14 GB write to the
    # virtual disk) did not finish in 200 s; --init pool draws 16 M values instead of 7.2 B.
    step models 240 bash -c "python3 tools/make_tiny_model.py --preset 7b --init pool --out /dev/shm/tandem-models/7b &&
      python3 -m common.data.synthetic --out $DATA --n 96 --seed 0 && du -sh /dev/shm/tandem-models/7b && free -g | head -2"
    F1_KEYS="model.path=/dev/shm/tandem-models/7b rollout_server.engine=hf rollout_server.device=cuda
      training.save_final=false training.eval_max_images=8 --grace-s 20"
    rm -rf runs/f1-fsdp-7b runs/f1-ddp-7b
    KILL_AFTER=30 step launcher-fsdp-7b 290 python3 -m launcher --config configs/gpu/fsdp_7b_1gpu.yaml \
      training.output_dir=runs/f1-fsdp-7b run_name=f1-fsdp-7b $F1_KEYS
    KILL_AFTER=20 step launcher-ddp-7b 150 python3 -m launcher --config configs/gpu/fsdp_7b_1gpu.yaml \
      learner.parallel=ddp training.max_steps=3 training.output_dir=runs/f1-ddp-7b run_name=f1-ddp-7b $F1_KEYS
    evidence --json "$OUT/evidence-F1.json" runs/f1-fsdp-7b runs/f1-ddp-7b >>"$LOG" 2>&1
    grep -h "mem\|OutOfMemory\|out of memory\|step time\|launcher-\|rc=" "$LOG" | tail -20
    bundle logs-F1.tar.gz runs/f1-fsdp-7b/logs runs/f1-fsdp-7b/summary.json runs/f1-fsdp-7b/metrics.jsonl \
      runs/f1-ddp-7b/logs runs/f1-ddp-7b/summary.json runs/f1-ddp-7b/metrics.jsonl
    step tiny-model 60 python3 tools/make_tiny_model.py --out artifacts/tiny-model
    step test-gpu-fsdp-sync 150 python3 -m pytest -q -m gpu tests/test_gpu_weight_sync.py -k sharded -rs -p no:cacheprovider
    ;;
  G1)  # ~8 min, 4 GPUs, no vLLM needed: DDP vs FSDP2 on a 2-rank learner (GPUs 1-2) beside an hf server (GPU 0),
       # 1.5b then 7b (built with --init pool in /dev/shm), 12 steps each, blocking NCCL sync every 4 steps
    BUDGET=${BUDGET:-580}
    mkdir -p .make && touch .make/installed
    step env 30 bash -c 'nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv; nproc; free -g | head -2;
      df -h /tmp /dev/shm | tail -2; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__,
      torch.cuda.device_count())"'
    step models 200 bash -c "python3 tools/make_tiny_model.py --out artifacts/tiny-model &&
      python3 tools/make_tiny_model.py --preset 1.5b --init pool --out /dev/shm/tandem-models/1.5b &&
      python3 tools/make_tiny_model.py --preset 7b --init pool --out /dev/shm/tandem-models/7b &&
      python3 -m common.data.synthetic --out $DATA --n 96 --seed 0 && du -sh /dev/shm/tandem-models/*"
    for size in 1.5b 7b; do
      for par in fsdp ddp; do
        name=g1-$par-$size
        rm -rf "runs/$name"
        KILL_AFTER=30 step "launcher-$name" 170 python3 -m launcher --config configs/gpu/fsdp_2gpu.yaml \
          model.path=/dev/shm/tandem-models/$size learner.parallel=$par training.output_dir="runs/$name" run_name="$name" \
          --grace-s 20
        grep -h -m1 -A2 "OutOfMemoryError" "runs/$name/logs/learner.log" 2>/dev/null | head -3 | tee -a "$LOG"
      done
    done
    evidence --json "$OUT/evidence-G1.json" runs/g1-* >>"$LOG" 2>&1
    python3 - <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, pathlib
for run in sorted(pathlib.Path("runs").glob("g1-*")):
    f = run / "summary.json"
    s = json.loads(f.read_text()) if f.is_file() else {}
    print(run.name, "steps", s.get("steps"), "step median", s.get("step_time_median_s"), "peak",
          s.get("peak_memory_gb_by_rank"), "stall", s.get("sync_stall_median_s"), "exit", s.get("exit_codes"))
PYEOF
    bundle logs-G1.tar.gz runs/g1-*/logs runs/g1-*/summary.json runs/g1-*/metrics.jsonl
    ;;
  G2)  # ~4 min, 4 GPUs, no vLLM: Stage-B (hf engine in each rank) at world size 1, 2, 4 on the 0.5b preset
    BUDGET=${BUDGET:-300}
    mkdir -p .make && touch .make/installed
    [ -f $MODELS/0.5b/tandem_build.json ] || step models 120 python3 tools/make_tiny_model.py --preset 0.5b --init pool \
      --out $MODELS/0.5b
    step stage-b 260 python3 bench/bench_stage_b.py --world-sizes 1,2,4 --config configs/stage_b/demo_cpu.yaml \
      --out "$OUT/stage_b.json" model.path=$MODELS/0.5b model.dtype=bfloat16 tickets.demo.num_groups=64
    ;;
  G8)  # ~9 min, 4 GPUs, vLLM: two 1 + 1 pairs side by side from the tiny detector's warm start (configs/gpu/quality_split.yaml),
       # 75 learner-seconds an arm: GPUs 0-1 A-only then step, GPUs 2-3 async AB then the NCCL weight-sync bench
    BUDGET=${BUDGET:-580}
    quality_setup
    quality_arms g8 1 470 &
    P1=$!
    ( sleep 20; quality_arms g8 2 250
      step bench-sync 220 $BENCH --presets 0.5b,1.5b,7b --weight-load fast --syncs 3 --reps 3 --server-gpus 2 \
        --learner-gpu 3 --log-dir "$OUT/bench-logs" --out "$OUT/bench-sync.json" ) &
    P2=$!
    wait $P1 $P2
    for k in 1 2; do cp "runs/g8-pair$k/quality.png" "$OUT/quality-pair$k.png" 2>/dev/null; done
    bundle logs-G8.tar.gz runs/g8-pair1 runs/g8-pair2 "$OUT/bench-logs"
    rm -rf "$OUT/bench-logs"
    ;;
  G9)  # ~6 min, 4 GPUs, vLLM: every GPU test (make test-gpu), the two-GPU NCCL ones included
    BUDGET=${BUDGET:-400}
    mkdir -p .make && touch .make/installed
    [ -f artifacts/tiny-model/tandem_build.json ] || step tiny-model 60 python3 tools/make_tiny_model.py --out artifacts/tiny-model
    step test-gpu 380 python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider --durations=10
    grep -h "passed\|failed\|SKIPPED\|Error" "$LOG" | tail -15
    ;;
  H1)  # ~5 min, 4 GPUs, no vLLM: models + data for H8/H9, then Stage-B throughput at 1, 2, 4 ranks (G2's bench)
    BUDGET=${BUDGET:-400}
    mkdir -p .make && touch .make/installed
    step env 30 bash -c 'nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv; nproc; free -g | head -2;
      python3 -c "import torch, transformers, fastapi, zmq, pycocotools; print(torch.__version__, transformers.__version__,
      torch.cuda.device_count())"'
    step models 150 bash -c "python3 tools/make_tiny_model.py --out artifacts/tiny-model &&
      python3 tools/make_tiny_model.py --preset 0.5b --init pool --out $MODELS/0.5b &&
      python3 -m common.data.synthetic --out $DATA --n 96 --seed 0 &&
      python3 -m common.data.synthetic --out artifacts/data/detect --split 4096/64 --seed 0 --sides 112 --max-objects 3 --size-range 0.25/0.6"
    [ -f artifacts/tiny-detector/tandem_build.json ] || cp -r .gpu-carry/tiny-detector artifacts/ 2>/dev/null
    step stage-b 230 python3 bench/bench_stage_b.py --world-sizes 1,2,4 --config configs/stage_b/demo_cpu.yaml \
      --out "$OUT/stage_b.json" model.path=$MODELS/0.5b model.dtype=bfloat16 tickets.demo.num_groups=64
    ;;
  H8)  # ~9.5 min, 4 GPUs, vLLM: the quality arms of G8 after the fence fix (75 learner-seconds an arm), then issue 19's
       # one-GPU topology run (server and learner on GPU 2, 50 steps) once pair 2's arm is done
    BUDGET=${BUDGET:-580}
    quality_setup
    quality_arms h8 1 500 &
    P1=$!
    ( sleep 15; quality_arms h8 2 260
      rm -rf runs/h8-one-gpu
      VLLM_CACHE_ROOT=/tmp/vllm-cache-pair2 KILL_AFTER=30 step launcher-one-gpu 240 python3 -m launcher \
        --config configs/gpu/one_gpu.yaml training.max_steps=50 training.output_dir=runs/h8-one-gpu run_name=h8-one-gpu \
        rollout_server.gpus=[2] learner.gpus=[2] rollout_server.port=8460 transport.base_port=5800 \
        'rollout_matching.vllm.servers=[{base_url: "http://127.0.0.1:8460"}]' --grace-s 20
      evidence --json "$OUT/evidence-H8-one-gpu.json" runs/h8-one-gpu >>"$LOG" 2>&1 ) &
    P2=$!
    wait $P1 $P2
    for k in 1 2; do cp "runs/h8-pair$k/quality.png" "$OUT/quality-pair$k.png" 2>/dev/null; done
    cp runs/h8-one-gpu/summary.json "$OUT/summary-one-gpu.json" 2>/dev/null
    bundle logs-H8.tar.gz runs/h8-pair1 runs/h8-pair2 runs/h8-one-gpu
    ;;
  H9)  # ~9.5 min, 4 GPUs, vLLM: make test-gpu on GPUs 0-1 (its tests name GPUs 0 and 1) beside the NCCL weight-sync
       # bench on GPUs 2-3 (0.5b, 1.5b, 7b; random weights written to /dev/shm: a 14 GB write to /tmp is too slow)
    BUDGET=${BUDGET:-580}
    mkdir -p .make && touch .make/installed
    [ -f artifacts/tiny-model/tandem_build.json ] || step tiny-model 60 python3 tools/make_tiny_model.py --out artifacts/tiny-model
    CUDA_VISIBLE_DEVICES=0,1 step test-gpu 560 python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider --durations=10 &
    P1=$!
    ( sleep 10; VLLM_CACHE_ROOT=/tmp/vllm-cache-bench step bench-sync 540 $BENCH --presets 0.5b,1.5b,7b --weight-load fast \
        --syncs 3 --reps 3 --server-gpus 2 --learner-gpu 3 --models /dev/shm/bench-models --log-dir "$OUT/bench-logs" \
        --out "$OUT/bench-sync.json" ) &
    P2=$!
    wait $P1 $P2
    grep -h "passed\|failed\|SKIPPED\|Error\|bench-sync" "$LOG" | tail -15
    bundle logs-H9.tar.gz "$OUT/bench-logs"
    rm -rf "$OUT/bench-logs"
    ;;
  H10|H11)  # 4 GPUs, vLLM: async arms of bench/bench_quality.py (configs/gpu/quality_split.yaml: b_ratio 0.5, sync every 8,
            # version window 2) with one knob changed, two 1 + 1 pairs side by side. H10 (~5.5 min): b_ratio 0.1 then 0.3 on
            # GPUs 0-1, 0.2 then 0.4 on GPUs 2-3, 75 learner-seconds each. H11 (~3.5 min): (sync_every_steps, version_window)
            # = (2, 1) on GPUs 0-1 and (4, 4) on GPUs 2-3, QBUDGET (60) learner-seconds each.
    BUDGET=${BUDGET:-580}
    quality_setup
    A="stage2_ab.channel_b.async"
    if [ "$PART" = H10 ]; then
      ARM1=("stage2_ab.schedule.b_ratio=0.1" "stage2_ab.schedule.b_ratio=0.3")
      ARM2=("stage2_ab.schedule.b_ratio=0.2" "stage2_ab.schedule.b_ratio=0.4")
      QB=${QBUDGET:-75}; LIMIT=275
    else
      ARM1=("$A.sync_every_steps=2 $A.version_window=1"); ARM2=("$A.sync_every_steps=4 $A.version_window=4")
      QB=${QBUDGET:-60}; LIMIT=230
    fi
    Q="python3 bench/bench_quality.py --config configs/gpu/quality_split.yaml --budget-s $QB --eval-every 100 --arms async_ab"
    sweep_pair() {  # sweep_PAIR TAG OVERRIDES...: one arm per override set, one after the other
      local tag=$1; shift
      for o in "$@"; do
        local name; name=sw-$(echo "$o" | sed 's/stage2_ab\.[a-z_.]*\.\([a-z_]*\)=/\1/g; s/ /-/g')
        # shellcheck disable=SC2086  # $o and PAIR2 are lists of overrides
        step "$name" "$LIMIT" $Q --out "runs/$name" --json "$OUT/$name.json" $o ${tag:+$PAIR2 "$SRV2"}
        cp "runs/$name/async_ab/summary.json" "$OUT/summary-$name.json" 2>/dev/null
      done
    }
    sweep_pair "" "${ARM1[@]}" &
    P1=$!
    ( sleep 15; VLLM_CACHE_ROOT=/tmp/vllm-cache-pair2 sweep_pair 2 "${ARM2[@]}" ) &
    P2=$!
    wait $P1 $P2
    bundle "logs-$PART.tar.gz" runs/sw-*/async_ab/metrics.jsonl runs/sw-*/async_ab/logs/launcher.log
    ;;
  E)  # no GPU: evidence of finished runs, e.g. bash bench/gpu_session.sh E runs/gpu-1p1-overlap runs/gpu-1p1
    evidence --json "$OUT/evidence-E.json" "$@"
    run_logs "$@"
    ;;
  *)
    echo "unknown part $PART: A|B|C|X1|X2|X3|Y1|Y2|Y3|Y4|Y5|Y6|Y7|Z1|Z2|F1|G1|G2|G8|G9|H1|H8|H9|H10|H11|E" >&2
    exit 2
    ;;
esac
echo "=== done in $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
