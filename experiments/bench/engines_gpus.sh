#!/bin/bash
# Issue 29 items 3/6 on a lent 2-GPU host: whole GEAR iterations (gear_iteration.py) per rollout engine, 1 vs 2 GPUs,
# each variant its own process. Results land in $OUT (or ./gpu_out); the table: python experiments/bench/engines_table.py DIR
#   bash experiments/bench/engines_gpus.sh 4b      # qwen3-4b: hf / fast on 1 GPU, hf / fast (gather, replica) on 2
#   bash experiments/bench/engines_gpus.sh 8b      # qwen3-8b on 2 GPUs (it does not fit one): hf / fast (gather, replica)
#   bash experiments/bench/engines_gpus.sh tuned   # qwen3-4b, the fast decoder with trainer.compile=true and no
#                                                  # activation checkpointing, on 2 GPUs and on 1 (`tuned16`: 2 GPUs,
#                                                  # micro-batches of 16)
#   bash experiments/bench/engines_gpus.sh vllm    # needs vLLM (experiments/gpu/vllm_bring.sh): 2 GPUs (an engine per
#                                                  # GPU), 2 GPUs with one engine over both (TP2); `vllm1`: 1 GPU
# `timeout -k`: Lightning catches SIGTERM and carries on inside vLLM, so a variant past LIMIT is killed 20 s later.
# A variant whose JSON is already in $DONE (a folder of an earlier call's results) is skipped: a part resumes.
set -uo pipefail
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"; DONE="${DONE:-}"
python -c "import omegaconf, mlflow" 2>/dev/null || { echo "install the wheels first (experiments/gpu/wheels.sh)"; exit 3; }
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt" 2>/dev/null
run() {  # name shape devices engine [extra args...]
  local name=$1 shape=$2 d=$3 engine=$4; shift 4
  [[ -n "$DONE" && -f "$DONE/$name.json" ]] && { echo "$name: done earlier"; return; }
  timeout -k 20 "${LIMIT:-170}" python experiments/bench/gear_iteration.py --shape "$shape" --devices "$d" --engine "$engine" \
    --iters 3 --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 && grep '^{' "$OUT/$name.log" | cut -c1-400 \
    || { echo "$name failed"; grep -m3 -E "Error|error|Killed" "$OUT/$name.log"; }
}
case "${1:-4b}" in
  4b) run 4b_d1_hf qwen3-4b 1 hf; run 4b_d1_fast qwen3-4b 1 auto
      run 4b_d2_hf qwen3-4b 2 hf; run 4b_d2_fast qwen3-4b 2 auto
      run 4b_d2_fast_replica qwen3-4b 2 fast --sharded-weights replica ;;
  8b) run 8b_d2_hf qwen3-8b 2 hf; run 8b_d2_fast qwen3-8b 2 auto
      run 8b_d2_fast_replica qwen3-8b 2 fast --sharded-weights replica ;;
  tuned) tuned=(--set trainer.compile=true --set trainer.activation_checkpointing=false)
      run 4b_d2_fast_tuned qwen3-4b 2 auto "${tuned[@]}"; run 4b_d1_fast_tuned qwen3-4b 1 auto "${tuned[@]}" ;;
  tuned16) run 4b_d2_fast_tuned_mb16 qwen3-4b 2 auto --set trainer.compile=true \
      --set trainer.activation_checkpointing=false --set algorithm.micro_batch_size=16 ;;
  vllm) . "${VLLM_SITE:-/tmp/vsite}/env.sh" 2>/dev/null || { echo "vLLM not installed (experiments/gpu/vllm_bring.sh install)"; exit 3; }
      run 4b_d2_vllm qwen3-4b 2 vllm; run 4b_d2_vllm_tp2 qwen3-4b 2 vllm --tp 2 ;;
  vllm1) . "${VLLM_SITE:-/tmp/vsite}/env.sh" 2>/dev/null || { echo "vLLM not installed"; exit 3; }
      run 4b_d1_vllm qwen3-4b 1 vllm ;;
  *) echo "usage: $0 4b|8b|tuned|tuned16|vllm|vllm1"; exit 2 ;;
esac
