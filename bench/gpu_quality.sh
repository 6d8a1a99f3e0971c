#!/usr/bin/env bash
# The quality benchmark on ONE GPU (H100), from the repo root of a GPU machine:
#   0.5b preset (Qwen2.5-VL shapes, random weights, bf16) -> Stage-1 warm start (/tmp/det05) -> evaluator check
#   -> bench/bench_quality.py (A-only, async AB, step) with configs/gpu/quality_1gpu.yaml (server + learner share GPU 0).
#
#   bash bench/gpu_quality.sh                       # everything
#   STAGE=warm bash bench/gpu_quality.sh            # model, data, warm start, evaluator only
#   STAGE=bench bash bench/gpu_quality.sh           # the benchmark only (needs /tmp/det05 of a STAGE=warm run)
#   WS_STEPS=20 BUDGET_S=10 EVAL_EVERY=0 bash bench/gpu_quality.sh   # smoke
#   python3 bench/run_scenario.py quality-one-gpu [--set STAGE=warm]   # the same as a named scenario
#
# Knobs (environment): WS_STEPS (warm-start steps, 1200), WS_LR (3e-4), WS_WARMUP (50), WS_BATCH (8), BUDGET_S (learner seconds
# per arm, 60), EVAL_EVERY (steps between evaluations, 40), ARMS (a_only,async_ab,step), OUT (results, flat:
# what the GPU tool brings back), BENCH_TIMEOUT_S (540: the benchmark's deadline, so results still come back), WHL (a folder of wheels installed into /tmp/site first, if present).
# Cached between runs on the same machine: /tmp/m05 and the data (build records), /tmp/det05 (same parameters).
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE=${STAGE:-all}
WS_STEPS=${WS_STEPS:-1200}
WS_LR=${WS_LR:-3e-4}
WS_BATCH=${WS_BATCH:-8}
BUDGET_S=${BUDGET_S:-60}
EVAL_EVERY=${EVAL_EVERY:-40}
ARMS=${ARMS:-a_only,async_ab,step}
OUT=${OUT:-runs/gpu-quality}
WHL=${WHL:-.whl}
CONFIG=configs/gpu/quality_1gpu.yaml
BASE=/tmp/m05
DET=/tmp/det05
DATA=artifacts/data/detect
WORK=/tmp/gpu-quality           # run directories (checkpoint-free, but not all of it comes back)
mkdir -p "$OUT" "$WORK"
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false

ts() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }

if [ -d "$WHL" ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# GPU memory per process and utilisation every 5 s, for the whole script.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
( while true; do
    echo "$(date +%H:%M:%S) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader | tr '\n' ' ') |" \
         "$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
    sleep 5
  done ) > "$WORK/gpu_mem.txt" 2>&1 &
GPU_MON=$!

collect() {
  rc=$?
  kill "$GPU_MON" 2>/dev/null || true
  [ -n "${SRV_PID:-}" ] && kill "$SRV_PID" 2>/dev/null || true
  ts "collecting (exit $rc)"
  [ -f "$DET/tandem_build.json" ] && cp "$DET/tandem_build.json" "$OUT/warm_tandem_build.json"
  [ -f "$DET/warm_start_metrics.jsonl" ] && cp "$DET/warm_start_metrics.jsonl" "$OUT/warm_start_metrics.jsonl"
  [ -f "$WORK/eval-warm/report.json" ] && cp "$WORK/eval-warm/report.json" "$OUT/eval_warm_report.json"
  [ -f "$WORK/eval-warm/predictions.png" ] && cp "$WORK/eval-warm/predictions.png" "$OUT/eval_warm_predictions.png"
  [ -f "$WORK/bq/quality.json" ] && cp "$WORK/bq/quality.json" "$OUT/quality.json"
  [ -f "$WORK/bq/quality.png" ] && cp "$WORK/bq/quality.png" "$OUT/quality.png"
  # Everything else small in one archive: per-arm launcher output, process logs, metrics, the GPU monitor.
  (cd "$WORK" && tar czf "$OUT/details.tgz" --exclude='checkpoints' --exclude='*.safetensors' \
      gpu_mem.txt eval-warm/rollout_server.log server-warm.log bq 2>/dev/null) || true
  ls -la "$OUT"
  exit $rc
}
trap collect EXIT

if [ "$STAGE" = all ] || [ "$STAGE" = warm ]; then
  ts "base model: 0.5b preset -> $BASE"
  python3 tools/make_tiny_model.py --preset 0.5b --out "$BASE"
  ts "data -> $DATA"
  python3 -m common.data.synthetic --out "$DATA" --split 4096/64 --seed 0 --sides 112 --max-objects 3 --size-range 0.25/0.6
  ts "warm start: $WS_STEPS steps of $WS_BATCH, lr $WS_LR -> $DET"
  python3 -m learner.warm_start --config configs/warm_start_cpu.yaml --out "$DET" \
      model.path="$BASE" model.dtype=bfloat16 training.lr="$WS_LR" training.max_steps="$WS_STEPS" \
      training.per_device_train_batch_size="$WS_BATCH" training.warmup_steps="${WS_WARMUP:-50}" training.log_every_steps=50
  python3 - "$DET" <<'EOF'
import json, sys
b = json.load(open(sys.argv[1] + "/tandem_build.json"))["result"]
print("warm start result:", json.dumps(b))
EOF
  tail -n 3 "$DET/warm_start_metrics.jsonl"

  ts "evaluator on the warm start (own hf server on the GPU, port 8610)"
  rm -rf "$WORK/eval-warm"
  python3 -m rollout_server --config "$CONFIG" rollout_server.port=8610 model.path="$DET" \
      rollout_server.model_path="$DET" rollout_server.log_level=warning > "$WORK/server-warm.log" 2>&1 &
  SRV_PID=$!
  python3 - <<'EOF'
import time, urllib.request
for _ in range(180):
    try:
        print("server health:", urllib.request.urlopen("http://127.0.0.1:8610/health", timeout=2).read().decode()[:400])
        break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit("rollout server on :8610 not healthy after 180 s")
EOF
  python3 -m evaluator --model "$DET" --data "$DATA/val.jsonl" --out "$WORK/eval-warm" --config "$CONFIG" \
      --url http://127.0.0.1:8610 --max-new-tokens 128 --batch-size 64
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader || true
  kill "$SRV_PID"; wait "$SRV_PID" 2>/dev/null || true; SRV_PID=
  echo "warm-start done $(date)" > /tmp/gpu-quality-warm.marker
fi

if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  [ -f "$DET/tandem_build.json" ] || { echo "no warm start at $DET (a fresh machine?): run STAGE=warm first"; exit 1; }
  cat /tmp/gpu-quality-warm.marker 2>/dev/null || true
  ts "bench_quality: arms $ARMS, $BUDGET_S learner s each, eval every $EVAL_EVERY steps"
  rm -rf "$WORK/bq"
  timeout -k 10 "${BENCH_TIMEOUT_S:-540}" python3 bench/bench_quality.py --config "$CONFIG" --budget-s "$BUDGET_S" --eval-every "$EVAL_EVERY" \
      --arms "$ARMS" --out "$WORK/bq" || echo "bench_quality exited $?"
  for f in "$WORK"/bq/*.launcher.out; do
    [ -f "$f" ] || continue
    echo "──── $(basename "$f") tail"
    tail -n 30 "$f"
  done
fi
ts done
