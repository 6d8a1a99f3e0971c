#!/usr/bin/env bash
# The crowded quality table with seeds on several GPUs, in ONE call of a bare machine (issue 34), from the repo root:
#   tiny preset (native 168 px) -> crowded data -> Stage-1 warm start for WS_BUDGET_S wall seconds
#   -> bench/bench_quality.py --gpus: SEEDS x (A-only, async AB, step), one run per GPU at a time,
#      configs/gpu/quality_crowded_1gpu.yaml (an hf server and the learner share the run's GPU), VAL_IMAGES images.
#
#   bash bench/gpu_quality_seeds.sh                                  # 3 GPUs, ~430 s
#   WS_BUDGET_S=40 WS_BATCH=4 BUDGET_S=8 SEEDS=1 GPUS=0,1 VAL_IMAGES=16 N_TRAIN=256 TOTAL_S=900 \
#       bash bench/gpu_quality_seeds.sh                              # CPU smoke, ~4 min on 2 cores
#   python3 bench/run_scenario.py quality-gpu-seeds [--set SEEDS=5]  # the same as a named scenario
#   STAGE=warm WS_BUDGET_S=360 TOTAL_S=450 bash ...; STAGE=bench GPUS=0,1,2,3 SEEDS=4 TOTAL_S=400 bash ...
#       # two calls back to back on one machine (its /tmp kept): a longer warm start than one call's 600 s allows
#
# Knobs (environment): STAGE (all | warm: model, data, validation set, warm start | bench: the arms, from what a
# warm stage left in WORK), GPUS (slots, 0,1,2), SEEDS (3), ARMS (a_only,async_ab,step), BUDGET_S (learner seconds
# per run, 30), EVAL_EVERY (steps between evaluations, 0: the two ends only), LR (Stage-2 lr, 2e-4: the config's; the first GPU tables ran 2e-5), VAL_IMAGES
# (512), WS_BUDGET_S (warm start wall seconds, calibration included, 140), WS_LR (2e-3), WS_BATCH (64), WS_DTYPE (auto:
# bfloat16 on a GPU, where torch's varlen kernel runs: the small preset's warm start made 205 samples/s at 64 against
# 31 in float32 at 16 on an H200, docs/benchmarks.md section 21; float32 without CUDA), WS_NPROC (warm-start ranks:
# torchrun DDP over GPUs 0..N-1, each rank WS_BATCH samples a step; 1), WS_WORKERS
# (data.encode_workers of the warm start: 12; building a 16-sample window in-process took as long as its step),
# PRESET (tools/make_tiny_model.py: tiny; small: 14x the parameters; neither localised crowded scenes after a
# float32 warm start of 16 a step in one call: F1 0.008 and 0.000; nor small's bfloat16 one of 591 steps of 64: 0.006,
# docs/benchmarks.md section 21),
# MAX_PIXELS (the model's image area cap: 28224 = 168 px, 6 x 6 merged patches), SIDES (crowded image sides, e.g.
# 336 with MAX_PIXELS=112896: 12 x 12 merged patches; empty: the crowded preset's 112..168), N_TRAIN
# (1536: ~14 ms an image to draw at 168 px, ~0.1 s at 336; one drawing process per core), WARM_EVAL_IMAGES (the
# warm stage ends scoring the warm start on this many of the split's validation images, report in OUT/warm_eval, and
# scores each curriculum stage on its own set, reports in details.tgz: 64), SCORE_PORT (the port of the hf server
# those scores decode on: 8790; warm stages side by side on one machine, one a GPU, each need their own, or one
# stage's evaluator would score another's detector), WS_SAVE_S (45: the seconds each warm-start stage leaves of
# what is left of WS_BUDGET_S for its start-up and save; it trains for the rest, training.max_train_seconds, and saves),
# WS_FROM (a warm start folder an earlier STAGE=warm call left, e.g. /tmp/gpu-quality-seeds/det: this warm stage
# continues from its weights with a fresh AdamW and lr schedule, on the same data when N_TRAIN matches),
# WS_CURRICULUM (empty; e.g. 800:3:0.25/0.6,800:10:0.12/0.35: warm-start stages on easier scenes of the same size
# before the crowded one, STEPS:MAX_OBJECTS:LOW/HIGH each), TASK (the scenes the warm start ends on and the arms train
# and are scored on: crowded, 10..40 small shapes (common/data/synthetic.py --crowded); dense, 1..10 shapes of 12-35 %
# of the side, the density the tiny preset reached F1 0.10 on after 4,200 GPU steps of 16 from its easy-scene
# detector, docs/benchmarks.md section 21), WORK (/tmp/gpu-quality-seeds), TOTAL_S (470: the benchmark's deadline is
# what is left of it, so results come back in time), OUT.
# Without CUDA the runs go to the CPU (the slots are then port sets only): the smoke test of this script.
# Every stage runs under a deadline and quality.json is rewritten after every run, so a slow stage still
# leaves whole seeds. The warm start's F1 is the first evaluation of the step arm (ver 1: its weights).
set -uo pipefail
cd "$(dirname "$0")/.."

STAGE=${STAGE:-all}
GPUS=${GPUS:-0,1,2}
SEEDS=${SEEDS:-3}
ARMS=${ARMS:-a_only,async_ab,step}
BUDGET_S=${BUDGET_S:-30}
EVAL_EVERY=${EVAL_EVERY:-0}
LR=${LR:-2e-4}
VAL_IMAGES=${VAL_IMAGES:-512}
WS_BUDGET_S=${WS_BUDGET_S:-140}
WS_LR=${WS_LR:-2e-3}
WS_BATCH=${WS_BATCH:-64}
WS_DTYPE=${WS_DTYPE:-auto}
WS_NPROC=${WS_NPROC:-1}
WS_WORKERS=${WS_WORKERS:-12}
PRESET=${PRESET:-tiny}
MAX_PIXELS=${MAX_PIXELS:-28224}
SIDES=${SIDES:-}
N_TRAIN=${N_TRAIN:-1536}
WARM_EVAL_IMAGES=${WARM_EVAL_IMAGES:-64}
SCORE_PORT=${SCORE_PORT:-8790}
WS_SAVE_S=${WS_SAVE_S:-45}
WS_FROM=${WS_FROM:-}
WS_CURRICULUM=${WS_CURRICULUM:-}
TOTAL_S=${TOTAL_S:-470}
OUT=${OUT:-runs/gpu-quality-seeds}
CONFIG=configs/gpu/quality_crowded_1gpu.yaml
TASK=${TASK:-crowded}
WORK=${WORK:-/tmp/gpu-quality-seeds}         # model, warm start, run directories (not all of it comes back)
BASE=$WORK/model DET=$WORK/det DATA=$WORK/data/$TASK
case $STAGE in all|warm|bench) ;; *) echo "STAGE=$STAGE: one of all, warm, bench" >&2; exit 2;; esac
case $TASK in
  crowded) TASK_ARGS=(--crowded) ;;
  dense) TASK_ARGS=(--max-objects 10 --size-range 0.12/0.35) ;;
  *) echo "TASK=$TASK: one of crowded (10..40 small shapes), dense (1..10 shapes of 12-35 % of the side)" >&2; exit 2;;
esac
for spec in ${WS_CURRICULUM//,/ }; do  # every knob checked before the first stage spends a minute
  [[ "$spec" =~ ^[0-9]+:[0-9]+:[0-9.]+/[0-9.]+$ ]] || { echo "WS_CURRICULUM stage '$spec': not" \
      "STEPS:MAX_OBJECTS:LOW/HIGH. Fix: e.g. WS_CURRICULUM=800:3:0.25/0.6,800:10:0.12/0.35" >&2; exit 2; }
done
[[ "$SCORE_PORT" =~ ^[0-9]+$ ]] && [ "$SCORE_PORT" -ge 1024 ] && [ "$SCORE_PORT" -le 65535 ] || { echo "SCORE_PORT=$SCORE_PORT:" \
    "not a port. Fix: a free port from 1024 to 65535, one per warm stage running beside another" >&2; exit 2; }
[[ "$WS_SAVE_S" =~ ^[0-9]+$ ]] || { echo "WS_SAVE_S=$WS_SAVE_S: not a whole number of seconds. Fix: e.g. WS_SAVE_S=45" >&2
    exit 2; }
[ -z "$WS_FROM" ] || [ -f "$WS_FROM/config.json" ] || { echo "WS_FROM=$WS_FROM: no config.json there. Fix: point it" \
    "at a warm start folder an earlier STAGE=warm call left on this machine ($WORK/det)" >&2; exit 2; }
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
exec 3>&1                                     # the log, for stage lines whose command's output goes elsewhere
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
STAGES=$OUT/stages.txt
: > "$STAGES"

ts() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }
stage() {  # stage NAME DEADLINE_S CMD...: run under a deadline, record its seconds and exit code
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  ts "$name (deadline ${limit}s): $*" >&3
  timeout -k 10 "$limit" "$@"
  rc=$?
  echo "$name $((SECONDS - t0)) s rc=$rc" | tee -a "$STAGES" >&3
  return $rc
}
left() { echo $((TOTAL_S - SECONDS)); }
score() {  # score NAME MODEL VAL_JSONL OUT_DIR: a warm start's own F1 before anything spends time on it, by an hf
  # server on GPU 0 (the CPU without CUDA) and `python -m evaluator` on WARM_EVAL_IMAGES images at the arms' cap
  local name=$1 model=$2 val=$3 out=$4
  python3 -m rollout_server --config "$CONFIG" rollout_server.port="$SCORE_PORT" model.path="$model" \
      rollout_server.model_path="$model" "${DATA_KEYS[@]}" "${DEVICE[@]}" > "$WORK/$name-server.log" 2>&1 &
  EVAL_SERVER=$!
  stage "$name" 240 python3 -m evaluator --url "http://127.0.0.1:$SCORE_PORT" --model "$model" --data "$val" --config "$CONFIG" \
      --max-images "$WARM_EVAL_IMAGES" --max-new-tokens 1400 --batch-size 64 --server-timeout 150 --out "$out" \
      --overwrite --grid 4
  kill "$EVAL_SERVER" 2>/dev/null; wait "$EVAL_SERVER" 2>/dev/null; EVAL_SERVER=
}

ON_GPU=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
DEVICE=()
if [ "$ON_GPU" = 1 ]; then
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
  ( while true; do
      echo "$(date +%H:%M:%S) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader | tr '\n' ' ')"
      sleep 5
    done ) > "$OUT/gpu_mem.txt" 2>&1 &
  GPU_MON=$!
else
  ts "no CUDA: every process on the CPU; the slots $GPUS are port sets"
  DEVICE=(rollout_server.device=cpu rollout_server.gpus=null learner.gpus=null learner.backend=gloo)
fi

collect() {
  rc=$?
  [ -n "${GPU_MON:-}" ] && kill "$GPU_MON" 2>/dev/null
  [ -n "${VAL_PID:-}" ] && kill "$VAL_PID" 2>/dev/null
  [ -n "${EVAL_SERVER:-}" ] && kill "$EVAL_SERVER" 2>/dev/null
  ts "collecting (exit $rc)"
  for f in tandem_build.json warm_start_metrics.jsonl; do
    [ -f "$DET/$f" ] && cp "$DET/$f" "$OUT/warm_$f"
  done
  [ -f "$WORK/bq/quality.png" ] && cp "$WORK/bq/quality.png" "$OUT/quality.png"
  (cd "$WORK" && tar czf "$OUT/details.tgz" --exclude='checkpoints' --exclude='*.safetensors' bq ws-cal.out \
      ws.out ws-stage*.out curriculum 2>/dev/null)  # a call returns 8 files: the curriculum's curves travel in here
  cat "$STAGES"
  ls -la "$OUT"
  exit $rc
}
trap collect EXIT

DATA_KEYS=(data.train_jsonl="$DATA/train.jsonl" data.val_jsonl="$DATA/val.jsonl")
if [ "$STAGE" != bench ]; then
stage model 120 python3 tools/make_tiny_model.py --preset "$PRESET" --max-pixels "$MAX_PIXELS" --out "$BASE" || exit 1
if [ -n "$WS_FROM" ] && [ -f "$DATA/train.jsonl" ] && [ "$(wc -l < "$DATA/train.jsonl")" = "$N_TRAIN" ]; then
  ts "data: $DATA holds $N_TRAIN training records (an earlier call's; WS_FROM continues on them)"
else
  stage data 240 python3 -m common.data.synthetic "${TASK_ARGS[@]}" ${SIDES:+--sides "$SIDES"} --out "$DATA" \
      --split "$N_TRAIN/64" --seed 0 || exit 1
fi
START=$BASE
if [ -n "$WS_FROM" ]; then  # continue an earlier call's warm start: its weights, fresh AdamW and lr schedule
  rm -rf "$WORK/det-from" && cp -r "$WS_FROM" "$WORK/det-from" && START=$WORK/det-from
  cp "$WS_FROM/warm_start_metrics.jsonl" "$OUT/warm_from_metrics.jsonl" 2>/dev/null
fi
# The validation set of VAL_IMAGES (bench_quality.larger_val_set: it renders the training records again
# beside it) is drawn on the CPU while the warm start trains; the benchmark then finds it built.
timeout -k 5 240 python3 -c "import sys; sys.path.insert(0, 'bench'); import bench_quality as bq
print('validation set:', bq.larger_val_set('$CONFIG', sys.argv[1:], $VAL_IMAGES))" "${DATA_KEYS[@]}" \
    > "$WORK/val.out" 2>&1 &
VAL_PID=$!

# Stage-1 warm start for WS_BUDGET_S wall seconds: the warm start counts steps, not seconds, so a 16-step
# calibration measures the step (the median of its last 8: the encoding workers fill up over the first ones, and
# a median of steps 3-12 took 0.56 s where the run then made 0.33) and the start-up, and the real one gets the
# steps that fit what is left. Each stage also stops at its training.max_train_seconds (what is left of WS_BUDGET_S
# less WS_SAVE_S for start-up and save) and saves what it trained: a step slower than calibrated (four warm starts
# side by side on one machine) once ran into the stage's deadline and saved nothing.
train_s() { echo $(( $1 > 5 ? $1 : 5 )); }  # a stage's training seconds: the config refuses 0
[ "$WS_DTYPE" = auto ] && { [ "$ON_GPU" = 1 ] && WS_DTYPE=bfloat16 || WS_DTYPE=float32; }
WS_KEYS=(model.path="$START" model.dtype="$WS_DTYPE" model.attn_implementation=varlen "${DATA_KEYS[@]}" training.lr="$WS_LR" training.min_lr_ratio=0.1
         training.per_device_train_batch_size="$WS_BATCH" training.global_max_length=$((WS_BATCH > 16 ? WS_BATCH * 1024 : 16384)) training.log_every_steps=1
         data.encode_workers="$WS_WORKERS")
WS_RUN=(python3 -m learner.warm_start)
[ "$WS_NPROC" -gt 1 ] && WS_RUN=(python3 -m torch.distributed.run --standalone --nproc_per_node="$WS_NPROC"
                               -m learner.warm_start)
T_WS=$SECONDS
# Curriculum (WS_CURRICULUM): stages of easier scenes at the same image size before the crowded warm start, each
# STEPS:MAX_OBJECTS:LOW/HIGH (1..MAX_OBJECTS shapes of LOW-HIGH of the side) continuing from the last; the CPU's
# tiny preset localised 1..3 shapes of 25-60 % (docs/warm_start.md), and 1..10 smaller ones better after them than from
# scratch (F1 0.075 and 0.063 against 0.014 and 0.010 in 1,600 steps of 8, two seeds, docs/benchmarks.md section 21).
n=0
for spec in ${WS_CURRICULUM//,/ }; do
  n=$((n + 1))
  IFS=: read -r C_STEPS C_MAX C_SIZE <<< "$spec"
  C_LEFT=$((WS_BUDGET_S - (SECONDS - T_WS)))
  [ "$C_LEFT" -lt 60 ] && { ts "curriculum stage $n and after skipped: ${C_LEFT} s of WS_BUDGET_S left"; break; }
  C_DATA=$WORK/data/stage$n
  stage "data-stage$n" 120 python3 -m common.data.synthetic --out "$C_DATA" --split 8192/64 --seed "$n" \
      ${SIDES:+--sides "$SIDES"} --max-objects "$C_MAX" --size-range "$C_SIZE" || exit 1
  rm -rf "$WORK/det-stage$n"
  stage "warm-stage$n" "$((WS_BUDGET_S - (SECONDS - T_WS)))" "${WS_RUN[@]}" --config configs/warm_start_cpu.yaml \
      --out "$WORK/det-stage$n" "${WS_KEYS[@]}" data.train_jsonl="$C_DATA/train.jsonl" \
      data.val_jsonl="$C_DATA/val.jsonl" training.max_steps="$C_STEPS" training.warmup_steps=20 \
      training.max_train_seconds=$(train_s $((WS_BUDGET_S - (SECONDS - T_WS) - WS_SAVE_S))) > "$WORK/ws-stage$n.out" 2>&1
  tail -n 2 "$WORK/ws-stage$n.out"
  mkdir -p "$WORK/curriculum" && cp "$WORK/det-stage$n/warm_start_metrics.jsonl" "$WORK/curriculum/stage$n.jsonl" 2>/dev/null
  [ -f "$WORK/det-stage$n/config.json" ] || break  # late or failed: the crowded stage starts from the last that finished
  score "eval-stage$n" "$WORK/det-stage$n" "$C_DATA/val.jsonl" "$WORK/curriculum/eval-stage$n"  # in details.tgz
  START=$WORK/det-stage$n
  WS_KEYS=("${WS_KEYS[@]}" model.path="$START")
done
rm -rf "$WORK/det-cal"
T_CAL=$SECONDS
CAL_S=$((WS_BUDGET_S - (SECONDS - T_WS))); [ "$CAL_S" -lt 30 ] && CAL_S=30  # what the curriculum left
stage warm-calibration "$CAL_S" "${WS_RUN[@]}" --config configs/warm_start_cpu.yaml \
    --out "$WORK/det-cal" "${WS_KEYS[@]}" training.max_steps=16 training.warmup_steps=4 > "$WORK/ws-cal.out" 2>&1
tail -n 2 "$WORK/ws-cal.out"
WS_STEPS=$(python3 - "$WORK/det-cal" $((WS_BUDGET_S - (SECONDS - T_WS))) $((SECONDS - T_CAL)) <<'EOF'
import json, statistics, sys
folder, left, cal_wall = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
try:
    recs = [json.loads(line) for line in open(folder + "/warm_start_metrics.jsonl")]
    step_s = statistics.median(r["time/step"] for r in recs[-8:])
    start_s = max(cal_wall - recs[-1]["time/elapsed"], 5.0)  # imports, CUDA, model load, save
except (OSError, ValueError, KeyError, statistics.StatisticsError) as exc:
    print(f"calibration unreadable ({exc}): no warm start beyond it", file=sys.stderr)
    print(0)
    raise SystemExit
steps = int((left - start_s - 5) / step_s)
print(f"calibration: {step_s * 1000:.0f} ms a step, {start_s:.0f} s start-up and save; {left:.0f} s left "
      f"-> {steps} steps", file=sys.stderr)
print(min(steps, 50000) if steps >= 50 else 0)  # 0: no time left, the calibration model is the warm start
EOF
)
if [ "$WS_STEPS" -gt 0 ]; then
  ts "warm start: $WS_STEPS steps of $WS_BATCH x $WS_NPROC ranks at lr $WS_LR in $WS_DTYPE"
  stage warm-start $((WS_BUDGET_S - (SECONDS - T_WS) + 30)) "${WS_RUN[@]}" \
      --config configs/warm_start_cpu.yaml --out "$DET" "${WS_KEYS[@]}" training.max_steps="$WS_STEPS" \
      training.warmup_steps=20 training.max_train_seconds=$(train_s $((WS_BUDGET_S - (SECONDS - T_WS) - WS_SAVE_S + 30))) \
      > "$WORK/ws.out" 2>&1
  tail -n 2 "$WORK/ws.out"
fi
fi  # STAGE != bench
for fallback in "$WORK/det-cal" "$BASE"; do  # late or failed: a weaker start still gives the table
  [ -f "$DET/config.json" ] && break
  ts "no warm start at $DET: the arms start from $fallback"
  DET=$fallback
done
python3 -c "import json,sys; b=json.load(open(sys.argv[1]))['result']; print('warm start result:', json.dumps(b))" \
    "$DET/tandem_build.json" 2>/dev/null || true
[ -n "${VAL_PID:-}" ] && wait "$VAL_PID"; VAL_PID=
cat "$WORK/val.out"
if [ "$STAGE" = warm ]; then
  score warm-eval "$DET" "$DATA/val.jsonl" "$OUT/warm_eval"
  ts "warm stage done: STAGE=bench on this machine runs the arms"
  exit 0
fi

# The arms: SEEDS x ARMS on the GPU slots; what is left of TOTAL_S (less room to collect) is their deadline.
BENCH_S=$(( $(left) - 25 ))
rm -rf "$WORK/bq"
stage bench "$((BENCH_S + 20))" python3 bench/bench_quality.py --config "$CONFIG" --gpus "$GPUS" --seeds "$SEEDS" \
    --arms "$ARMS" --val-images "$VAL_IMAGES" --budget-s "$BUDGET_S" --eval-every "$EVAL_EVERY" \
    --deadline-s "$((BENCH_S - 30))" --out "$WORK/bq" --json "$OUT/quality.json" \
    model.path="$DET" "${DATA_KEYS[@]}" training.lr="$LR" "${DEVICE[@]}"
python3 - "$OUT/quality.json" <<'EOF' || true
import json, sys
q = json.load(open(sys.argv[1]))
for r in q["arms"]:
    if r["arm"] == "step" and r["first"]:
        print(f"warm start (the step arm's first evaluation, seed {r['seed']}): F1@0.5 {r['first']['f1']:.3f} "
              f"on {q['val_images']} images")
        break
EOF
ts done
