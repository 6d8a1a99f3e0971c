#!/usr/bin/env bash
# One GPU session on a 2-GPU machine (nvidia-h200-x2), in two parts that each fit one 10-minute call:
#
#   bash bench/gpu_session.sh A    # GPU tests (hf NCCL path, vLLM engine: prompts, greedy match,
#                                  # fence under load) + weight-sync bench for 0.5b and 1.5b
#   bash bench/gpu_session.sh B    # launcher: async training, >= 50 optimizer steps on the 1+1 split
#                                  # + weight-sync bench for 7b
#
# Needs vLLM 0.26.0 importable (docs/gpu.md: staged under /tmp/site) and writes logs and results to
# $OUT (default /tmp/gpu-out). Every step has its own deadline; a failed step is logged and the
# session goes on with the next one.
set -u
PART=${1:?usage: bench/gpu_session.sh A|B}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-}:$PWD" PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # machine rule: no NVLink multicast
LOG="$OUT/session-$PART.log"
T0=$(date +%s)

step() {  # step NAME DEADLINE_S CMD...
  local name=$1 limit=$2; shift 2
  echo "=== [$(( $(date +%s) - T0 ))s] $name (deadline ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
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
    python3 -m common.synthetic --out /tmp/tandem-data/synth --n 96 --seed 0'
}

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
esac
echo "=== done in $(( $(date +%s) - T0 ))s" | tee -a "$LOG"
